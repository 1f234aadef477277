"""Quantize a model: (measure ->) allocate -> quantize -> write, streaming one tensor at a time."""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from safetensors.torch import load_file

from dynquant.checkpoint.free_space import need_checkpoint_space
from dynquant.checkpoint.resume import PartialDir
from dynquant.errors import DynquantError
from dynquant.format.planner import excluded_modules, plan_document
from dynquant.format.widths_file import load_widths
from dynquant.models.sources import ModelSource
from dynquant.numerics.compute_dtype import size_dtype_reason
from dynquant.pipeline.allocate.allocation import Constraints, allocate_widths, parse_pins
from dynquant.pipeline.allocate.allocation import uniform_widths as uniform
from dynquant.pipeline.allocate.forecast import Forecast, forecast
from dynquant.pipeline.allocate.maps import (
    is_maps,
    load_maps,
    maps_modules,
    split_maps_arg,
)
from dynquant.pipeline.codes import end_to_end as e2e
from dynquant.pipeline.codes.code_chooser import SEQUENTIAL, CodeChooser
from dynquant.pipeline.codes.policy import check_request, choose_quantizer, gptq_calibration
from dynquant.pipeline.codes.tuned_scales import default_float_targets, default_pass_dtype
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.config import AllocationOptions, CodeOptions, RunOptions, sectioned
from dynquant.pipeline.execute.executor import Executor
from dynquant.pipeline.execute.scope import executor_scope
from dynquant.pipeline.measure.options import MeasureOptions, moments_dir
from dynquant.pipeline.measure.run import measure, measure_job

QUANTIZE_SECTIONS = ("allocation", "codes", "run", "measure")


@dataclass(frozen=True)
class QuantizeRequest:
    """What ``dynquant quantize`` is asked: where to write; what its own measurement measures
    when no maps are given (the calibration text, method, probe dtype, modules kept dense); how
    widths are allocated, codes chosen, and where the work runs (``pipeline/config.py``); a
    model built from its config with seeded random weights (``random_init``)."""

    output: str
    measure: MeasureOptions = field(default_factory=MeasureOptions)
    allocation: AllocationOptions = field(default_factory=AllocationOptions)
    codes: CodeOptions = field(default_factory=CodeOptions)
    run: RunOptions = field(default_factory=RunOptions)
    random_init: bool = False
    seed: int = 0
    overwrite: bool = False

    @classmethod
    def of(cls, output: str, **options) -> QuantizeRequest:
        """A request from flat option names (``budget=4.25``, ``quantizer="gptq"``,
        ``calib_seqs=16``...), each in its section, or whole sections (``codes=...``)."""
        return sectioned(cls(output), QUANTIZE_SECTIONS, options)


def _maps_for(source: ModelSource, req: QuantizeRequest, executor: Executor | None = None
              ) -> tuple[dict, Path, float | None]:
    """The maps document to allocate from (given, or measured now: candidates priced with
    round-to-nearest, each Linear's gptq ratio beside them), its path, and the budget."""
    alloc = req.allocation
    if alloc.widths is not None:
        path, budget = split_maps_arg(alloc.widths)
        return load_maps(path), Path(path), budget if budget is not None else alloc.budget
    # group sizes: as asked (--group-sizes, or the one --group-size), else the measure's
    # default for the model's size
    asked = alloc.group_sizes or ((alloc.group_size,) if alloc.group_size else None)
    opts = replace(req.measure, group_sizes=asked or req.measure.group_sizes,
                   budgets=[alloc.budget] if alloc.budget else [],
                   # rtn-priced candidates with each Linear's gptq ratio, whatever the codes:
                   # the allocations of gptq codes they give measure as well as gptq pricing's,
                   # in a fraction of its time (BENCHMARKS.md, gptq_quality)
                   quantizer="rtn", tuning=req.codes.tuning)
    size = _room_for_the_checkpoint(source, req)  # before the measure's hours, not after them
    if req.run.progress:
        print(f"dynquant: the checkpoint will take {size}; measuring the model first",
              file=sys.stderr)
    folder = PartialDir(_measure_base(req.output), measure_job(source, opts, req.random_init))
    maps_path = folder.dir / "maps.json"
    if maps_path.is_file():  # (written last, atomically: a whole measure)
        if req.run.progress:
            print(f"dynquant: the measure of an earlier run of this quantize, killed after it "
                  f"(same model, text and options): {folder.dir}", file=sys.stderr)
        maps = load_maps(maps_path)
    else:
        maps = measure(source, opts, maps_path, req.run.progress, req.random_init, executor)
    # X^T X a measure was asked to write (``second_moments``): the codes' pass makes its own
    shutil.rmtree(moments_dir(maps_path), ignore_errors=True)
    return maps, maps_path, alloc.budget


def _room_for_the_checkpoint(source: ModelSource, req: QuantizeRequest) -> str:
    """Free space for the checkpoint and its resume store at the size asked for, known before
    any measure: uniform widths give the packed bytes, a budget bounds them (at most budget x
    quantized weights / 8, which the allocation fills to within a module). ``quantize_model``
    checks again for the allocated widths' exact bytes. Returns the size, said in words."""
    alloc = req.allocation
    specs = source.tensor_specs()
    not_convert = tuple(req.measure.not_convert)
    dense = set(excluded_modules(specs, not_convert))
    bits = alloc.uniform if alloc.uniform is not None else 8
    plan = plan_document(specs, {s.module: bits for s in specs
                                 if s.quantizable and s.module not in dense},
                         model=source.name, group_size=alloc.written_group_size,
                         tied=source.tied,
                         modules_to_not_convert=not_convert)["accounting"]
    exact = alloc.uniform is not None or alloc.budget is None
    total = plan["total_nbytes"] if exact else (
        math.floor(alloc.budget * plan["quantized_elements"] / 8) + plan["dense_nbytes"])
    need_checkpoint_space(req.output, total)
    return (f"{'' if exact else 'at most '}{total / 1e6:,.1f} MB "
            f"({plan['quantized_elements'] / 1e6:,.1f} M weights quantized, "
            f"{plan['dense_nbytes'] / 1e6:,.1f} MB dense)")


def _measure_base(output: str | Path) -> Path:
    """``OUT.measure``: what a quantize's own measure's ``PartialDir`` is named after (its
    folder ``.OUT.measure.partial/``, beside the output): its spilled activations go to the disk
    the checkpoint goes to, a killed run's measure is found by its rerun (reused whole, or resumed
    from its partial), and the folder goes once the checkpoint is written."""
    output = Path(output)
    return output.with_name(f"{output.name}.measure")


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


def resolve_widths(source: ModelSource, req: QuantizeRequest,
                   executor: Executor | None = None) -> Widths:
    """The widths a quantize request asks for: given as a widths file, or allocated (uniform
    or at a budget) from a maps document, measured now when none is given."""
    alloc = req.allocation
    if alloc.widths is not None and not is_maps(alloc.widths):
        return Widths(dict(load_widths(alloc.widths)), "manual", alloc.widths)
    if alloc.widths is None and alloc.budget is None and alloc.uniform is None:
        raise DynquantError("give --widths, --budget or --uniform", field="widths")
    maps, maps_path, budget = _maps_for(source, req, executor)
    codes = choose_quantizer(req.codes.quantizer, source, req.random_init,
                             req.measure.calibration.texts, maps.get("calibration"))
    widths, allocator, tag = _allocate(req, maps, maps_path, budget, codes)
    measured_now = alloc.widths is None
    importance, stats_path = _statistics(maps, maps_path)
    files = [] if not measured_now else [maps_path, *([stats_path] if stats_path else [])]
    where = maps_path.name if measured_now else str(maps_path)
    return Widths(widths, allocator, f"{where} [{tag}]", importance, files,
                  calibration=maps.get("calibration"),
                  forecast_for_codes=_for_codes(maps, codes))


def _for_codes(maps: dict, codes: str) -> bool:
    """Whether the maps' errors are those of ``codes``: priced with them, or rtn-priced with
    the Linears' measured gptq ratios."""
    return maps.get("quantizer", "rtn") == codes or codes == "rtn" or any(
        "gptq_ratio" in m for m in maps["modules"].values())


def _allocate(req: QuantizeRequest, maps: dict, maps_path: Path, budget: float | None,
              codes: str) -> tuple[dict, str, str]:
    """(widths, allocator, tag): uniform, or the sensitivity allocation at ``budget`` for the
    ``codes`` that will be written (its forecast told before anything is written)."""
    asked = req.allocation
    cons = Constraints(pins=parse_pins(asked.pins), min_bits=asked.min_bits,
                       max_bits=asked.max_bits, group_sizes=asked.group_sizes)
    modules = maps_modules(maps, codes)
    if asked.uniform is not None:
        alloc = uniform(modules, asked.uniform, asked.written_group_size, cons)
        return dict(alloc.widths), "uniform", f"uniform {asked.uniform}"
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


def quantized_weights(source: ModelSource, widths: dict) -> int:
    """How many of the model's weights ``widths`` quantizes."""
    return sum(math.prod(spec.shape) for spec in source.tensor_specs()
               if spec.quantizable and spec.module in widths)


def _end_to_end(asked: e2e.EndToEndTuning, quantizer: str, weights: int, say: bool
                ) -> e2e.EndToEndTuning:
    """The end-to-end tuning the codes get (``EndToEndTuning.resolved``); with ``say``, a line
    where the default leaves it out for the model's size."""
    tuning = asked.resolved(quantizer, weights)
    if say and quantizer == "tuned" and asked.steps is None and not tuning.steps:
        print(f"dynquant: no end-to-end scales: {weights / 1e9:.1f} G quantized weights, past "
              f"{e2e.AUTO_MAX_WEIGHTS / 1e9:.1f} G (--e2e-steps N runs them)", file=sys.stderr)
    return tuning


def _pass_dtype(codes: CodeOptions, quantizer: str, weights: int, say: bool) -> str:
    """The codes' pass's compute dtype: as asked, else ``default_pass_dtype``'s; with ``say``,
    a line where the default takes bfloat16 for the model's size."""
    tuning = codes.tuning if quantizer == "tuned" else None
    dtype = codes.dtype or default_pass_dtype(tuning, weights)
    if say and codes.dtype is None and dtype == "bfloat16" and quantizer in SEQUENTIAL:
        print(f"dynquant: {quantizer} codes' pass in bfloat16: {size_dtype_reason(weights)} "
              "(--codes-dtype float32 keeps float32)", file=sys.stderr)
    return dtype


def _report(req: QuantizeRequest, f: Forecast) -> None:
    if req.run.report is not None:
        req.run.report(f)
    elif req.run.progress:
        for line in f.lines():
            print(line, file=sys.stderr)


def run_quantize(source: ModelSource, req: QuantizeRequest) -> dict:
    """``dynquant quantize``: measure (unless widths are given) -> allocate -> quantize -> write."""
    check_request(req.codes.quantizer, source, req.random_init)  # before any measuring
    with executor_scope(req.run.executor, req.run.address) as executor:
        result = _run(source, req, executor)
    # kept after a failure or a kill, as the resume store is: the rerun finds it
    shutil.rmtree(PartialDir.folder(_measure_base(req.output)), ignore_errors=True)
    return result


def _run(source: ModelSource, req: QuantizeRequest, executor: Executor) -> dict:
    """The work of ``run_quantize``, on ``executor``."""
    w = resolve_widths(source, req, executor)
    stats = next((f.name for f in w.files if f.name.endswith(".stats.safetensors")), None)
    codes, texts, progress = req.codes, req.measure.calibration.texts, req.run.progress
    quantizer = choose_quantizer(codes.quantizer, source, req.random_init, texts, w.calibration,
                                 say=progress)
    weights = quantized_weights(source, w.widths)
    end_to_end = _end_to_end(codes.end_to_end, quantizer, weights, progress)
    dtype = _pass_dtype(codes, quantizer, weights, progress)
    float_targets = (codes.float_targets if codes.float_targets is not None
                     else default_float_targets(quantizer, weights, codes.chain))
    sequential = (gptq_calibration(source, texts, w.calibration, codes.gptq_seqs,
                                   req.measure.calibration.length,
                                   codes.tuning.resolved(dtype, weights) if quantizer == "tuned"
                                   else None,
                                   end_to_end, codes.chain, dtype, float_targets)
                  if quantizer in SEQUENTIAL else None)
    chooser = CodeChooser(quantizer, w.importance or {}, sequential=sequential)
    if not w.forecast_for_codes and w.allocator == "sensitivity" and progress:
        print("dynquant: gptq codes; the predicted KL is for round-to-nearest codes (these "
              "maps have no gptq ratios: a measure on text records them)", file=sys.stderr)
    return quantize_model(
        source, w.widths, req.output, group_size=req.allocation.written_group_size,
        random_init=req.random_init, seed=req.seed, overwrite=req.overwrite,
        allocator=w.allocator, widths_from=w.widths_from,
        modules_to_not_convert=tuple(req.measure.not_convert),
        chooser=chooser, stats=stats, calibration=w.calibration,
        extra_files=w.files, progress=progress, executor=executor)
