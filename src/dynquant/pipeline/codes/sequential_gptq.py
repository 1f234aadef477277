"""Sequential error-compensating quantization: GPTQ as its authors and GPTQModel run it.

The calibration sequences stream through the model one decoder block at a time (``BlockStream``),
each block's input being the output of the blocks *already quantized*. Inside a block the
Linear modules are taken in the order the forward reaches them, in groups that read the same
input (q/k/v, then o, then gate/up, then down): each group's input second moments X^T X are
gathered with every earlier group already holding its quantized weights, so the compensation of
a module also absorbs the error of everything before it.

Expert banks (3-D parameters, one matrix per expert) take part the same way, each expert with
the second moments of the tokens routed to it: a torch function mode sees every product whose
weight is a view of one expert of a watched bank (``F.linear(x, bank[e])`` in transformers'
experts modules, stored ``[E, out, in]``; ``x @ bank[e]`` in the reference hybrid model, stored
``[E, in, out]`` and compensated along its rows, taken by decreasing input energy,
``gptq_quantize_rows``), whatever the model's
routing code looks like. An expert that saw fewer than ``MIN_EXPERT_TOKENS`` tokens rounds to
nearest. The block's remaining quantized tensors (convolutions, anything the forward does not
reach) round to nearest first, with the calibration importance. After the last block, the
output head (a tied embedding included) is compensated on the final hidden states.

Each finished module goes straight into the quantization's resume store, which the writer then
reads; a killed run resumes at the first unfinished group (finished blocks run once more, from
their stored codes, to give the next block its input). Cost per block: one forward per group,
stopped at the group's last module, and one whole forward for the block's output.

Those forwards run by shards of the windows (``SHARD_SEQS`` for X^T X, ``OUTPUT_SHARD_SEQS``
for outputs), each a job on the executor: here on the driver's block, or on a worker that reads
the block and puts the codes the driver has written for it so far in place. The shards' X^T X
are folded in shard order and the outputs are each window's own, so the codes are the same bytes
on any executor.

With ``chain`` K (``--chain-blocks K``) the blocks are taken in chains of K, each starting from
the float model's hidden states at its first block: inside a chain each block's input is the
chain's quantized blocks' output, as above, and no chain waits for another. The pass runs only
the float model's forward, and each chain's whole work (every block's groups, its tuning, its
output for the next) is one job (``chain_job``) that the executor runs while the forward goes
on. K = 1 (``--independent-blocks``): every block from the float model's hidden states; a chain
as long as the model gives its blocks the codes of the sequential pass, bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import nn

from dynquant.checkpoint.resume import ResumeStore
from dynquant.format.planner import TensorSpec
from dynquant.numerics.gptq import (
    concat_rows,
    float_target_shift,
    gptq_quantize,
    gptq_quantize_rows,
    gptq_residual,
    gptq_residual_rows,
    ordered_factor,
)
from dynquant.numerics.gram import GramAccumulator
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.calibrate.bank_products import BankProducts
from dynquant.pipeline.calibrate.block_stream import BlockStream, InputMoments, InputSeen
from dynquant.pipeline.calibrate.calibration_pass import (
    SHARD_SEQS,
    BlockShard,
    BlockWork,
    block_as_driven,
    block_shard_job,
    put_codes,
    serving,
    shard_stream,
    shards_of,
)
from dynquant.pipeline.calibrate.statistics import InputStatistics
from dynquant.pipeline.calibrate.weights import WeightsAt
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.output_error import block_error
from dynquant.pipeline.codes.tuned_scales import (
    TUNING_DTYPES,
    ScaleTuning,
    TuneJob,
    check_windows,
    error_gains,
    first_lowering,
    tune_block,
    tune_block_job,
)
from dynquant.pipeline.execute.executor import Executor, InOrder, LocalExecutor, use_threads
from dynquant.pipeline.execute.progress import StageProgress, job_note, job_notes

Choice = Callable[[str], tuple[int, int]]  # module -> (bits, group size)
Rounder = Callable[[TensorSpec, torch.Tensor, int, int], QuantizedTensor]
MIN_EXPERT_TOKENS = 16  # fewer routed calibration tokens: the expert rounds to nearest
OUTPUT_SHARD_SEQS = 1  # windows a job of a block's outputs (X^T X jobs: SHARD_SEQS)


@dataclass(frozen=True)
class SequentialCalibration:
    """The token windows the sequential pass streams (the calibration text's, tokenized)."""

    ids: torch.Tensor  # [sequences, length]
    # each block's scales and offsets then tuned against the float block (``tuned_scales.py``)
    tuning: ScaleTuning | None = None
    # then every quantized tensor's scales tuned against the float model's outputs
    # (``end_to_end.py``; written after the pass, ``write.py``)
    end_to_end: EndToEndTuning | None = None
    # blocks a chain holds, each chain from the float model's hidden states at its first block
    # (``sequential_gptq``'s ``chain``); 0: the whole model one chain (the sequential pass)
    chain: int = 0
    # the pass's compute dtype: its blocks' weights and forwards, so the second moments' inputs
    # and the tuning's steps ("float32" or "bfloat16": at 7B shapes on a CPU with native bf16
    # products about half the time, BENCHMARKS.md "Scale"; the codes then follow that arithmetic)
    dtype: str = "float32"
    # GPTAQ (GPTQModel's ``v2``): each Linear's codes fitted to its float model's outputs, not
    # to its own on the quantized model's inputs, by this fraction (0: plain GPTQ; 1: the
    # whole way; ``float_target_shift``)
    float_targets: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in TUNING_DTYPES:
            raise ValueError(f"dtype: one of {', '.join(TUNING_DTYPES)}, not {self.dtype!r}")
        if self.tuning is not None:
            self.tuning.resolved(self.dtype)  # (a float32 tuning needs a float32 pass)
        if self.end_to_end is not None and self.end_to_end.steps is None:
            raise ValueError("end_to_end: its steps decided first (EndToEndTuning.resolved)")
        if self.chain < 0:
            raise ValueError(f"chain: blocks a chain holds (0: every block), not {self.chain}")
        if not 0 <= self.float_targets <= 1:
            raise ValueError(f"float_targets: a fraction in [0, 1], not {self.float_targets}")
        if self.float_targets and self.chain:
            raise ValueError("float_targets: the sequential pass's (no chains of blocks)")

    def digest(self) -> str:
        h = hashlib.sha256(self.ids.numpy().tobytes())
        if self.dtype != "float32":
            h.update(f"a {self.dtype} pass".encode())
        if self.chain == 1:
            h.update(b"independent blocks")
        elif self.chain:
            h.update(f"chains of {self.chain} blocks".encode())
        if self.tuning is not None:
            h.update(repr(self.tuning).encode())
        if self.float_targets:
            h.update(f"float targets {self.float_targets!r}".encode())
        if self.end_to_end is not None and self.end_to_end.steps > 0:
            h.update(repr(self.end_to_end).encode())
        return h.hexdigest()


@dataclass
class _Target:
    """A tensor the pass compensates: a Linear's weight, or an expert bank."""

    param: nn.Parameter
    owner: nn.Module | None  # the Linear (None for a bank)
    rows: bool = False  # a bank used as x @ bank[e] ([E, in, out]): compensated along rows

    @property
    def bank(self) -> bool:
        return self.owner is None


def sequential_gptq(stream: BlockStream, specs: list[TensorSpec], quantized: set[str],
                    choice: Choice, rounder: Rounder, store: ResumeStore,
                    progress: bool = False, executor: Executor | None = None,
                    tuning: ScaleTuning | None = None,
                    chain: int = 0, float_targets: float = 0.0) -> list[torch.Tensor] | None:
    """Quantize the ``quantized`` modules inside the decoder blocks, then the output head, into
    ``store`` (index = the tensor's position in ``specs``). Each group's matrices (a Linear,
    an expert of a bank) are compensated as jobs on ``executor`` (default: here), then the
    head. With ``tuning``, each block's scales are then tuned here, and its codes stored only
    once tuned (a killed run redoes that block).
    ``chain`` K > 0: the blocks in chains of K, each from the float model's hidden states at its
    first block (its scales tuned on the chain's too), each chain a job (``chain_job``)
    submitted as the float model's outputs reach its last block and collected later. Returns
    the float model's last block's outputs for every window where the pass ran the float model
    (``tuning`` or ``chain``; a resumed pass runs it too), else None: the end-to-end pass's
    teacher starts from them."""
    executor = executor or LocalExecutor()
    index = {s.module: i for i, s in enumerate(specs) if s.module in quantized}
    hidden = stream.record()
    # the float model's hidden states
    floats = list(hidden) if tuning is not None or chain or float_targets else []
    work = BlockWork(WeightsAt.of(stream.source, False), stream.dtype, frozenset(), False,
                     torch.get_num_threads())
    # tuning on the float model's inputs: the pass goes on with the GPTQ codes (kept apart, so
    # that a resumed pass runs on them), each block's tuning a job collected later
    beside = tuning is not None and tuning.inputs == "float" and not chain
    gptq_store = store.inner("gptq") if beside else store
    # blocks' jobs beside the pass (where their codes go: ``_placed``)
    pending: InOrder[list[tuple[int, str, object]], dict] = InOrder(executor, work.threads)
    links: list[ChainLink] = []  # the chain's blocks so far, and where their codes go
    chained: list[tuple[int, str, object]] = []
    start: list[torch.Tensor] = []  # the float model's hidden states at the chain's first block
    with StageProgress(enabled=progress) as bar, serving(stream, work):
        task = bar.add_task("gptq, block by block", total=len(stream.blocks))
        for b, block in enumerate(stream.blocks):
            state = _Block(stream, b, hidden, work, executor, float_targets=float_targets)
            mine = [s for s in specs if s.module in index and s.module.startswith(state.prefix)]
            stream.materialize(block, state.prefix[:-1])
            try:
                done = all(store.has(index[s.module]) for s in mine)
                tuned = tuning is not None and not done
                if tuned and tuning.rounding_size:
                    state.residuals = {}
                floats_in = floats
                if floats:  # before any codes are in place
                    float_block = replace(state, hidden=floats, replaced={})
                    say = _noter(bar, task, f"block {b + 1}: the float outputs")
                    if float_targets and not done:  # (and the float inputs of its Linears)
                        floats, state.float_inputs = _float_pass(float_block, mine, say)
                    else:
                        floats = _outputs(float_block, say)
                say = _noter(bar, task, f"block {b + 1}")
                if chain:
                    if not links:  # the chain's first block
                        start = floats_in
                    links.append(ChainLink(b, floats, stream.calls[b],
                                           {index[s.module]: s for s in mine},
                                           {s.module: choice(s.module) for s in mine}))
                    chained += [(i, m, (len(links) - 1, name))
                               for i, m, name in _placed(state, mine, index)]
                    if len(links) == chain or b == len(stream.blocks) - 1:
                        if not all(store.has(i) for i, _, _ in chained):
                            job = ChainJob(start, links, stream.chunk, tuning)
                            with job_notes(lambda what: bar.note(task, what)):
                                pending.add(chained, [executor.submit(
                                    chain_job, job, (work, rounder), cpus=work.threads)])
                        links, chained = [], []
                    hidden = floats
                else:
                    block_store = gptq_store if beside else _HeldCodes() if tuned else store
                    _compensate_block(state, specs, index, choice, rounder, block_store,
                                      lambda where, b=b: _noter(bar, task, f"block {b + 1}, {where}"))
                    if not tuned or beside:  # (tuned here: its outputs come with the tuning)
                        hidden = _outputs(state, _noter(bar, task, f"block {b + 1}: its output"))
                if tuned and beside:
                    job = TuneJob(b, floats_in, floats, stream.calls[b], dict(state.replaced),
                                  tuning, state.residuals or {})
                    with job_notes(_noter(bar, task, f"block {b + 1}: tuning (float inputs)")):
                        pending.add(_placed(state, mine, index), [executor.submit(
                            tune_block_job, job, work, cpus=work.threads)])
                elif tuned and not chain:
                    hidden = _tuned(state, mine, index, floats, tuning, store, say)
            finally:
                stream.release(block)
            if pending.waiting:
                bar.note(task, f"{len(pending.waiting)} blocks' jobs not back")
            for placed, (codes,) in pending.ready(end=b == len(stream.blocks) - 1):
                for i, module, name in placed:
                    store.save_quantized(i, module, codes[name])
            bar.advance(task)
        _head(stream, hidden, index, choice, store, bar)
    return floats or None


def _placed(state: _Block, mine: list[TensorSpec], index: dict) -> list[tuple[int, str, str]]:
    """Where a block's tensors go: store index, module, parameter path inside the block."""
    return [(index[s.module], s.module, state.relative(s)) for s in mine]


def _compensate_block(state: _Block, specs: list[TensorSpec] | dict[int, TensorSpec],
                      index: dict, choice: Choice, rounder: Rounder, store: ResumeStore,
                      say_at: Callable[[str], Callable[[str], None]]) -> None:
    """Every quantized tensor of the block (``index``'s modules in it) given codes, kept in
    ``store`` and put in place: those the forward does not reach to nearest first (their
    errors feed the groups), then the groups in the forward's order. ``say_at(where)``: what
    a group's steps say."""
    block = state.stream.blocks[state.index]
    mine = [specs[i] for m, i in index.items() if m.startswith(state.prefix)]
    targets = _targets(block, state.prefix, mine)
    groups = _groups(state.stream, state.index, state.hidden[0], targets)
    reached = {m for g in groups for m in g}
    for s in mine:
        if s.module not in reached:
            param = block.get_parameter(state.relative(s))
            qt = store.quantized(index[s.module]) or rounder(s, param.data, *choice(s.module))
            _keep(store, index[s.module], s, qt, param, state)
    for g, group in enumerate(groups):
        where = f"group {g + 1}/{len(groups)} ({group[0].removeprefix(state.prefix)})"
        _quantize_group(state, group, targets, specs, index, choice, store, say_at(where))


@dataclass
class ChainLink:
    """A block of a chain: the float block's outputs on the float model's hidden states (the
    tuning's targets), its windows' recorded arguments, its tensors (store index -> spec) and
    their widths (module -> (bits, group size))."""

    block: int
    targets: list[torch.Tensor]
    recorded: list[tuple]
    specs: dict[int, TensorSpec]
    widths: dict[str, tuple[int, int]]


@dataclass
class ChainJob:
    """A chain of blocks quantized one after the other (``chain``) from the float model's hidden
    states at its first block: those states, its blocks, how many sequences a chunk of them
    holds (the driver's stream's: shards group whole chunks) and the tuning."""

    hidden: list[torch.Tensor]
    links: list[ChainLink]
    chunk: int
    tuning: ScaleTuning | None

    @property
    def block(self) -> int:
        """The chain's first block."""
        return self.links[0].block


def chain_job(job: ChainJob, shared: tuple[BlockWork, Rounder]
              ) -> dict[tuple[int, str], QuantizedTensor]:
    """The chain's codes ((its block's place in the chain, parameter path inside the block) ->
    codes): each block compensated group by group as the sequential pass does, its jobs run in
    this process, then its scales tuned where ``job.tuning``, and its outputs with those codes
    the next block's input; on any executor the same bits (the driver's thread count)."""
    work, rounder = shared
    use_threads(work.threads)
    stream = shard_stream(work)
    say = job_note()
    hidden, chained = job.hidden, {}
    for k, link in enumerate(job.links):
        with (_as_recorded(stream, link.block, link.recorded, job.chunk),
              block_as_driven(stream, link.block, {}) as block):
            codes = _block_codes(stream, link, hidden, job.tuning, work, rounder, say)
            if k + 1 < len(job.links):  # in place for the next block's input
                for name, qt in codes.items():
                    put_codes(block.get_parameter(name), qt)
                hidden = stream.run_block(link.block, hidden, link.recorded)
        chained |= {(k, name): qt for name, qt in codes.items()}
    return chained


def _block_codes(stream: BlockStream, link: ChainLink, hidden: list[torch.Tensor],
                 tuning: ScaleTuning | None, work: BlockWork, rounder: Rounder,
                 say: Callable[[str], None]) -> dict[str, QuantizedTensor]:
    """A chain's block's codes (parameter path inside the block -> codes) on ``hidden``."""
    rounds = tuning is not None and tuning.rounding_size > 0
    state = _Block(stream, link.block, hidden, work, LocalExecutor(),
                   residuals={} if rounds else None)
    index = {s.module: i for i, s in link.specs.items()}
    where = f"block {link.block + 1}"
    _compensate_block(state, link.specs, index, link.widths.__getitem__, rounder, _HeldCodes(),
                      lambda group: (lambda what: say(f"{where}, {group}: {what}")))
    codes = dict(state.replaced)
    if tuning is None:
        return codes
    with job_notes(lambda what: say(f"{where}: {what}")):
        return tune_block_job(TuneJob(link.block, hidden, link.targets, link.recorded, codes,
                                      tuning, state.residuals or {}), work)


@contextlib.contextmanager
def _as_recorded(stream: BlockStream, index: int, recorded: list[tuple], chunk: int
                 ) -> Iterator[None]:
    """A worker's skeleton (which recorded nothing) as the driver's stream while a job runs:
    block ``index``'s recorded arguments, and the driver's chunk (a shard of the windows is
    whole chunks: another chunk would fold other shards, other bits). The driver's own stream
    is left as it is."""
    if getattr(stream, "calls", None):
        yield
        return
    stream.calls = [[] for _ in stream.blocks]
    stream.calls[index] = recorded
    stream.chunk, kept = chunk, stream.chunk
    try:
        yield
    finally:
        del stream.calls
        stream.chunk = kept


class _HeldCodes:
    """Where a block's codes go until they are tuned, in the resume store's place (its ``load``,
    ``quantized``, ``save_quantized`` and ``write_tensors``): nothing is loaded or kept, the codes
    live in the block's ``replaced`` (their residuals in its ``residuals``), and the resume store
    sees only tuned codes."""

    def load(self, _index: int) -> None:
        return None

    def quantized(self, _index: int) -> None:
        return None

    def save_quantized(self, _index: int, _module: str, _qt: QuantizedTensor) -> None:
        pass

    def write_tensors(self, _name: str, _tensors: dict[str, torch.Tensor]) -> None:
        pass


def _tuned(state: _Block, mine: list[TensorSpec], index: dict, targets: list[torch.Tensor],
           tuning: ScaleTuning, store: ResumeStore, say: Callable[[str], None]
           ) -> list[torch.Tensor]:
    """The block's codes (in ``state.replaced``) tuned (``first_lowering``: the first whose
    block error on the check windows is below GPTQ's codes', else GPTQ's), stored, put in
    place; returns the block's outputs with them. GPTQ's codes run on the check windows only,
    and on every window only where no tuning is kept."""
    codes = dict(state.replaced)
    block = state.stream.blocks[state.index]
    check = check_windows(len(state.hidden))
    checked = [targets[k] for k in check]
    gains = error_gains(state.stream, state.index, tuning)
    before = block_error(_outputs(state, lambda what: say(f"GPTQ's output: {what}"), check),
                         checked, gains)

    def run(tried: dict[str, QuantizedTensor]) -> list[torch.Tensor]:
        for name, qt in tried.items():
            put_codes(block.get_parameter(name), qt)
        state.replaced.update(tried)
        return _outputs(state, lambda what: say(f"tuned output: {what}"))

    kept = first_lowering(tuning, before,
                          lambda attempt: tune_block(state.stream, state.index, codes,
                                                     state.hidden, targets, attempt, say,
                                                     residuals=state.residuals, gains=gains),
                          run, lambda outputs: block_error([outputs[k] for k in check], checked,
                                                           gains))
    if kept is not None:  # in place already
        outputs = kept[1]
    else:  # the GPTQ codes back in place
        for name, qt in codes.items():
            put_codes(block.get_parameter(name), qt)
        state.replaced.update(codes)
        outputs = _outputs(state, lambda what: say(f"GPTQ's output: {what}"))
    for s in mine:
        store.save_quantized(index[s.module], s.module, state.replaced[state.relative(s)])
    return outputs


@dataclass
class _Block:
    """A block in the pass: its windows' inputs, where its jobs run, and its tensors quantized
    so far (which every job's copy of the block holds too)."""

    stream: BlockStream
    index: int
    hidden: list[torch.Tensor]
    work: BlockWork
    executor: Executor
    replaced: dict[str, QuantizedTensor] = field(default_factory=dict)
    # GPTQ's rounding residuals of the codes in ``replaced`` (None: not kept; the tuning's
    # rounding needs them)
    residuals: dict[str, torch.Tensor] | None = None
    # GPTAQ's fraction (``SequentialCalibration.float_targets``), and each dense Linear's input
    # (module -> a tensor a window) in the float model, where it is > 0
    float_targets: float = 0.0
    float_inputs: dict[str, list[torch.Tensor]] | None = None

    @cached_property
    def prefix(self) -> str:  # a search of the model's modules: once per block
        return self.stream.block_prefix(self.index) + "."

    def relative(self, spec: TensorSpec) -> str:
        return spec.name[len(self.prefix):]

    def shards(self, sequences: int = SHARD_SEQS) -> list[BlockShard]:
        """The block's windows in shards of ``sequences``, each a job (on any executor the
        same shards, folded in the same order: the same bits)."""
        return shards_of(self.stream, self.index, self.hidden, self.replaced, sequences)

    def map(self, fn, jobs: list) -> Iterator:
        return self.executor.map(fn, jobs, self.work, cpus=self.work.threads)


def _outputs(state: _Block, say: Callable[[str], None], windows: list[int] | None = None,
             inputs: dict[str, list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """The block's outputs for every window (its quantized weights in place), or for the
    ``windows`` given (chunk indices), a window a job: each window's outputs are its own
    (nothing is folded), so they are the same bits however the windows are split, and a cluster
    spreads the block the widest. ``inputs`` (module -> []): each module's input on each
    window appended too."""
    out: list[torch.Tensor] = []
    shards = state.shards(OUTPUT_SHARD_SEQS)
    if windows is not None:  # (a shard a chunk: OUTPUT_SHARD_SEQS is one sequence)
        shards = [shards[k] for k in windows]
    say(f"0/{len(shards)} shards of the windows")
    parts = (state.map(block_shard_job, shards) if inputs is None else
             state.map(float_pass_job, [FloatPass(s, list(inputs)) for s in shards]))
    for k, (part, seen) in enumerate(parts):
        out.extend(part)
        for m in inputs or {}:
            inputs[m].extend(seen[m])
        say(f"{k + 1}/{len(shards)} shards of the windows")
    return out


@dataclass
class FloatPass:
    """One job: a shard of the windows through the block, the inputs of its ``modules`` (the
    model's module names) kept."""

    shard: BlockShard
    modules: list[str]


def float_pass_job(job: FloatPass, work: BlockWork
                   ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The shard's outputs of the block and each of ``modules``' inputs, a tensor a window (the
    same tensor for Linears that read one input)."""
    use_threads(work.threads)
    stream = shard_stream(work)
    seen: dict[str, list[torch.Tensor]] = {m: [] for m in job.modules}
    hooks = [stream.model.get_submodule(m).register_forward_pre_hook(
        lambda _m, inputs, m=m: seen[m].append(inputs[0].detach())) for m in job.modules]
    try:
        with block_as_driven(stream, job.shard.block, job.shard.replaced):
            out = stream.run_block(job.shard.block, job.shard.hidden, job.shard.recorded)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def _float_pass(state: _Block, mine: list[TensorSpec], say: Callable[[str], None]
                ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """``_outputs`` of the float block (``state``: its float hidden states, no codes), and the
    inputs of its quantized Linears on every window (GPTAQ's targets: ``float_target_shift``)."""
    block = state.stream.blocks[state.index]
    inputs: dict[str, list[torch.Tensor]] = {
        s.module: [] for s in mine if _dense_linear(block, s.module[len(state.prefix):])}
    return _outputs(state, say, inputs=inputs), inputs


def _dense_linear(block: nn.Module, path: str) -> bool:
    """Whether ``path`` in ``block`` is a Linear (not a bank: an expert bank's tensor is a
    parameter of its module, which keeps GPTQ's own objective)."""
    try:
        return isinstance(block.get_submodule(path), nn.Linear)
    except AttributeError:
        return False


def _noter(bar: StageProgress, task: int, where: str) -> Callable[[str], None]:
    """What a group's steps say on the stage's line: where they are, and what they do."""
    return lambda what: bar.note(task, f"{where}: {what}")


def _head(stream: BlockStream, final: list[torch.Tensor], index: dict, choice: Choice,
          store: ResumeStore, bar: StageProgress | None = None) -> None:
    """The output head, when quantized (a tied embedding is: its codes serve both uses),
    compensated on the quantized blocks' final hidden states after the model's final norm.
    Progress on ``bar``: a step per calibration window, one for the codes."""
    head = stream.model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return
    name = stream.module_name(head)
    module = stream.source.tied.get(name, name)
    if module not in index or store.load(index[module]) is not None:
        return
    moments = GramAccumulator(head.in_features)
    bar = bar or StageProgress(enabled=False)
    task = bar.add_task("gptq: head", total=len(final) + 1)

    def seen(x: torch.Tensor) -> None:
        moments.add(x)
        bar.advance(task)

    with stream.heads_held():
        stream.head_inputs(head, [h.to(stream.dtype) for h in final], list(stream.chunks()),
                           seen)
        qt = gptq_quantize(head.weight.data.float(), moments.mean(), *choice(module))
    bar.advance(task)
    store.save_quantized(index[module], module, qt)


def _targets(block: nn.Module, prefix: str, mine: list[TensorSpec]) -> dict[str, _Target]:
    """The block's plain Linears (weight [out, in] as stored) and expert banks (3-D)."""
    out = {}
    for s in mine:
        rel = s.name[len(prefix):]
        param = block.get_parameter(rel)
        if param.ndim == 3 and tuple(param.shape) == tuple(s.shape):
            out[s.module] = _Target(param, None)
            continue
        owner = block.get_submodule(rel.rpartition(".")[0]) if "." in rel else block
        if (isinstance(owner, nn.Linear) and rel.endswith(".weight")
                and tuple(param.shape) == tuple(s.shape)):
            out[s.module] = _Target(param, owner)
    return out


@dataclass
class CompensateJob:
    """One matrix to compensate: a Linear's weight, or one expert of a bank, with its second
    moments and their inverse factor (computed by the driver, once per shared input)."""

    weight: torch.Tensor  # float32, [out, in] (or [in, out] with ``rows``)
    hessian: torch.Tensor
    factor: torch.Tensor
    bits: int
    group_size: int
    rows: bool = False
    residual: bool = False  # also the rounding residual (``gptq_residual``)


def compensate_job(job: CompensateJob, _shared: None = None
                   ) -> tuple[QuantizedTensor, torch.Tensor | None]:
    """The pure per-matrix work (run by an executor, here or on a worker): the codes and, where
    asked, their rounding residual. Given the factor, its products round the same on any number
    of threads (the factor's Cholesky does not: the driver computes it)."""
    args = (job.weight, job.hessian, job.bits, job.group_size)
    if job.residual:
        return (gptq_residual_rows if job.rows else gptq_residual)(*args, factor=job.factor)
    return (gptq_quantize_rows if job.rows else gptq_quantize)(*args, factor=job.factor), None


def _quantize_group(state: _Block, group: list[str], targets: dict[str, _Target],
                    specs: list[TensorSpec], index: dict, choice: Choice, store: ResumeStore,
                    say: Callable[[str], None]) -> None:
    done = {m: store.quantized(index[m]) for m in group}
    todo = [m for m in group if done[m] is None]
    moments, shifts = _group_moments(state, group, targets, todo, say) if todo else (None, {})
    say(f"compensating {len(todo)} {'matrix' if len(todo) == 1 else 'matrices'}")
    # the group shares its input, so its moments and their factor (one per expert for banks);
    # its matrices are compensated independently
    factors = _Factors()
    kept = state.residuals  # the residuals too, where the tuning rounds
    weights = float_target_shift(
        {m: targets[m].param.data.float() for m in shifts}, moments, factors.of(moments),
        shifts, state.float_targets) if shifts else {}
    jobs = {m: _jobs(targets[m], moments, *choice(m), factors, kept is not None, weights.get(m))
            for m in todo}
    results = state.executor.map(compensate_job, [j for m in todo for j in jobs[m]], None)
    for m in group:  # each kept (in the store) as soon as its matrices are back
        t, name, i = targets[m], state.relative(specs[index[m]]), index[m]
        if done[m] is None:
            parts, residuals = zip(*[next(results) for _ in jobs[m]], strict=True)
            done[m] = parts[0] if not t.bank else concat_rows(list(parts),
                                                               tuple(t.param.shape))
            if kept is not None:  # stored before its codes: a resumed pass finds both
                kept[name] = torch.cat(residuals)
                store.write_tensors(_residual_file(i), {"r": kept[name]})
        elif kept is not None:
            kept[name] = store.read_tensors(_residual_file(i))["r"]
        _keep(store, i, specs[i], done[m], t.param, state)
    for m in group if state.float_inputs is not None else []:  # (the group's last use)
        state.float_inputs.pop(m, None)


def _residual_file(i: int) -> str:
    return f"{i:06d}.residual"  # not a *.safetensors: the store counts those as its tensors


class _Factors:
    """Inverse factors of a group's second moments, each computed once (q/k/v share one; both
    GPTQ forms take the same one, ``ordered_factor``)."""

    def __init__(self) -> None:
        # by the moments' identity (the group's modules hold the same tensor); each kept
        # beside its factor so that no id is reused by a later tensor
        self.known: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, hessian: torch.Tensor) -> torch.Tensor:
        if id(hessian) not in self.known:
            self.known[id(hessian)] = (hessian, ordered_factor(hessian))
        return self.known[id(hessian)][1]


def _jobs(t: _Target, moments, bits: int, group_size: int, factors: _Factors, residual: bool,
          weight: torch.Tensor | None = None) -> list[CompensateJob]:
    """A Linear's one job (its ``weight`` as GPTQ sees it where given, else its own), or a
    bank's one per expert (with that expert's moments; an expert with too few routed tokens
    rounds to nearest: identity moments)."""
    w = t.param.data.float() if weight is None else weight
    if not t.bank:
        return [CompensateJob(w, moments, factors.of(moments), bits, group_size,
                              residual=residual)]
    jobs = []
    for e, h in enumerate(moments):
        if h is None:
            h = torch.eye(w.shape[1] if t.rows else w.shape[2])
        jobs.append(CompensateJob(w[e].contiguous(), h, factors.of(h), bits,
                                  group_size, t.rows, residual))
    return jobs


def _keep(store: ResumeStore, i: int, spec: TensorSpec, qt: QuantizedTensor,
          param: nn.Parameter, state: _Block) -> None:
    """Store the codes (unless they came from the store) and run the block with them (here,
    and in every later job's copy of the block)."""
    if store.load(i) is None:
        store.save_quantized(i, spec.module, qt)
    put_codes(param, qt)
    state.replaced[state.relative(spec)] = qt


def _groups(stream: BlockStream, b: int, first: torch.Tensor, targets: dict[str, _Target]
            ) -> list[list[str]]:
    """The targets in the order the block's forward reaches them, grouped by shared input
    (those it never reaches are left out: they round to nearest). A bank's position is its
    first expert's product; banks learn here whether they are used as x @ W[e]."""
    seen: list[tuple[str, tuple]] = []
    alive: list[torch.Tensor] = []  # no input freed and its memory reused by a later one

    def record(name: str, x: torch.Tensor) -> None:
        alive.append(x)
        seen.append((name, (x.data_ptr(), tuple(x.shape), tuple(x.stride()))))

    def bank_seen(name: str, _expert: int, x: torch.Tensor, rows: bool) -> None:
        if all(n != name for n, _ in seen):
            targets[name].rows = rows
            record(name, x)

    hooks = [t.owner.register_forward_pre_hook(lambda _m, inputs, n=n: record(n, inputs[0]))
             for n, t in targets.items() if t.owner is not None]
    banks = {n: t.param for n, t in targets.items() if t.bank}
    args, kwargs = stream.calls[b][0]
    try:
        with torch.no_grad(), BankProducts(banks, bank_seen):
            stream.blocks[b](first.to(stream.dtype), *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    groups: dict[tuple, list[str]] = {}
    for name, key in seen:
        if all(name not in g for g in groups.values()):
            groups.setdefault(key, []).append(name)
    return list(groups.values())
@dataclass
class GroupInput:
    """One job: a shard of the windows run through the block as far as the input of a group
    (``lead``, its first module; a bank's input is each expert's routed tokens)."""

    shard: BlockShard
    lead: str
    bank: bool
    # GPTAQ: the group's input in the float model (a tensor a window of the shard), and the
    # group's modules still to compensate, or (``members`` empty) the group's sum of
    # (X_float - X)^T X, which each module's weight then multiplies (``_sums_once``)
    floats: list[torch.Tensor] | None = None
    members: list[str] = field(default_factory=list)


def group_input_job(job: GroupInput, work: BlockWork
                    ) -> tuple[InputMoments, dict[str, torch.Tensor]] | dict[str, dict]:
    """The shard's X^T X of the group's input, and with ``floats`` each member's sum of
    ((X_float - X) W^T)^T X (``float_target_shift``'s; float32 [out, in]), or the group's sum
    of (X_float - X)^T X (under the key ""), with the block as the driver has it; a bank's raw
    per-expert sums (``InputStatistics.partial``)."""
    use_threads(work.threads)
    stream = shard_stream(work)
    with block_as_driven(stream, job.shard.block, job.shard.replaced):
        if job.bank:
            stats = InputStatistics(stream.model, {job.lead}, second_moments=True)
            try:
                _run(stream, job.shard)
            finally:
                stats.remove()
            return stats.partial()
        linear = stream.model.get_submodule(job.lead)
        moments = InputMoments(linear.in_features)
        shifts: dict[str, torch.Tensor] = {}
        handles = []
        if job.floats is not None:  # (before the moments' hook, which stops the forward)
            weights = {m: stream.model.get_submodule(m).weight.float() for m in job.members}
            shifts = {m: torch.zeros(w.shape) for m, w in weights.items()} or {
                "": torch.zeros(linear.in_features, linear.in_features)}
            floats = iter(job.floats)

            def shift(_module: nn.Module, inputs: tuple) -> None:
                x = inputs[0].reshape(-1, linear.in_features).float()
                gap = next(floats).reshape(x.shape).float() - x
                if not weights:
                    shifts[""].addmm_(gap.T, x)
                for m, w in weights.items():
                    shifts[m].addmm_((gap @ w.T).T, x)

            handles.append(linear.register_forward_pre_hook(shift))
        handles.append(linear.register_forward_pre_hook(moments.hook))
        try:
            _run(stream, job.shard)
        finally:
            for h in handles:
                h.remove()
        return moments, shifts


def _group_moments(state: _Block, group: list[str], targets: dict[str, _Target],
                   todo: list[str], say: Callable[[str], None]):
    """The second moments X^T X / tokens of the input the modules of ``group`` share, over
    every calibration window, a shard of windows a job, folded in shard order: one matrix for
    Linears (the block run only as far as that input), per expert for banks (None where an
    expert saw too few tokens); and GPTAQ's sums / tokens for the Linears in ``todo`` where
    the pass fits them to the float model's outputs (else none)."""
    lead = targets[group[0]]
    shards = state.shards()
    say(f"inputs' moments, 0/{len(shards)} shards of the windows")
    # (GPTQ's own objective where the float inputs are none: a bank, a Linear of another kind)
    floats = None if lead.bank or state.float_inputs is None else state.float_inputs.get(
        group[0])
    members = [] if floats is None or _sums_once(targets, todo, floats) else todo
    taken = iter(floats or [])
    jobs = [GroupInput(s, group[0], lead.bank) if floats is None else GroupInput(
        s, group[0], False, [next(taken) for _ in s.hidden], members) for s in shards]
    parts = state.map(group_input_job, jobs)
    if lead.bank:
        return _expert_moments(state.stream, group[0], lead, parts), {}
    total: GramAccumulator | None = None
    shifts: dict[str, torch.Tensor] = {}
    for k, (part, shift) in enumerate(parts):
        if total is None:
            # 0 + x is x: one shard's sum is the one-process sum, bit for bit
            total, shifts = part, shift
        else:
            total.add_sum(part)
            for m, r in shift.items():
                shifts[m].add_(r)
        say(f"inputs' moments, {k + 1}/{len(shards)} shards of the windows")
    assert total is not None
    rows = max(total.rows, 1)
    if "" in shifts:  # each module's weight times the group's (X_float - X)^T X
        shifts = {m: targets[m].param.data.float() @ shifts[""] for m in todo}
    return total.mean(consume=True), {m: r.div_(rows) for m, r in shifts.items()}


def _sums_once(targets: dict[str, _Target], todo: list[str], floats: list[torch.Tensor]
               ) -> bool:
    """Whether GPTAQ's sums cost fewer multiply-adds as the group's (X_float - X)^T X times each
    weight (tokens x in^2 + outs x in^2: at 7B shapes q/k/v, o, gate/up) than as each
    module's ((X_float - X) W^T)^T X (2 x tokens x in x outs: the down projection)."""
    tokens = sum(x.numel() // x.shape[-1] for x in floats)
    width = floats[0].shape[-1]
    outs = sum(targets[m].param.shape[0] for m in todo)
    return width * (tokens + outs) < 2 * tokens * outs


def _expert_moments(stream: BlockStream, name: str, bank: _Target, parts: Iterator[dict]
                    ) -> list[torch.Tensor | None]:
    """Each expert's X^T X / tokens over the tokens routed to it, as the calibration statistics
    gather it (``InputStatistics``, the shards' sums folded in order); None where an expert saw
    too few."""
    stats = InputStatistics(stream.model, set(), second_moments=True)  # folds, watches nothing
    for part in parts:
        stats.add(part)
    tokens = stats.routed.get(f"{name}.routed_tokens")
    if tokens is None:  # no token reached the bank
        return [None] * bank.param.shape[0]
    moments = stats.second_moments()[name]
    # each its own tensor: a view would carry the whole bank's moments to a worker
    return [moments[e].clone() if n >= MIN_EXPERT_TOKENS else None
            for e, n in enumerate(tokens.tolist())]


def _run(stream: BlockStream, shard: BlockShard) -> None:
    """The block over the shard's chunks, each stopped where a hook raises ``InputSeen``."""
    block = stream.blocks[shard.block]
    with torch.no_grad():
        for h, (args, kwargs) in zip(shard.hidden, shard.recorded, strict=True):
            with contextlib.suppress(InputSeen):
                block(h.to(stream.dtype), *args, **kwargs)
