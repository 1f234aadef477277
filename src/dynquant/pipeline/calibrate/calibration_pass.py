"""The calibration pass, block by block: input statistics of every quantizable module, routed
tokens per expert, optionally X^T X per Linear (handed to a ``MomentsSink`` as each block's
are summed: written to files, or used and dropped), and each block's input hidden states (kept
for the Fisher pass) in one streamed forward over the calibration sequences.

Each block's sequences run in shards (``SHARD_SEQS`` where the pass sums X^T X, else one;
fixed, whatever runs them), each shard a job on the executor (``pipeline/execute/executor.py``):
here, or on a Ray worker that reads the block's weights itself and returns the shard's outputs
and raw sums. The driver folds the
shards' sums in shard order, so the statistics are the same bits on either executor; the
block's forward runs on the driver's number of threads everywhere (a worker takes it on; a
product's rounding depends on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.calibrate.block_stream import ActivationStore, BlockStream
from dynquant.pipeline.calibrate.statistics import InputStatistics
from dynquant.pipeline.calibrate.weights import WeightsAt
from dynquant.pipeline.execute.executor import Executor, InOrder, LocalExecutor, use_threads
from dynquant.pipeline.execute.progress import StageProgress

SHARD_SEQS = 8  # calibration sequences per job (the default --calib-seqs: one job per block)

# Takes a block's X^T X / tokens (block index, module -> [in, in] or a bank's [E, in, in], a
# progress note): the pass drops them after the call, so a block's are all it ever holds.
MomentsSink = Callable[[int, dict[str, torch.Tensor], Callable[[str], None]], None]


def moments_files(directory: Path) -> MomentsSink:
    """A sink writing each block's moments to ``directory/block_NNN.safetensors`` (modules that
    read the same input, like q/k/v, get a tensor each: safetensors refuses shared storage)."""
    def save(block: int, moments: dict[str, torch.Tensor], say: Callable[[str], None]) -> None:
        say("writing its second moments")
        directory.mkdir(parents=True, exist_ok=True)
        save_file(moments, str(directory / f"block_{block:03d}.safetensors"),
                  metadata={"format": "dynquant-second-moments"})
    return save


@dataclass
class CalibrationPass:
    stream: BlockStream
    stats: dict[str, torch.Tensor]
    inputs: ActivationStore  # block i's input at index i; the last block's output at index L

    def close(self) -> None:
        self.inputs.close()


@dataclass
class BlockShard:
    """One job: a block, and some chunks of hidden states with their recorded arguments."""

    block: int
    hidden: list[torch.Tensor]
    recorded: list[tuple]
    # the block's tensors quantized so far (parameter path inside the block -> codes): a worker
    # runs the block as the driver has it (the sequential gptq pass)
    replaced: dict[str, QuantizedTensor] = field(default_factory=dict)


@dataclass
class BlockWork:
    """What every shard job shares: where the weights are, the modules to watch."""

    weights: WeightsAt
    dtype: torch.dtype
    modules: frozenset[str]
    second_moments: bool
    threads: int


_STREAMS: dict[tuple, BlockStream] = {}  # this process's skeleton per model (a worker's cache)


def shard_stream(work: BlockWork) -> BlockStream:
    """The skeleton a shard job runs on: the driver's own stream for jobs run by the driver
    (``serving``), else this process's, built once per model."""
    key = (work.weights.key, work.dtype)
    if key not in _STREAMS:
        _STREAMS.clear()  # one model's skeleton at a time
        _STREAMS[key] = BlockStream(work.weights.source, work.weights.open(),
                                    torch.empty(0, 0, dtype=torch.long), dtype=work.dtype)
    return _STREAMS[key]


@contextmanager
def serving(stream: BlockStream, work: BlockWork) -> Iterator[None]:
    """Jobs run in this process use ``stream`` (its recorded arguments, its materialized
    block) while the context lasts."""
    _STREAMS.clear()
    _STREAMS[(work.weights.key, work.dtype)] = stream
    try:
        yield
    finally:
        _STREAMS.clear()


def put_codes(param: nn.Parameter, qt: QuantizedTensor) -> None:
    """Run ``param`` with ``qt``'s dequantized weights: the one way the driver and a worker put
    the codes in place (so their blocks compute the same bits)."""
    param.data = qt.dequantize(torch.float32).reshape(param.shape).to(param.dtype)


@contextmanager
def block_as_driven(stream: BlockStream, index: int,
                    replaced: dict[str, QuantizedTensor]) -> Iterator[nn.Module]:
    """Block ``index`` with the driver's weights: as it stands when it is held already (by the
    driver, for the jobs run here), else read from the model's files with the ``replaced``
    tensors' codes put in their place, and released after."""
    block = stream.blocks[index]
    first = next(block.parameters(), None)
    if first is None or first.device.type != "meta":
        yield block
        return
    stream.materialize(block, stream.block_prefix(index))
    try:
        for name, qt in replaced.items():
            put_codes(block.get_parameter(name), qt)
        yield block
    finally:
        stream.release(block)


def block_shard_job(job: BlockShard, work: BlockWork
                    ) -> tuple[list[torch.Tensor], dict[str, dict]]:
    """The shard's outputs of the block and its raw input sums."""
    use_threads(work.threads)
    stream = shard_stream(work)
    stats = InputStatistics(stream.model, set(work.modules), work.second_moments)
    try:
        with block_as_driven(stream, job.block, job.replaced):
            out = stream.run_block(job.block, job.hidden, job.recorded)
    finally:
        stats.remove()
    return out, stats.partial()


def shards_of(stream: BlockStream, index: int, hidden: list[torch.Tensor],
              replaced: dict[str, QuantizedTensor] | None = None,
              sequences: int = SHARD_SEQS) -> list[BlockShard]:
    """Block ``index``'s jobs: whole chunks of about ``sequences`` sequences each, in order."""
    per = max(1, sequences // stream.chunk)  # chunks per shard
    return [BlockShard(index, hidden[k:k + per], stream.calls[index][k:k + per],
                       dict(replaced or {})) for k in range(0, len(hidden), per)]


def run_calibration_pass(stream: BlockStream, modules: set[str],
                         moments: MomentsSink | None = None, progress: bool = False,
                         activation_limit: int = 8 << 20,
                         executor: Executor | None = None,
                         activations_dir: Path | None = None) -> CalibrationPass:
    """Stream the calibration ``ids`` through every block once. ``moments``: each block's X^T X
    / tokens handed to it once summed (``moments_files``: written to a folder);
    ``activations_dir``: where the blocks' inputs past ``activation_limit`` are kept.

    Jobs: without moments, a window each (small sums: the same folds on any executor); with
    them, ``SHARD_SEQS`` windows each (a window's X^T X is as large as a shard's), and on a
    cluster they are submitted without waiting while the next block's inputs come from forward
    jobs of a window each (the same outputs, bit for bit), so that only the forward is a chain
    over the blocks; their sums are folded in the same order as here."""
    stats = InputStatistics(stream.model, set(), second_moments=moments is not None)
    work = BlockWork(WeightsAt.of(stream.source, False), stream.dtype, frozenset(modules),
                     moments is not None, torch.get_num_threads())
    forward = replace(work, modules=frozenset(), second_moments=False)
    executor = executor or LocalExecutor()
    beside = moments is not None and not executor.runs_here
    store = ActivationStore(activation_limit, activations_dir)
    hidden = stream.record()
    # on a cluster, each block's X^T X jobs (block index, its shards' jobs)
    pending: InOrder[int, tuple] = InOrder(executor, work.threads)
    try:
        with StageProgress(enabled=progress) as bar, serving(stream, work):
            task = bar.add_task("calibration pass", total=len(stream.blocks))
            for i in range(len(stream.blocks)):
                store.put(i, hidden)
                shards = shards_of(stream, i, hidden, sequences=SHARD_SEQS if moments
                                   else 1)
                if beside:
                    pending.add(i, [executor.submit(block_shard_job, sh, work, work.threads)
                                    for sh in shards])
                    hidden = [h for out, _ in executor.map(
                        block_shard_job, shards_of(stream, i, hidden, sequences=1), forward,
                        cpus=work.threads) for h in out]
                else:
                    hidden = _run_block_shards(stream, i, shards, stats, work, executor, bar,
                                               task)
                for b, parts in pending.ready(end=i == len(stream.blocks) - 1):
                    bar.note(task, f"block {b + 1}'s moments")
                    for _, part in parts:
                        stats.add(part)
                    _hand_over(stats, b, moments, bar, task)
                if moments is not None and not beside:
                    _hand_over(stats, i, moments, bar, task)
                bar.advance(task)
        store.put(len(stream.blocks), hidden)
        _head_statistics(stream, modules, stats, hidden)
    except BaseException:
        store.close()
        raise
    return CalibrationPass(stream, stats.result(), store)


def _run_block_shards(stream: BlockStream, i: int, shards: list[BlockShard],
                      stats: InputStatistics, work: BlockWork, executor: Executor,
                      bar: StageProgress, task: int) -> list[torch.Tensor]:
    """Block ``i``'s shards run and folded in order; returns the block's outputs."""
    hidden: list[torch.Tensor] = []
    # the block read once for all its shards when they run here (each job would read it again)
    with (block_as_driven(stream, i, {}) if executor.runs_here
          else contextlib.nullcontext()):
        for out, part in executor.map(block_shard_job, shards, work, cpus=work.threads):
            hidden.extend(out)
            stats.add(part)
            bar.note(task, f"block {i + 1}: {len(hidden)}/{len(stream.calls[i])} "
                           "chunks of windows")
    return hidden


def _head_statistics(stream: BlockStream, modules: set[str], stats: InputStatistics,
                     final: list[torch.Tensor]) -> None:
    """The mean squared inputs of the quantized Linears after the blocks (an untied lm_head),
    from the last block's outputs. Squares only: the Fisher pass takes a head's X^T X over
    the moment windows itself (``fisher.head_input_moments``)."""
    if not any(n in modules and isinstance(m, nn.Linear) for n, m in stream.head_modules()):
        return
    with stream.heads_held() as parts:
        ids = list(stream.chunks())
        for name, module in parts:
            if name in modules and isinstance(module, nn.Linear):
                stream.head_inputs(module, final, ids,
                                   lambda x, n=name: stats.observe(n, x, second=False))


def _hand_over(stats: InputStatistics, block: int, sink: MomentsSink, bar: StageProgress,
               task: int) -> None:
    """Block ``block``'s X^T X to ``sink``, then dropped from memory."""
    sink(block, stats.second_moments(), lambda what: bar.note(task, f"block {block + 1}: {what}"))
    stats.moments.clear()
