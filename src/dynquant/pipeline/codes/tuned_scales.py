"""A decoder block's codes tuned against the float block (``--quantizer tuned``): GPTQ's
codes, then their rounding (from the residual GPTQ rounded away), scales and offsets moved to
lower the block's output error.

Within the sequential pass (``sequential_gptq.py``), once a block's tensors have their GPTQ
codes: every calibration window's output of the *float* block on the *float* model's hidden
states is the target, and the block with its codes, run on the quantized model's hidden states
(what it will see), is fitted to it, each output channel's error weighted by the gain of the
norm that reads it (``output_error.py``). So each block also absorbs what the blocks before it
got wrong (AutoRound's and EfficientQAT's block-wise reconstruction). Adam, one window a step
in a seeded order, the step size falling linearly to zero; every quantized tensor of the block at
once (a bank's every expert: each sees the tokens routed to it). A tuning is kept only where it
lowers the block's error (``first_lowering``: with the rounding, then the scales alone; at 8 bits
a bf16 scale's step can be larger than the error it tunes), measured on ``check_windows``: an
even sample of them, so that the GPTQ codes' outputs, which only that comparison needs, cost a
sixth of a forward over every window (at 7B shapes one is ~28 s a block).

With ``ScaleTuning(inputs="float")`` the block is fitted on the *float* model's hidden states
instead: no block's tuning then needs another's, the GPTQ pass goes on with the untuned codes,
and each block's tuning is a job (``tune_block_job``) that a worker runs while the pass goes on
(BENCHMARKS.md "Tuned scales" measures what that costs in KL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.func import functional_call

from dynquant.errors import DynquantError
from dynquant.freed_memory import reusing_freed_memory
from dynquant.numerics.compute_dtype import size_dtype
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.numerics.tuned_scales import TunableScales
from dynquant.pipeline.calibrate.block_stream import BlockStream, first_output
from dynquant.pipeline.calibrate.calibration_pass import (
    BlockWork,
    block_as_driven,
    put_codes,
    shard_stream,
)
from dynquant.pipeline.codes.output_error import (
    NormGains,
    block_error,
    output_error,
    reading_norm,
)
from dynquant.pipeline.execute.executor import use_threads
from dynquant.pipeline.execute.progress import job_note

TUNING_INPUTS = ("quantized", "float")
TUNING_DTYPES = ("float32", "bfloat16")
TUNING_ERRORS = ("gains", "plain")


# The rounding's step by default (``default_rounding``): 6e-3 for a model of at most
# ``SMALL_MODEL_WEIGHTS`` quantized weights, where it lowers SmolLM2-135M's KL by 2-4% against
# 3e-3 beyond the spread of three tuning seeds each, and leaves Gemma-3-270M's (BENCHMARKS.md
# "Tuned scales"); 3e-3 past it: at 6e-3 the 7B-shaped random block's rounding ended above its
# GPTQ codes' error, so its scales were tuned again alone (twice the tuning), and the rounding's
# state holds ~0.9 GiB more there (60% of the weights can flip against 30%).
ROUNDING = 3e-3
SMALL_MODEL_ROUNDING = 6e-3
# Quantized weights up to which a model takes the defaults that spend time for quality: this
# rounding step and the measure's group sizes (``measure/options.py``, ``default_group_sizes``)
SMALL_MODEL_WEIGHTS = 2_000_000_000


@dataclass(frozen=True)
class ScaleTuning:
    """How a block's scales are tuned (part of the codes' identity: the resume digest)."""

    steps: int = 100  # one calibration window each
    # Adam's step on the scale and offset factors (relative to the scale) of 3-bit codes;
    # ``lr * 7 / max_code`` at other widths, so that the top code moves about as far in
    # quantization steps at every width
    lr: float = 3e-3
    seed: int = 0
    # the hidden states the block is fitted on: "quantized" (the model being quantized: each
    # block corrects its predecessors, and waits for them) or "float" (the float model's:
    # every block's tuning independent, a job beside the GPTQ pass)
    inputs: str = "quantized"
    # Adam's step on each weight's rounding (in codes, at every width), where GPTQ's rounding
    # residual is known; 0: GPTQ's codes kept, only the scales tuned; None: the default for the
    # model's size (``resolved``: ``default_rounding``), unresolved as for a small model
    rounding: float | None = None
    # the steps' products: "float32", or "bfloat16" (the dequantized weights rounded to bf16 and
    # the block under bf16 autocast: faster where the CPU multiplies bf16 natively, e.g. AMX;
    # the codes then depend on that arithmetic); None: the codes' pass's dtype (``resolved``;
    # unresolved: float32). On a bfloat16 pass the steps are bfloat16 (the block's weights
    # are). The check of a tuning against GPTQ's codes runs in the pass's dtype either way.
    dtype: str | None = None
    # the block's output error fitted and compared: "gains" (each channel times the gain of the
    # norm that reads the block's output: ``output_error.py``) or "plain"
    error: str = "gains"

    def __post_init__(self) -> None:
        if self.error not in TUNING_ERRORS:
            raise DynquantError(f"the tuning's error must be one of {', '.join(TUNING_ERRORS)}, "
                                f"not {self.error!r}", field="tuning.error")
        if self.dtype is not None and self.dtype not in TUNING_DTYPES:
            raise DynquantError(f"the tuning's dtype must be one of {', '.join(TUNING_DTYPES)}, "
                                f"not {self.dtype!r}", field="tuning.dtype")
        if self.inputs not in TUNING_INPUTS:
            raise DynquantError(f"tuning inputs must be one of {', '.join(TUNING_INPUTS)}, "
                                f"not {self.inputs!r}", field="tuning.inputs")
        if self.rounding is not None and not 0 <= self.rounding <= 0.5:
            raise DynquantError(f"the rounding step must be in [0, 0.5] codes, not "
                                f"{self.rounding}", field="tuning.rounding")

    def resolved(self, pass_dtype: str, quantized_weights: int | None = None) -> ScaleTuning:
        """These settings with ``dtype`` decided: as given, else the codes' pass's
        (``SequentialCalibration.dtype``); and, given the model's ``quantized_weights``,
        ``rounding``: as given, else ``default_rounding``'s."""
        if pass_dtype == "bfloat16" and self.dtype == "float32":
            raise DynquantError("float32 tuning steps need a float32 codes' pass (the block's "
                                "weights are bf16 on a bfloat16 one): --codes-dtype float32",
                                field="tuning.dtype")
        out = self if self.dtype is not None else replace(self, dtype=pass_dtype)
        if out.rounding is None and quantized_weights is not None:
            out = replace(out, rounding=default_rounding(quantized_weights))
        return out

    @property
    def rounding_size(self) -> float:
        """The rounding's step (its first: it falls to zero): as given or resolved, else a
        small model's default."""
        return SMALL_MODEL_ROUNDING if self.rounding is None else self.rounding

    @property
    def rounding_reach(self) -> float:
        """How far (in codes) the rounding's offsets can move over the tuning: the sum of its
        step sizes, each step being clipped to its size (``RoundingOffsets``)."""
        return sum(self.rounding_step(step) for step in range(self.steps))

    def rounding_step(self, step: int) -> float:
        """The rounding's step size at ``step`` (falling linearly to zero, as the scales')."""
        return self.rounding_size * (1 - step / self.steps)


def default_rounding(quantized_weights: int) -> float:
    """The rounding's step for a model of ``quantized_weights`` (``ROUNDING`` past
    ``SMALL_MODEL_WEIGHTS``, else ``SMALL_MODEL_ROUNDING``)."""
    return SMALL_MODEL_ROUNDING if quantized_weights <= SMALL_MODEL_WEIGHTS else ROUNDING


# GPTAQ's fraction the tuned codes start from by default (``default_float_targets``): at
# SmolLM2-135M's 3.25 and 4.25 bits and Gemma-3-270M's 4.25, three tuning seeds each, it lowers
# the tuned codes' mean KL by 1-4% against GPTQ's start (BENCHMARKS.md "Tuned scales") for ~5%
# more of the codes' time; past ``SMALL_MODEL_WEIGHTS`` it is opt-in: at 7B shapes the gptq
# stage takes 1.7x the time and its peak 1.5 GiB more (a block's float inputs held).
TUNED_FLOAT_TARGETS = 0.5


def default_float_targets(quantizer: str, quantized_weights: int, chain: int) -> float:
    """GPTAQ's fraction where none is asked: ``TUNED_FLOAT_TARGETS`` for tuned codes of a model
    of at most ``SMALL_MODEL_WEIGHTS`` quantized weights in one chain (chains start each from
    the float model's states), else 0 (gptq's codes are GPTQ's unless asked)."""
    small = quantized_weights <= SMALL_MODEL_WEIGHTS
    return TUNED_FLOAT_TARGETS if quantizer == "tuned" and small and not chain else 0.0


def default_pass_dtype(tuning: ScaleTuning | None, quantized_weights: int) -> str:
    """The codes' pass's dtype where none is asked: float32 under float32 tuning steps (which
    need the block's float32 weights), else ``size_dtype``'s for the model's size."""
    if tuning is not None and tuning.dtype == "float32":
        return "float32"
    return size_dtype(quantized_weights)


# windows a tuning's error is compared on (evenly spaced; every window where there are fewer):
# at 256 tokens and a 3,584-wide block, 7 M outputs
CHECK_WINDOWS = 8


def check_windows(count: int) -> list[int]:
    """Which of ``count`` windows ``first_lowering`` compares errors on."""
    return torch.linspace(0, count - 1, min(count, CHECK_WINDOWS)).round().long().unique().tolist()


def tune_block(stream: BlockStream, index: int, codes: dict[str, QuantizedTensor],
               hidden: list[torch.Tensor], targets: list[torch.Tensor], tuning: ScaleTuning,
               say: Callable[[str], None] = lambda _: None, calls: list[tuple] | None = None,
               residuals: dict[str, torch.Tensor] | None = None,
               gains: NormGains | None = None) -> dict[str, QuantizedTensor]:
    """Block ``index``'s ``codes`` (parameter path inside the block -> codes) with scales and
    offsets fitted so that the block on ``hidden`` gives ``targets`` (``calls``: the windows'
    recorded block arguments, the stream's by default), and the rounding of those whose
    ``residuals`` are given (with ``tuning.rounding``; taken out of the dict as they are
    used); the error's channels weighted by ``gains`` (``output_error``). The block runs on the
    tunables' weights (``functional_call``), so its own copies of them are emptied while it
    tunes (a float32 copy is 4 bytes a weight of the block): the caller puts codes in place
    before the block runs again (``first_lowering``'s ``run``)."""
    calls = stream.calls[index] if calls is None else calls
    block = stream.blocks[index]
    shapes = {}
    for name in codes:  # (one element, broadcast: the parameter's shape with no storage)
        param = block.get_parameter(name)
        shapes[name] = (param.shape, param.dtype)
        param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
    # each residual released once its rounding holds what it needs (a block's are 2 bytes a
    # weight; the scales-alone attempt after this one does not need them)
    residuals = residuals if residuals is not None and tuning.rounding_size else {}
    tunables = {name: TunableScales(qt, residuals.pop(name, None), tuning.rounding_reach)
                for name, qt in codes.items()}
    opt = torch.optim.Adam([{"params": t.scale_parameters(), "width": 7 / t.max_code}
                            for t in tunables.values()], lr=tuning.lr)
    gen = torch.Generator().manual_seed(tuning.seed * 1_000_003 + index)
    order = torch.randint(len(hidden), (tuning.steps,), generator=gen).tolist()
    low = tuning.dtype == "bfloat16"
    with reusing_freed_memory():  # each step frees and makes the same large tensors
        for step, k in enumerate(order):
            for group in opt.param_groups:
                group["lr"] = tuning.lr * group["width"] * (1 - step / tuning.steps)
            for t in tunables.values():  # in codes: the same step at every width
                t.next_rounding_step(tuning.rounding_step(step))
            # (dequantized into the block's dtype: no float32 copy of a tensor, nor of its
            # gradient, which reaches the tunable in that dtype and is made float a chunk at a
            # time; the same bits as rounding a float32 one)
            weights = {name: t(torch.bfloat16 if low else shapes[name][1]).reshape(shapes[name][0])
                       for name, t in tunables.items()}
            args, kwargs = calls[k]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                out = first_output(functional_call(block, weights, (hidden[k].to(stream.dtype),
                                                                     *args), kwargs))
            loss = output_error(gains, out.float(), targets[k])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 10 == 0:
                say(f"tuning scales, step {step}/{tuning.steps}")
    return {name: t.codes() for name, t in tunables.items()}


@dataclass
class TuneJob:
    """One block's tuning on the float model's hidden states (``inputs="float"``): the block's
    windows' float inputs and the float block's outputs on them, their recorded arguments, and
    the block's codes (GPTQ's) and their rounding residuals."""

    block: int
    hidden: list[torch.Tensor]
    targets: list[torch.Tensor]
    recorded: list[tuple]
    codes: dict[str, QuantizedTensor]
    tuning: ScaleTuning
    residuals: dict[str, torch.Tensor]  # GPTQ's rounding residuals (the rounding's start)


def tune_block_job(job: TuneJob, work: BlockWork) -> dict[str, QuantizedTensor]:
    """The block's codes tuned (``first_lowering``: the first that lowers its error over
    every window), else the codes as they came; on any executor the same bits (the driver's
    thread count). The block is left with the last tried codes in place: its caller releases
    it next."""
    use_threads(work.threads)
    stream = shard_stream(work)
    say = job_note()
    check = check_windows(len(job.hidden))  # the block's outputs serve only the comparison
    gains = error_gains(stream, job.block, job.tuning)
    hidden, recorded = [job.hidden[k] for k in check], [job.recorded[k] for k in check]
    targets = [job.targets[k] for k in check]
    with block_as_driven(stream, job.block, job.codes) as block:
        def run(codes: dict[str, QuantizedTensor]) -> list[torch.Tensor]:
            for name, qt in codes.items():
                put_codes(block.get_parameter(name), qt)
            return stream.run_block(job.block, hidden, recorded)

        before = stream.run_block(job.block, hidden, recorded)  # codes in place
        kept = first_lowering(job.tuning, block_error(before, targets, gains),
                              lambda attempt: tune_block(stream, job.block, job.codes, job.hidden,
                                                         job.targets, attempt, say, job.recorded,
                                                         job.residuals, gains), run,
                              lambda outputs: block_error(outputs, targets, gains))
    return job.codes if kept is None else kept[0]


def error_gains(stream: BlockStream, index: int, tuning: ScaleTuning) -> NormGains | None:
    """The gains block ``index``'s output error is weighted by in its tuning (None: plainly)."""
    return reading_norm(stream, index) if tuning.error == "gains" else None


def first_lowering(tuning: ScaleTuning, before: float,
                   tune: Callable[[ScaleTuning], dict[str, QuantizedTensor]],
                   run: Callable[[dict[str, QuantizedTensor]], list[torch.Tensor]],
                   error: Callable[[list[torch.Tensor]], float]
                   ) -> tuple[dict[str, QuantizedTensor], list[torch.Tensor]] | None:
    """The first tuning whose codes (``tune(attempt)``) give the block (``run(codes)``: its
    outputs with those codes in place) an ``error`` below ``before``, with those outputs; None
    where none does. The tunings tried in turn: with the rounding, then (where that did not
    lower the error) the scales alone. The rounding follows a gradient through a rounding step,
    which a block can mislead: a tiny trained model's first block at 2 bits ended above its
    GPTQ codes' error with it, below without it."""
    attempts = ([tuning, replace(tuning, rounding=0.0)] if tuning.rounding_size
                else [tuning])
    for attempt in attempts:
        codes = tune(attempt)
        outputs = run(codes)
        if error(outputs) < before:
            return codes, outputs
    return None

