"""Quantize a model: (measure ->) allocate -> quantize -> write, streaming one tensor at a time."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from dynquant.errors import DynquantError
from dynquant.format.widths_file import load_widths
from dynquant.models.sources import ModelSource
from dynquant.pipeline.allocate.allocation import Constraints, allocate_widths, parse_pins
from dynquant.pipeline.allocate.allocation import uniform_widths as uniform
from dynquant.pipeline.allocate.forecast import Forecast, forecast
from dynquant.pipeline.allocate.maps import (
    compensates_head,
    is_maps,
    load_maps,
    maps_modules,
    split_maps_arg,
)
from dynquant.pipeline.codes.code_chooser import SEQUENTIAL, CodeChooser
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.policy import check_request, choose_quantizer, gptq_calibration
from dynquant.pipeline.codes.tuned_scales import ScaleTuning
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.execute.executor import Executor
from dynquant.pipeline.execute.scope import executor_scope
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure


@dataclass
class QuantizeRequest:
    """What ``dynquant quantize`` was asked (the CLI's arguments, as data)."""

    output: str
    widths: str | None = None  # maps.json[:BUDGET] | dynquant.json | widths.json
    budget: float | None = None
    uniform: int | None = None
    calib: Sequence[str] = ()
    calib_seqs: int = 8
    calib_len: int = 256
    method: str | None = None
    dtype: str = "float32"  # the kl probe's compute dtype (MeasureOptions.dtype)
    group_size: int = 128
    group_sizes: Sequence[int] | None = None
    pins: Sequence[str] = ()
    min_bits: int | None = None
    max_bits: int | None = None
    not_convert: Sequence[str] = ()
    random_init: bool = False
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    # told the forecast of a budget allocation before anything is written (None: printed to
    # stderr unless progress is off)
    report: Callable[[Forecast], None] | None = None
    # "gptq": error-compensating, sequential over the blocks; "tuned": gptq's codes with each
    # block's scales tuned against the float block; "rtn": round-to-nearest; "auto": tuned when
    # calibrating on text, else rtn
    quantizer: str = "auto"
    gptq_seqs: int = 48  # calibration windows the sequential gptq pass streams
    tuning: ScaleTuning = field(default_factory=ScaleTuning)  # for "tuned"
    # gptq / tuned codes: then every scale tuned against the whole float model (steps 0: off)
    end_to_end: EndToEndTuning = field(default_factory=EndToEndTuning)
    # where the per-module work runs (pipeline/execute/executor.py): None/"local", "ray" (on the
    # cluster at ``address``, or a local Ray instance), or an Executor
    executor: Executor | str | None = None
    address: str | None = None


def _maps_for(source: ModelSource, req: QuantizeRequest, workdir: Path,
              executor: Executor | None = None) -> tuple[dict, Path, float | None]:
    """The maps document to allocate from (given, or measured now, candidates priced with
    round-to-nearest unless ``--quantizer gptq``), its path, and the budget."""
    if req.widths is not None:
        path, budget = split_maps_arg(req.widths)
        return load_maps(path), Path(path), budget if budget is not None else req.budget
    maps_path = workdir / "maps.json"
    opts = MeasureOptions(calib=list(req.calib), method=req.method, calib_seqs=req.calib_seqs,
                          calib_len=req.calib_len,
                          group_sizes=req.group_sizes or (req.group_size,),
                          budgets=[req.budget] if req.budget else [],
                          # auto: rtn-priced candidates with each Linear's gptq ratio, a
                          # fraction of gptq pricing's time (BENCHMARKS.md, gptq_quality)
                          quantizer="gptq" if req.quantizer == "gptq" else "rtn",
                          not_convert=req.not_convert, dtype=req.dtype, tuning=req.tuning)
    return (measure(source, opts, maps_path, req.progress, req.random_init, executor),
            maps_path, req.budget)


@dataclass
class Widths:
    """The widths to quantize with and where they came from (for provenance)."""

    widths: dict
    allocator: str
    widths_from: str
    importance: dict | None = None
    files: list[Path] = field(default_factory=list)  # shipped inside the checkpoint
    calibration: dict | None = None  # the maps' record of the calibration text
    forecast_for_codes: bool = True  # the forecast is for the codes written (else for rtn's)
    compensate_head: bool = True  # gptq codes compensate the output head (compensates_head)


def resolve_widths(source: ModelSource, req: QuantizeRequest, workdir: Path,
                   executor: Executor | None = None) -> Widths:
    """The widths a quantize request asks for: given as a widths file, or allocated (uniform
    or at a budget) from a maps document, measured now when none is given."""
    if req.widths is not None and not is_maps(req.widths):
        return Widths(dict(load_widths(req.widths)), "manual", req.widths)
    if req.widths is None and req.budget is None and req.uniform is None:
        raise DynquantError("give --widths, --budget or --uniform", field="widths")
    maps, maps_path, budget = _maps_for(source, req, workdir, executor)
    codes = choose_quantizer(req.quantizer, source, req.random_init, req.calib,
                             maps.get("calibration"))
    widths, allocator, tag = _allocate(req, maps, maps_path, budget, codes)
    measured_now = req.widths is None
    importance, stats_path = _statistics(maps, maps_path)
    files = [] if not measured_now else [maps_path, *([stats_path] if stats_path else [])]
    where = maps_path.name if measured_now else str(maps_path)
    return Widths(widths, allocator, f"{where} [{tag}]", importance, files,
                  calibration=maps.get("calibration"),
                  forecast_for_codes=_for_codes(maps, codes),
                  compensate_head=compensates_head(maps, widths))


def _for_codes(maps: dict, codes: str) -> bool:
    """Whether the maps' errors are those of ``codes``: priced with them, or rtn-priced with
    the Linears' measured gptq ratios."""
    return maps.get("quantizer", "rtn") == codes or codes == "rtn" or any(
        "gptq_ratio" in m for m in maps["modules"].values())


def _allocate(req: QuantizeRequest, maps: dict, maps_path: Path, budget: float | None,
              codes: str) -> tuple[dict, str, str]:
    """(widths, allocator, tag): uniform, or the sensitivity allocation at ``budget`` for the
    ``codes`` that will be written (its forecast told before anything is written)."""
    cons = Constraints(pins=parse_pins(req.pins), min_bits=req.min_bits,
                       max_bits=req.max_bits, group_sizes=req.group_sizes)
    modules = maps_modules(maps, codes)
    if req.uniform is not None:
        alloc = uniform(modules, req.uniform, req.group_size, cons)
        return dict(alloc.widths), "uniform", f"uniform {req.uniform}"
    if budget is None:
        raise DynquantError("maps.json needs a budget (PATH:BUDGET or --budget)",
                            file=str(maps_path), field="budget")
    alloc = allocate_widths(modules, budget, cons)
    _report(req, forecast(maps, modules, budget, cons, alloc, codes))
    return dict(alloc.widths), "sensitivity", f"{budget}"


def _statistics(maps: dict, maps_path: Path) -> tuple[dict | None, Path | None]:
    """The calibration statistics the maps recorded beside themselves, and their path."""
    if not maps.get("stats"):
        return None, None

    stats_path = maps_path.parent / maps["stats"]
    return load_file(stats_path), stats_path


def _report(req: QuantizeRequest, f: Forecast) -> None:
    if req.report is not None:
        req.report(f)
    elif req.progress:
        for line in f.lines():
            print(line, file=sys.stderr)


def run_quantize(source: ModelSource, req: QuantizeRequest) -> dict:
    """``dynquant quantize``: measure (unless widths are given) -> allocate -> quantize -> write."""
    check_request(req.quantizer, source, req.random_init)  # before any measuring
    workdir = Path(tempfile.mkdtemp(prefix="dynquant-measure-"))
    try:
        with executor_scope(req.executor, req.address) as executor:
            return _run(source, req, workdir, executor)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(source: ModelSource, req: QuantizeRequest, workdir: Path, executor: Executor) -> dict:
    """The work of ``run_quantize``, on ``executor``."""
    w = resolve_widths(source, req, workdir, executor)
    stats = next((f.name for f in w.files if f.name.endswith(".stats.safetensors")), None)
    quantizer = choose_quantizer(req.quantizer, source, req.random_init, req.calib,
                                 w.calibration, say=req.progress)
    sequential = (gptq_calibration(source, req.calib, w.calibration, req.gptq_seqs,
                                   req.calib_len, w.compensate_head,
                                   req.tuning if quantizer == "tuned" else None,
                                   req.end_to_end)
                  if quantizer in SEQUENTIAL else None)
    chooser = CodeChooser(quantizer, w.importance or {}, sequential=sequential)
    if not w.forecast_for_codes and w.allocator == "sensitivity" and req.progress:
        print("dynquant: gptq codes; the predicted KL is for round-to-nearest codes (these "
              "maps have no gptq ratios: measure on text with an output path)", file=sys.stderr)
    return quantize_model(
        source, w.widths, req.output, group_size=req.group_size,
        random_init=req.random_init, seed=req.seed, overwrite=req.overwrite,
        allocator=w.allocator, widths_from=w.widths_from,
        modules_to_not_convert=tuple(req.not_convert),
        chooser=chooser, stats=stats, calibration=w.calibration,
        extra_files=w.files, progress=req.progress, executor=executor)
