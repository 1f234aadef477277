"""measure -> maps.json: per module and candidate width, exact bytes and the error obtained, plus
a sensitivity per module, so that predicted dKL = sum_m sensitivity_m * error_m.

Sensitivity methods (the sensitivity is the mean KL(base || perturbed) of the next-token
distribution on the calibration tokens with the module alone at its 3-bit weights, divided by
that module's relative error: KL ~ s * ||dW||^2 / ||W||^2 holds for small perturbations):
- ``fisher`` (the default): that KL estimated from one streamed forward and one streamed
  backward pass, a block in memory at a time (``pipeline/calibrate/fisher.py``). Without ``--calib`` it
  calibrates on the generic English text the package ships (``dynquant/data/``).
- ``kl-exact`` (``kl`` is its old name): that KL measured, one full-model forward per module,
  the dense model in memory. The reference the estimate is checked against; small models.
- ``weight`` (data-free, ``--no-calib``; also what a model without weights or tokenizer gets):
  a prior per unit of relative error by the module's role and depth (``pipeline/calibrate/priors.py``).
  Its predicted error is in relative units, not nats: no loss prediction without text.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from dynquant.checkpoint.resume import PartialDir
from dynquant.errors import DynquantError
from dynquant.format.layout import LayerLayout
from dynquant.format.metadata import core_version
from dynquant.format.planner import TensorSpec, excluded_modules
from dynquant.models.sources import ModelSource
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.numerics.gptq import concat_rows, gptq_quantize, inverse_factor, output_error
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.allocate.allocation import (
    AllocationError,
    Candidate,
    Constraints,
    ModuleChoices,
    allocate_widths,
    widths_mapping,
)
from dynquant.pipeline.allocate.maps import MAPS_SCHEMA, maps_modules
from dynquant.pipeline.calibrate.block_stream import BlockStream
from dynquant.pipeline.calibrate.calibration_pass import run_calibration_pass
from dynquant.pipeline.calibrate.fisher import fisher_kl, head_input_moments
from dynquant.pipeline.calibrate.priors import block_index, data_free_sensitivity
from dynquant.pipeline.calibrate.statistics import save_stats
from dynquant.pipeline.calibrate.text import (
    calibration_blocker,
    calibration_ids,
    calibration_record,
    default_calibration,
    read_calibration,
    synthetic_ids,
    synthetic_record,
)
from dynquant.pipeline.calibrate.weights import WeightsAt, WeightSource
from dynquant.pipeline.codes.code_chooser import (
    CodeChooser,
    GivenMoments,
    SecondMoments,
    check_quantizer,
)
from dynquant.pipeline.execute.executor import Executor, LocalExecutor, use_threads
from dynquant.pipeline.execute.heap import return_freed_memory
from dynquant.pipeline.execute.progress import StageProgress
from dynquant.runtime.any_model import load_any

METHODS = ("weight", "fisher", "kl-exact")
ALIASES = {"kl": "kl-exact"}
DEFAULT_WIDTHS = (2, 3, 4, 8)
DEFAULT_BUDGETS = (2.5, 3.0, 3.25, 3.5, 4.25)
PROBE_BITS = 3
VARIANT_ROWS_ELEMENTS = 1 << 24  # weights compensated at once for a head's width variants


@dataclass
class MeasureOptions:
    widths: Sequence[int] = DEFAULT_WIDTHS
    group_sizes: Sequence[int] = (128,)
    budgets: Sequence[float] = DEFAULT_BUDGETS
    method: str | None = None  # None: fisher (on the bundled text without calib), else weight
    calib: Sequence[str] = ()  # empty: the bundled text (data/calibration_default.txt)
    calib_seqs: int = 8
    calib_len: int = 256
    not_convert: Sequence[str] = ()
    # The kl probe's compute dtype. float32 by default on every CPU: sensitivities are
    # differences of small KLs, and bf16 rounding of activations would be noise of their size.
    dtype: str = "float32"
    # Also write each Linear's input second moments X^T X / tokens beside maps.json
    # (``NAME.moments/block_NNN.safetensors``), for error-compensating quantizers, from
    # ``moment_seqs`` windows (a forward pass of their own when more than ``calib_seqs``: GPTQ
    # needs many more tokens for X^T X than the sensitivities do, BENCHMARKS.md
    # "Error-compensating codes").
    second_moments: bool = False
    moment_seqs: int = 48
    # Label draws per calibration sequence for the Fisher estimate: its relative noise per
    # module is about sqrt(2 / (sequences * draws)); each draw costs one backward pass.
    fisher_draws: int = 2
    # how the checkpoint's codes will be chosen (code_chooser.QUANTIZERS): gptq prices every
    # candidate, and probes the sensitivity, with the compensated codes (needs second moments)
    quantizer: str = "rtn"
    # data-free: the quantizer's column statistics from one streamed forward over uniform random
    # token ids (no text); set by calibration_plan when the model has weights to run
    synthetic: bool = False


def module_candidates(spec: TensorSpec, weight: torch.Tensor, widths: Sequence[int],
                      group_sizes: Sequence[int], chooser: CodeChooser,
                      weighted_errors: bool = True) -> list[Candidate]:
    """Each (width, group size): its bytes and the error of the codes ``chooser`` writes (the
    allocator sees the quantizer it gets), priced as ``CodeChooser.quantize_with_error``."""
    out = []
    for gs in group_sizes:
        for bits in widths:
            qt, err = chooser.quantize_with_error(spec, weight, bits, gs, weighted_errors)
            out.append(Candidate(bits, gs, qt.nbytes, err))
    return out


class KLProbe:
    """Mean KL(base || model with one module replaced) on calibration tokens."""

    def __init__(self, model: nn.Module, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        with torch.no_grad():
            self.base = [torch.log_softmax(model(row[None]).logits[0].float(), -1)
                         for row in ids]

    def kl_with(self, name: str, weight: torch.Tensor) -> float:
        param = _parameter(self.model, name)
        saved = param.data
        param.data = weight.to(saved.dtype).reshape(saved.shape)
        try:
            with torch.no_grad():
                kls = [(b.exp() * (b - torch.log_softmax(self.model(row[None]).logits[0]
                                                         .float(), -1))).sum(-1).mean()
                       for row, b in zip(self.ids, self.base, strict=True)]
        finally:
            param.data = saved
        return float(torch.stack(kls).mean())


def _parameter(model: nn.Module, module: str) -> nn.Parameter:
    try:
        return model.get_parameter(module)
    except AttributeError:
        return model.get_parameter(f"{module}.weight")


def allocations(modules: list[ModuleChoices], budgets: Sequence[float], group_size: int,
                constraints: Constraints | None = None) -> dict:
    out = {}
    for budget in budgets:
        try:
            alloc = allocate_widths(modules, budget, constraints)
        except AllocationError as exc:
            out[str(budget)] = {"error": exc.message}
            continue
        out[str(budget)] = {"widths": widths_mapping(alloc, group_size),
                            "packed_nbytes": alloc.packed_nbytes,
                            "average_bits": alloc.average_bits,
                            "predicted_error": alloc.predicted_error}
    return out


def _dense_model(source: ModelSource, dtype: str) -> nn.Module:
    if source.directory is None:
        raise DynquantError("the kl method needs model weights (a model directory)",
                            file=source.name)
    return load_any(source.directory, dtype=dtype)


def measure_method(opts: MeasureOptions) -> str:
    method = ALIASES.get(opts.method, opts.method) or "fisher"
    if method not in METHODS:
        raise DynquantError(f"unknown method {opts.method!r} (one of {', '.join(METHODS)})",
                            field="method")
    if method == "weight" and opts.calib:
        raise DynquantError("--method weight is data-free: drop --calib, or use --method "
                            "fisher", field="method")
    check_quantizer(opts.quantizer)
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
    if opts.calib:
        return replace(opts, method=method), None
    runnable = not random_init and source.directory is not None
    blocker = calibration_blocker(source, random_init) if method != "weight" else None
    if method != "weight" and blocker is None:
        return (replace(opts, method=method, calib=[str(default_calibration())]),
                f"calibrating on dynquant's bundled English text ({opts.calib_seqs} x "
                f"{opts.calib_len} tokens); --calib FILE for your own, --no-calib for data-free")
    if blocker is not None and opts.method is not None:
        raise DynquantError(f"--method {method} needs {blocker}", file=source.name,
                            field="method")
    why = "" if blocker is None else f" ({blocker} to calibrate)"
    stats = ", column statistics from random tokens" if runnable else ""
    return (replace(opts, method="weight", synthetic=runnable),
            f"data-free sensitivities{why}: priors by module role and depth{stats}; "
            "no loss prediction")


def measure(source: ModelSource, opts: MeasureOptions, out: str | Path | None = None,
            progress: bool = True, random_init: bool = False,
            executor: Executor | None = None) -> dict:
    """Measure every quantizable module; returns (and writes to ``out``) the maps document.
    The modules' candidates are computed on ``executor`` (default: this process)."""
    opts, note = calibration_plan(source, opts, random_init)
    if note and progress:
        print(f"dynquant: {note}", file=sys.stderr)
    if opts.quantizer == "gptq":  # priced with compensated codes: needs X^T X on disk
        if opts.method == "weight":
            raise DynquantError("--quantizer gptq needs calibration text and a model that can "
                                "run it (weights and a tokenizer)", file=source.name,
                                field="quantizer")
        if out is None:
            raise DynquantError("--quantizer gptq measures need an output path (for the "
                                "second moments beside it)", field="quantizer")
        opts = replace(opts, second_moments=True)
    if _gptq_ratios(opts) and out is not None:  # X^T X for each Linear's ratio
        opts = replace(opts, second_moments=True)
    method = opts.method
    read_calibration(list(opts.calib))  # fail on a missing or empty file before any work
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    specs = source.tensor_specs()
    dense_out = set(excluded_modules(specs, opts.not_convert))
    quantizable = [s for s in specs if s.quantizable and s.module not in dense_out]
    blocks = 1 + max((block_index(s.module) or 0 for s in quantizable), default=0)
    at = WeightsAt.of(source, random_init)  # this process's source, the one jobs run here use
    weights = at.open()
    partial = None if out is None else PartialDir(out, _job(source, opts, method, random_init))
    widths_kl: dict[str, dict[str, float]] = {}
    stats, probe_kl = _calibrate(source, weights, quantizable, opts, method, out, progress,
                                 partial, executor, widths_kl)
    ratio_moments = (_moments(out) if _gptq_ratios(opts) and out is not None
                     and _moments(out).is_dir() else None)
    entries = _measure_modules(quantizable, at, opts, _chooser(opts, stats, out), probe_kl,
                               partial, executor or LocalExecutor(), progress,
                               lambda spec: data_free_sensitivity(spec, blocks,
                                                                  bool(source.tied)),
                               None if ratio_moments is None else SecondMoments(ratio_moments))
    for spec, entry in zip(quantizable, entries, strict=True):
        if spec.module in widths_kl:
            _price_by_width(entry, widths_kl[spec.module])
    modules = {spec.module: entry for spec, entry in zip(quantizable, entries, strict=True)}
    stats_name = Path(out).stem + ".stats.safetensors" if out is not None and stats else None
    doc = {"schema": MAPS_SCHEMA, "model": source.name, "method": method,
           "quantizer": opts.quantizer,
           "stats": stats_name,  # beside maps.json
           "calibration": _record(opts),
           "widths": list(opts.widths), "group_sizes": list(opts.group_sizes),
           "modules_to_not_convert": sorted(dense_out), "modules": modules}
    group_size = max(opts.group_sizes)
    doc["allocations"] = allocations(maps_modules(doc), opts.budgets, group_size)
    if out is not None:
        tmp = Path(out).with_name(f".{Path(out).name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, out)
        partial.discard()
    return doc


def _record(opts: MeasureOptions) -> dict | None:
    if opts.calib:
        return calibration_record(list(opts.calib), opts.calib_seqs, opts.calib_len)
    return synthetic_record(opts.calib_seqs, opts.calib_len) if opts.synthetic else None


def _job(source: ModelSource, opts: MeasureOptions, method: str, random_init: bool) -> dict:
    """What determines a measurement: the model's files (by name, size and time), the text,
    the options; a resumed run reuses a partial result only for the same job."""
    files = [] if source.directory is None else sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.directory.iterdir()
        if p.is_file())
    calib = [(str(c), Path(c).stat().st_size, Path(c).stat().st_mtime_ns) for c in opts.calib]
    return {"model": source.name, "files": files, "calib": calib, "method": method,
            "random_init": random_init, "options": asdict(opts), "version": core_version()}


def probe_bits(opts: MeasureOptions) -> tuple[int, int]:
    """The (width, group size) at which a module's KL is probed or estimated."""
    return (PROBE_BITS if PROBE_BITS in opts.widths else sorted(opts.widths)[0],
            max(opts.group_sizes))


def _calibrate(source: ModelSource, weights: WeightSource, quantizable: list[TensorSpec],
               opts: MeasureOptions, method: str, out: str | Path | None, progress: bool,
               partial: PartialDir | None = None, executor: Executor | None = None,
               widths_kl: dict[str, dict[str, float]] | None = None
               ) -> tuple[dict[str, torch.Tensor], Callable[[TensorSpec], float] | None]:
    """Input statistics (saved beside ``out``) and how to get a module's KL at the probe width:
    nothing without text or synthetic tokens; else one streamed pass for the statistics, then
    (with text) the Fisher pass over the same stream or the exact probe on the dense model. The
    statistics and Fisher KLs are kept in ``partial`` for a resumed run. ``widths_kl`` gets
    the Fisher KL of the output head and input embedding at each candidate's codes."""
    widths_kl = {} if widths_kl is None else widths_kl
    if not opts.calib and not opts.synthetic:
        return {}, None
    if source.directory is None:
        raise DynquantError("calibration needs model weights (a model directory)",
                            file=source.name)
    kept = None if partial is None else partial.read_tensors("calibration.safetensors")
    if kept is not None and method == "fisher":
        kls = {k.removeprefix("kl:"): float(v) for k, v in kept.items() if k.startswith("kl:")}
        for k, v in kept.items():
            if k.startswith("kl@"):
                module, _, name = k.removeprefix("kl@").partition("|")
                widths_kl.setdefault(module, {})[name] = float(v)
        return ({k: v for k, v in kept.items() if not k.startswith(("kl:", "kl@"))},
                lambda spec: kls[spec.module])
    modules = {s.module for s in quantizable}
    return_freed_memory()
    moments = _moments(out) if out is not None and opts.second_moments else None
    head_moments: dict[str, torch.Tensor] = {}
    if moments is not None and opts.moment_seqs > opts.calib_seqs:
        # X^T X wants many more tokens than the statistics and the Fisher estimate: a
        # forward-only pass of its own
        stream = BlockStream(source, weights, _ids(source, opts, opts.moment_seqs), chunk=1,
                             dtype=resolve_dtype(opts.dtype))
        wide = run_calibration_pass(stream, modules, moments, progress, executor=executor)
        try:  # the head's too, for its compensated width variants
            head_moments = head_input_moments(wide, modules) if method == "fisher" else {}
        finally:
            wide.close()
        moments = None
        return_freed_memory()
    ids = _ids(source, opts, opts.calib_seqs)
    stream = BlockStream(source, weights, ids, chunk=1, dtype=resolve_dtype(opts.dtype))
    cal = run_calibration_pass(stream, modules, moments, progress, executor=executor)
    try:
        stats = cal.stats
        if out is not None:
            save_stats(stats, Path(out).with_name(Path(out).stem + ".stats.safetensors"))
        if method == "weight":  # data-free: statistics for the quantizer, priors for the rest
            return stats, None
        bits, gs = probe_bits(opts)

        chooser = _chooser(opts, stats, out)

        def probe_quantized(spec: TensorSpec, w: torch.Tensor) -> QuantizedTensor:
            return chooser.quantize(spec, w, bits, gs)

        if method == "fisher":
            kls = fisher_kl(cal, modules, probe_quantized, draws=opts.fisher_draws,
                            progress=progress, variants=_width_variants(chooser, opts),
                            variant_kls=widths_kl, head_moments=head_moments)
            if partial is not None:
                partial.write_tensors("calibration.safetensors", {
                    **stats, **{f"kl:{m}": torch.tensor(v, dtype=torch.float64)
                                for m, v in kls.items()},
                    **{f"kl@{m}|{name}": torch.tensor(v, dtype=torch.float64)
                       for m, by in widths_kl.items() for name, v in by.items()}})
            return stats, lambda spec: kls[spec.module]
    finally:
        cal.close()
    probe = KLProbe(_dense_model(source, opts.dtype), ids)
    return stats, lambda spec: probe.kl_with(  # the weight read again here, on the driver
        spec.module, probe_quantized(spec, weights.get(spec).float()).dequantize(torch.float32))


def _price_by_width(entry: dict, kls: dict[str, float]) -> None:
    """A head's or input embedding's candidates priced by the Fisher KL measured at each of
    their codes (both uses of a tied embedding; no extrapolation from the probe width), and,
    where its compensated codes were measured too, their ratio to the rounded ones' KL
    (``gptq_ratio`` per candidate: quantize compensates only where it is below 1)."""
    s = entry["sensitivity"]
    for c in entry["candidates"]:
        at = f"{c['bits']}:{c['group_size']}"
        rounded, compensated = kls.get(f"rtn:{at}"), kls.get(f"gptq:{at}")
        if rounded is None or s <= 0:
            continue
        c["error"] = rounded / s
        if compensated is not None:
            c["gptq_ratio"] = compensated / rounded if rounded > 0 else 1.0


def _width_variants(chooser: CodeChooser, opts: MeasureOptions):
    """The codes a head or input embedding is measured at besides the probe: rounded at every
    candidate width, and (for gptq codes, given the head's input moments) compensated."""
    def variants(spec: TensorSpec, weight: torch.Tensor, hessian: torch.Tensor | None
                 ) -> Iterator[tuple[str, QuantizedTensor | None]]:
        factor = None
        for gs in opts.group_sizes:
            for bits in opts.widths:
                yield f"rtn:{bits}:{gs}", chooser.quantize(spec, weight, bits, gs)
                if hessian is not None and _gptq_ratios(opts) and bits < 8:
                    factor = inverse_factor(hessian) if factor is None else factor
                    # a vocabulary-sized matrix a block of rows at a time (the rows are
                    # compensated independently), with a heartbeat for the progress line
                    parts = []
                    step = max(1, VARIANT_ROWS_ELEMENTS // weight.shape[1])
                    for r in range(0, weight.shape[0], step):
                        parts.append(gptq_quantize(weight[r : r + step], hessian, bits, gs,
                                                   factor=factor))
                        yield f"gptq:{bits}:{gs}", None
                    yield f"gptq:{bits}:{gs}", concat_rows(parts, tuple(weight.shape))
    return variants


def _moments(out: str | Path) -> Path:
    """Where a measure writes its second moments: ``NAME.moments`` beside ``NAME.json``."""
    return Path(out).with_name(Path(out).stem + ".moments")


def _gptq_ratios(opts: MeasureOptions) -> bool:
    """Whether the measure prices round-to-nearest codes on text, for a checkpoint that will be
    written with gptq codes by default: then each Linear gets the ratio of the two codes'
    output errors at the probe width (``gptq_ratio``), and forecasts are for gptq codes."""
    return opts.quantizer == "rtn" and opts.method == "fisher" and bool(opts.calib)


def _chooser(opts: MeasureOptions, stats: dict[str, torch.Tensor], out: str | Path | None
             ) -> CodeChooser:
    moments = None
    if opts.quantizer == "gptq":
        moments = SecondMoments(_moments(out))
    return CodeChooser(opts.quantizer, stats, moments)


def _ids(source: ModelSource, opts: MeasureOptions, seqs: int) -> torch.Tensor:
    """``seqs`` calibration windows: of the text, or of random tokens on the data-free path."""
    if opts.synthetic:
        return synthetic_ids(source.config.vocab_size, seqs, opts.calib_len)
    return calibration_ids(load_tokenizer(source.directory), list(opts.calib), seqs,
                           opts.calib_len)


@dataclass
class CandidatesWork:
    """What every module's candidates job shares (sent to a worker once)."""

    weights: WeightsAt
    widths: Sequence[int]
    group_sizes: Sequence[int]
    chooser: CodeChooser
    weighted: bool
    # gptq-priced candidates or ratios: the driver's torch threads, which a worker takes on too
    # (its matrix products round differently on another number of threads; round-to-nearest's
    # errors are the same bits on any number)
    threads: int | None = None
    probe: tuple[int, int] | None = None  # (bits, group size) of the gptq ratio


@dataclass
class ModuleMeasure:
    """A module's candidates, and (rtn-priced, with second moments) the ratio of its gptq
    codes' output error to round-to-nearest's at the probe width."""

    candidates: list[Candidate]
    gptq_ratio: float | None = None


@dataclass
class ModuleJob:
    """One module to measure, with its second moments when gptq prices it (read by the
    driver: a worker on another machine cannot read the driver's files)."""

    spec: TensorSpec
    hessian: torch.Tensor | None = None


def candidates_job(job: ModuleJob, work: CandidatesWork) -> ModuleMeasure:
    """The pure per-module work (run by an executor, here or on a worker)."""
    if work.threads is not None:
        use_threads(work.threads)
    chooser = work.chooser if job.hessian is None else replace(
        work.chooser, moments=GivenMoments(job.spec.module, job.hessian))
    weight = work.weights.open().get(job.spec)
    cands = module_candidates(job.spec, weight, work.widths, work.group_sizes, chooser,
                              work.weighted)
    ratio = None
    if (job.hessian is not None and chooser.quantizer == "rtn" and work.probe is not None
            and weight.ndim == 2):  # Linears (banks and embeddings: rounded to nearest)
        ratio = gptq_ratio(job.spec, weight, job.hessian, chooser, *work.probe)
    return ModuleMeasure(cands, ratio)


def gptq_ratio(spec: TensorSpec, weight: torch.Tensor, hessian: torch.Tensor,
               chooser: CodeChooser, bits: int, group_size: int) -> float:
    """Output error over the calibration inputs (H = X^T X / n) of the compensated codes over
    that of the codes ``chooser`` rounds to nearest: the factor that turns a forecast for
    round-to-nearest codes into one for the gptq codes ``quantize`` writes."""
    rtn = chooser.quantize(spec, weight, bits, group_size)
    gptq = replace(chooser, quantizer="gptq", moments=GivenMoments(spec.module, hessian),
                   _cached=None).quantize(spec, weight, bits, group_size)
    base = output_error(weight, rtn, hessian)
    return output_error(weight, gptq, hessian) / base if base > 0 else 1.0


def _measure_modules(quantizable: list[TensorSpec], weights: WeightsAt, opts: MeasureOptions,
                     chooser: CodeChooser, probe_kl: Callable[[TensorSpec], float] | None,
                     partial: PartialDir | None, executor: Executor, progress: bool,
                     prior: Callable[[TensorSpec], float],
                     ratio_moments: SecondMoments | None = None) -> list[dict]:
    """Each module's maps entry, in order: from ``partial`` when a killed run finished it,
    else its candidates from ``executor`` and its sensitivity here (with ``ratio_moments``:
    each Linear's gptq ratio too)."""
    entries: list[dict | None] = [None if partial is None else partial.read_json(
        f"m{index:06d}.json") for index in range(len(quantizable))]
    todo = [index for index, entry in enumerate(entries) if entry is None]
    # data-free: random-token statistics steer the clip search, but the priors price plain
    # relative errors (random tokens' statistics weigh the columns unlike text does, and
    # weighting the candidates' errors by them misleads the allocation: `benchmarks/data_free.py`)
    moments = chooser.moments or ratio_moments
    work = CandidatesWork(weights, opts.widths, opts.group_sizes,
                          replace(chooser, moments=None), weighted=opts.method != "weight",
                          threads=torch.get_num_threads() if moments else None,
                          probe=probe_bits(opts) if ratio_moments is not None else None)
    # read as they are submitted (the executor pulls jobs as tasks finish), not all at once
    jobs = (ModuleJob(quantizable[i], None if moments is None
                      else moments.get(quantizable[i].module)) for i in todo)
    with StageProgress(enabled=progress) as bar:
        task = bar.add_task("measuring", total=len(quantizable),
                            completed=len(quantizable) - len(todo))
        results = executor.map(candidates_job, jobs, work, cpus=work.threads or 1)
        for index, result in zip(todo, results, strict=True):
            spec = quantizable[index]
            entries[index] = _entry(spec, result.candidates, opts, probe_kl, prior(spec))
            if result.gptq_ratio is not None:
                entries[index]["gptq_ratio"] = result.gptq_ratio
            if partial is not None:  # a killed run starts again from here
                partial.write_json(f"m{index:06d}.json", entries[index])
            bar.advance(task)
    return [e for e in entries if e is not None]


def _entry(spec: TensorSpec, cands: list[Candidate], opts: MeasureOptions,
           probe_kl: Callable[[TensorSpec], float] | None, prior: float) -> dict:
    """A module's maps entry from its candidates and its sensitivity."""
    if probe_kl is not None:
        # KL of the module's own probe-width weights over their (possibly importance-weighted)
        # error: predicted KL = sensitivity * error reproduces that KL exactly at the probe.
        bits, gs = probe_bits(opts)
        probe_err = next(c.error for c in cands if (c.bits, c.group_size) == (bits, gs))
        sensitivity = probe_kl(spec) / max(probe_err, 1e-12)
    else:
        sensitivity = prior
    if not math.isfinite(sensitivity):
        raise DynquantError("non-finite sensitivity", module=spec.module, field="sensitivity")
    return {"logical_shape": list(spec.shape),
            "elements": LayerLayout.create(spec.shape, 8, 128).elements,
            "sensitivity": max(sensitivity, 0.0),
            "candidates": [{"bits": c.bits, "group_size": c.group_size, "nbytes": c.nbytes,
                            "error": c.error} for c in cands]}
