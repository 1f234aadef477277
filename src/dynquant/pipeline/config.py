"""What a run is asked, in sections: the text it calibrates on (:class:`Calibration`), how
widths are allocated (:class:`AllocationOptions`), how codes are chosen (:class:`CodeOptions`)
and where the work runs (:class:`RunOptions`). What a measurement measures is
``measure/options.py``'s :class:`MeasureOptions`, which holds a :class:`Calibration`; a quantize
request (``workflow.QuantizeRequest``) holds one of each. Every default is defined here once.

:func:`sectioned` builds a configuration from flat option names (``budget=4.25``,
``calib_seqs=16``), the way the Python API and the CLI name them, each routed to its section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dynquant.errors import DynquantError
from dynquant.format.widths import DEFAULT_GROUP_SIZE
from dynquant.pipeline.allocate.forecast import Forecast
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.tuned_scales import TUNING_DTYPES, ScaleTuning
from dynquant.pipeline.execute.executor import Executor


@dataclass(frozen=True)
class Calibration:
    """The text a run calibrates on: ``texts`` (files; none: dynquant's bundled English text),
    ``seqs`` windows of ``length`` tokens for the statistics and sensitivities."""

    texts: Sequence[str] = ()
    seqs: int = 8
    length: int = 256


# the CLI's and the API's flat names of Calibration's fields
CALIBRATION_NAMES = {"calib": "texts", "calib_seqs": "seqs", "calib_len": "length"}


@dataclass(frozen=True)
class AllocationOptions:
    """How a quantize gets its widths: a file (``widths``: ``maps.json[:BUDGET]``, a
    dynquant.json or a widths JSON), or an allocation of measured maps at ``budget`` average bits,
    or ``uniform`` bits; ``group_size`` for the written groups (``group_sizes``: the allocator's
    choice among several); ``pins`` (``MODULE_GLOB=BITS``) and width bounds constrain it."""

    widths: str | None = None
    budget: float | None = None
    uniform: int | None = None
    # None: ``written_group_size``'s default; a budget's measure prices its default sizes
    group_size: int | None = None
    group_sizes: Sequence[int] | None = None
    pins: Sequence[str] = ()
    min_bits: int | None = None
    max_bits: int | None = None

    @property
    def written_group_size(self) -> int:
        """The group size of widths that carry none (uniform widths, bare widths files, the
        checkpoint's planned size): as asked, else the format's default."""
        return self.group_size or DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class CodeOptions:
    """How codes are chosen. ``quantizer``: "gptq" (error-compensating, sequential over the
    blocks), "tuned" (gptq's codes with each block's scales tuned against the float block), "rtn"
    (round-to-nearest), "auto" (tuned when calibrating on text, else rtn); ``gptq_seqs``
    calibration windows the sequential pass streams; ``tuning`` the block tuning's settings;
    ``end_to_end``: then every scale tuned against the whole float model (steps 0: off; by
    default 40 for tuned codes of a model of at most 2 G quantized weights,
    ``EndToEndTuning.resolved``);
    ``chain_blocks`` K: the blocks in chains of K, each chain's codes from the float model's
    hidden states at its first block (no chain waits for another: on a cluster each is a job of
    its own; more KL the shorter the chains); 0: the whole model one chain (the default);
    ``independent_blocks``: chains of one block, every block's codes from the float model's
    hidden states; ``dtype``: the sequential pass's compute dtype, "float32" or "bfloat16"
    (None: bfloat16 for a model of more than 2 G quantized weights on a CPU with native bf16
    products, else float32: ``size_dtype``); ``float_targets``: GPTAQ (GPTQModel's ``v2``), each
    Linear's codes fitted to the float model's outputs from the quantized model's inputs by
    this fraction (0: plain GPTQ; 1: the whole way; None: 0.5 for the tuned codes' start in a
    model of at most 2 G quantized weights in one chain, else 0, ``default_float_targets``;
    BENCHMARKS.md "Error-compensating codes", "Tuned scales")."""

    quantizer: str = "auto"
    gptq_seqs: int = 48
    independent_blocks: bool = False
    tuning: ScaleTuning = field(default_factory=ScaleTuning)
    end_to_end: EndToEndTuning = field(default_factory=EndToEndTuning)
    chain_blocks: int = 0
    dtype: str | None = None
    float_targets: float | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in TUNING_DTYPES:
            raise DynquantError(f"the codes' dtype must be one of {', '.join(TUNING_DTYPES)}, "
                                f"not {self.dtype!r}", field="codes.dtype")
        if self.dtype is not None:  # (before any measuring: float32 steps need a float32 pass)
            self.tuning.resolved(self.dtype)
        if self.chain_blocks < 0:
            raise DynquantError(f"--chain-blocks must be 0 (the whole model one chain) or more, "
                                f"not {self.chain_blocks}", field="chain_blocks")
        if self.independent_blocks and self.chain_blocks not in (0, 1):
            raise DynquantError(f"--independent-blocks is chains of one block, not "
                                f"{self.chain_blocks}", field="chain_blocks")
        if self.float_targets is not None and not 0 <= self.float_targets <= 1:
            raise DynquantError(f"--float-targets must be a fraction in [0, 1], not "
                                f"{self.float_targets}", field="float_targets")
        if self.float_targets and self.chain:
            raise DynquantError("--float-targets fits the sequential pass's codes: not with "
                                "--chain-blocks or --independent-blocks", field="float_targets")

    @property
    def chain(self) -> int:
        """Blocks a chain holds (0: every block)."""
        return 1 if self.independent_blocks else self.chain_blocks


@dataclass(frozen=True)
class RunOptions:
    """Where and how the work runs: ``executor`` None/"local", "ray" (on the cluster at
    ``address``, or a local Ray instance) or an Executor (the output is the same bytes on any);
    ``progress`` bars; ``report`` told the forecast of a budget allocation before anything is
    written (None: printed to stderr unless progress is off)."""

    executor: Executor | str | None = None
    address: str | None = None
    progress: bool = True
    report: Callable[[Forecast], None] | None = None


def sectioned(config: Any, sections: Sequence[str], options: Mapping[str, Any]) -> Any:
    """``config`` with ``options`` applied: a section's name takes a whole section; any other
    name goes to the first that has a field of that name, the config itself, then its
    ``sections`` in order; Calibration's flat names (``calib``...) to the first that holds a
    ``calibration``. Unknown names: TypeError."""
    homes = {"": config, **{name: getattr(config, name) for name in sections}}
    given: dict[str, dict[str, Any]] = {name: {} for name in homes}
    whole = {}
    for key, value in options.items():
        if key in sections:
            whole[key] = value
            continue
        home = next((name for name, part in homes.items() if _takes(part, key)), None)
        if home is None:
            raise TypeError(f"unknown option {key!r}")
        given[home][key] = value
    parts = {name: _with(whole.get(name, homes[name]), given[name]) for name in sections}
    return _with(config, {**given[""], **parts})


def _takes(part: Any, key: str) -> bool:
    names = {f.name for f in fields(part)}
    return key in names or (key in CALIBRATION_NAMES and "calibration" in names)


def _with(section: Any, given: Mapping[str, Any]) -> Any:
    """``section`` with flat options; Calibration's names into its ``calibration``."""
    calibration = {CALIBRATION_NAMES[k]: v for k, v in given.items() if k in CALIBRATION_NAMES}
    rest = {k: v for k, v in given.items() if k not in CALIBRATION_NAMES}
    if calibration:
        rest["calibration"] = replace(section.calibration, **calibration)
    return replace(section, **rest)


__all__ = ["CALIBRATION_NAMES", "AllocationOptions", "Calibration", "CodeOptions", "RunOptions",
           "sectioned"]
