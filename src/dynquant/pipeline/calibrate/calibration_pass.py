"""The calibration pass, block by block: input statistics of every quantizable module, routed
tokens per expert, optionally X^T X per Linear, and each block's input hidden states (kept for
the Fisher pass) in one streamed forward over the calibration sequences.

Each block's sequences run in shards of ``SHARD_SEQS`` (fixed, whatever runs them), each shard
a job on the executor (``pipeline/execute/executor.py``): here, or on a Ray worker that reads the
block's weights itself and returns the shard's outputs and raw sums. The driver folds the
shards' sums in shard order, so the statistics are the same bits on either executor; the
block's forward runs on the driver's number of threads everywhere (a worker takes it on; a
product's rounding depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynquant.pipeline.calibrate.block_stream import ActivationStore, BlockStream
from dynquant.pipeline.calibrate.statistics import InputStatistics
from dynquant.pipeline.calibrate.weights import WeightsAt
from dynquant.pipeline.execute.executor import Executor, LocalExecutor, use_threads
from dynquant.pipeline.execute.progress import StageProgress

SHARD_SEQS = 8  # calibration sequences per job (the default --calib-seqs: one job per block)


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


@dataclass
class BlockWork:
    """What every shard job shares: where the weights are, the modules to watch."""

    weights: WeightsAt
    dtype: torch.dtype
    modules: frozenset[str]
    second_moments: bool
    threads: int


_STREAMS: dict[tuple, BlockStream] = {}  # this process's skeleton per model (a worker's cache)


def _stream(work: BlockWork) -> BlockStream:
    key = (work.weights.key, work.dtype)
    if key not in _STREAMS:
        _STREAMS.clear()  # one model's skeleton at a time
        _STREAMS[key] = BlockStream(work.weights.source, work.weights.open(),
                                    torch.empty(0, 0, dtype=torch.long), dtype=work.dtype)
    return _STREAMS[key]


def block_shard_job(job: BlockShard, work: BlockWork
                    ) -> tuple[list[torch.Tensor], dict[str, dict]]:
    """The shard's outputs of the block and its raw input sums (the block's weights read for
    the job, released after)."""
    use_threads(work.threads)
    stream = _stream(work)
    block = stream.blocks[job.block]
    stats = InputStatistics(stream.model, set(work.modules), work.second_moments)
    stream.materialize(block, stream.block_prefix(job.block))
    try:
        out = stream.run_block(job.block, job.hidden, job.recorded)
    finally:
        stream.release(block)
        stats.remove()
    return out, stats.partial()


def run_calibration_pass(stream: BlockStream, modules: set[str],
                         moments_dir: Path | None = None, progress: bool = False,
                         activation_limit: int = 8 << 20,
                         executor: Executor | None = None) -> CalibrationPass:
    """Stream the calibration ``ids`` through every block once. ``moments_dir``: write each
    block's X^T X / tokens there (``block_NNN.safetensors``, module -> [in, in])."""
    stats = InputStatistics(stream.model, set(), second_moments=moments_dir is not None)
    work = BlockWork(WeightsAt.of(stream.source, False), stream.dtype, frozenset(modules),
                     moments_dir is not None, torch.get_num_threads())
    executor = executor or LocalExecutor()
    per = max(1, SHARD_SEQS // stream.chunk)  # chunks per shard
    store = ActivationStore(activation_limit)
    hidden = stream.record()
    _STREAMS.clear()
    _STREAMS[(work.weights.key, work.dtype)] = stream  # jobs run here use this skeleton
    try:
        with StageProgress(enabled=progress) as bar:
            task = bar.add_task("calibration pass", total=len(stream.blocks))
            for i in range(len(stream.blocks)):
                store.put(i, hidden)
                shards = [BlockShard(i, hidden[k:k + per], stream.args[i][k:k + per])
                          for k in range(0, len(hidden), per)]
                hidden = []
                for out, part in executor.map(block_shard_job, shards, work,
                                              cpus=work.threads):
                    hidden.extend(out)
                    stats.add(part)
                    bar.note(task, f"block {i + 1}: {len(hidden)}/{len(stream.args[i])} "
                                   "chunks of windows")
                if moments_dir is not None:
                    _save_moments(stats, moments_dir / f"block_{i:03d}.safetensors")
                bar.advance(task)
        store.put(len(stream.blocks), hidden)
    except BaseException:
        store.close()
        raise
    finally:
        _STREAMS.clear()
    return CalibrationPass(stream, stats.result(), store)


def _save_moments(stats: InputStatistics, path: Path) -> None:
    """This block's X^T X, then dropped from memory (modules that read the same input, like
    q/k/v, get a tensor each: safetensors refuses shared storage)."""
    moments = stats.second_moments()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(moments, str(path), metadata={"format": "dynquant-second-moments"})
    stats.moments.clear()
