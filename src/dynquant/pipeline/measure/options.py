"""What a measurement is asked: its options, the method it runs, and the path it takes (the
bundled text, the user's text, or data-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dynquant.errors import DynquantError
from dynquant.models.sources import ModelSource
from dynquant.pipeline.calibrate.text import (
    calibration_blocker,
    default_calibration,
)
from dynquant.pipeline.codes.code_chooser import (
    check_quantizer,
)
from dynquant.pipeline.codes.tuned_scales import SMALL_MODEL_WEIGHTS, ScaleTuning
from dynquant.pipeline.config import Calibration, sectioned

METHODS = ("weight", "fisher", "kl-exact")
ALIASES = {"kl": "kl-exact"}
DEFAULT_WIDTHS = (2, 3, 4, 8)
DEFAULT_BUDGETS = (2.5, 3.0, 3.25, 3.5, 4.25)
PROBE_BITS = 3
# The group sizes a measure prices by default (``default_group_sizes``): 64 and 128 for a model of
# up to ``SMALL_MODEL_WEIGHTS`` quantized weights, so that the allocator can buy smaller
# groups with narrower codes (SmolLM2-135M at equal bytes: -33% / -24% KL at 4.25 / 3.25 bits
# calibrated, -40% data-free at 4.25; Gemma-3-270M unchanged: BENCHMARKS.md "Tuned scales"); 128
# alone past it, where every size more doubles the candidates and a head's compensated variants
# (unmeasured at 7B shapes)
SMALL_MODEL_GROUP_SIZES = (64, 128)
GROUP_SIZES = (128,)
CHECK_CODES = ("gptq", "tuned")  # the codes a forecast check can write


@dataclass(frozen=True)
class MeasureOptions:
    """What a measurement measures: candidate widths and group sizes, the budgets it summarises,
    the sensitivity method and its calibration, and what it writes beside the maps."""

    widths: Sequence[int] = DEFAULT_WIDTHS
    # None: ``default_group_sizes`` for the model's size (decided by ``measure``)
    group_sizes: Sequence[int] | None = None
    budgets: Sequence[float] = DEFAULT_BUDGETS
    method: str | None = None  # None: fisher (on the bundled text without calib), else weight
    # the text (none: the bundled data/calibration_default.txt) and its windows
    calibration: Calibration = field(default_factory=Calibration)
    not_convert: Sequence[str] = ()
    # The calibration passes' compute dtype (and the kl probe's). None: float32, except
    # bfloat16 for a model of more than 2 G quantized weights on a CPU with native bf16
    # products (``size_dtype``, decided by ``measure``; not for the exact probe): its Fisher
    # estimates rank the modules as float32's do and move them less than the label draws do
    # (tests/pipeline/test_streaming.py), and the real models at hand measured in bf16 end
    # within 1% of float32's KL at the same budget (BENCHMARKS.md "Scale"). The exact probe's
    # sensitivities are differences of small KLs, of the size of bf16 rounding's noise.
    dtype: str | None = None
    # Also write each Linear's input second moments X^T X / tokens beside maps.json
    # (``NAME.moments/block_NNN.safetensors``), for error-compensating quantizers, from
    # ``moment_seqs`` windows (a forward pass of their own when more than ``calib_seqs``, or
    # where the gptq ratios are taken from them, which they always are). The measure's gptq
    # ratios price the allocation as well from 16 windows as from 48 on SmolLM2 and
    # Gemma-3-270M (BENCHMARKS.md "Calibration windows"); the codes take their own 48.
    second_moments: bool = False
    moment_seqs: int = 16
    # Label draws per calibration sequence for the Fisher estimate: its relative noise per
    # module is about sqrt(2 / (sequences * draws)); each draw costs one backward pass.
    fisher_draws: int = 2
    # how the checkpoint's codes will be chosen (code_chooser.QUANTIZERS): gptq prices every
    # candidate, and probes the sensitivity, with the compensated codes (needs second moments)
    quantizer: str = "rtn"
    # data-free: the quantizer's column statistics from one streamed forward over uniform random
    # token ids (no text); set by calibration_plan when the model has weights to run
    synthetic: bool = False
    # with gptq ratios: quantize checkpoints allocated at the probe width's bytes and one bit
    # per weight more and measure their KL on held-out windows of the text, which the forecast
    # is scaled by (``measure/forecast_check.py``; about one gptq quantize's time: the measure
    # command does it unless told not to, quantize --budget's own measure does not)
    forecast_check: bool = False
    # the codes the check writes: gptq's by default, whose forecast bounds the tuned codes'
    # from above (``allocate/forecast.py`` ``bounded``) at a quarter of the tuned check's time;
    # "tuned" checks the default codes themselves
    check_codes: str = "gptq"
    # the tuned codes' settings (for a check of tuned codes)
    tuning: ScaleTuning = field(default_factory=ScaleTuning)

    @classmethod
    def of(cls, **options) -> MeasureOptions:
        """The options from flat names (the CLI's: ``calib``, ``calib_seqs``, ``calib_len`` for
        the calibration's fields, the rest as they are)."""
        return sectioned(cls(), (), options)


def measure_method(opts: MeasureOptions) -> str:
    method = ALIASES.get(opts.method, opts.method) or "fisher"
    if method not in METHODS:
        raise DynquantError(f"unknown method {opts.method!r} (one of {', '.join(METHODS)})",
                            field="method")
    if method == "weight" and opts.calibration.texts:
        raise DynquantError("--method weight is data-free: drop --calib, or use --method "
                            "fisher", field="method")
    check_quantizer(opts.quantizer)
    if opts.check_codes not in CHECK_CODES:
        raise DynquantError(f"unknown check codes {opts.check_codes!r} (one of "
                            f"{', '.join(CHECK_CODES)})", field="check_codes")
    if opts.quantizer == "gptq" and method == "weight":
        raise DynquantError("--quantizer gptq needs calibration text (its second moments): "
                            "drop --no-calib", field="quantizer")
    return method


def calibration_plan(source: ModelSource, opts: MeasureOptions, random_init: bool = False
                     ) -> tuple[MeasureOptions, str | None]:
    """The options a measurement runs with, and the one line to tell the user which path it
    takes: the bundled text when none is given, the data-free path when asked for or when the
    model has no weights or tokenizer to calibrate with (and no method needing them was asked
    for); data-free runs the model on random tokens for the quantizer's statistics when it can."""
    method = measure_method(opts)
    cal = opts.calibration
    if cal.texts:
        return replace(opts, method=method), None
    runnable = not random_init and source.directory is not None
    blocker = calibration_blocker(source, random_init) if method != "weight" else None
    if method != "weight" and blocker is None:
        return (replace(opts, method=method,
                        calibration=replace(cal, texts=[str(default_calibration())])),
                f"calibrating on dynquant's bundled English text ({cal.seqs} x "
                f"{cal.length} tokens); --calib FILE for your own, --no-calib for data-free")
    if blocker is not None and opts.method is not None:
        raise DynquantError(f"--method {method} needs {blocker}", file=source.name,
                            field="method")
    why = "" if blocker is None else f" ({blocker} to calibrate)"
    stats = ", column statistics from random tokens" if runnable else ""
    return (replace(opts, method="weight", synthetic=runnable),
            f"data-free sensitivities{why}: priors by module role and depth{stats}; "
            "no loss prediction")


def default_group_sizes(quantized_weights: int) -> tuple[int, ...]:
    """The group sizes a measure prices for a model of ``quantized_weights`` when none are
    asked for."""
    return (SMALL_MODEL_GROUP_SIZES if quantized_weights <= SMALL_MODEL_WEIGHTS
            else GROUP_SIZES)


def probe_bits(opts: MeasureOptions) -> tuple[int, int]:
    """The (width, group size) at which a module's KL is probed or estimated."""
    return (PROBE_BITS if PROBE_BITS in opts.widths else sorted(opts.widths)[0],
            max(opts.group_sizes))


def moments_dir(out: str | Path) -> Path:
    """Where a measure writes its second moments: ``NAME.moments`` beside ``NAME.json``."""
    return Path(out).with_name(Path(out).stem + ".moments")


def gptq_ratios(opts: MeasureOptions) -> bool:
    """Whether the measure prices round-to-nearest codes on text, for a checkpoint that will be
    written with gptq's codes by default (tuned or not): then each Linear gets the ratio of the two codes'
    output errors at the probe width (``gptq_ratio``), and forecasts are for gptq codes."""
    return (opts.quantizer == "rtn" and opts.method == "fisher"
            and bool(opts.calibration.texts))
