"""measure -> maps.json: per module and candidate width, exact bytes and the error obtained, plus
a sensitivity per module, so that predicted dKL = sum_m sensitivity_m * error_m.

Sensitivity methods (the sensitivity is the mean KL(base || perturbed) of the next-token
distribution on the calibration tokens with the module alone at its 3-bit weights, divided by
that module's relative error: KL ~ s * ||dW||^2 / ||W||^2 holds for small perturbations):
- ``fisher`` (the default): that KL estimated from one streamed forward and one streamed
  backward pass, a block in memory at a time (``pipeline/calibrate/fisher.py``). Without ``--calib`` it
  calibrates on the generic English text the package ships (``dynquant/data/``).
- ``kl-exact`` (``kl`` is accepted as an alias): that KL measured, one full-model forward per module,
  the dense model in memory. The reference the estimate is checked against; small models.
- ``weight`` (data-free, ``--no-calib``; also what a model without weights or tokenizer gets):
  a prior per unit of relative error by the module's role and depth (``pipeline/calibrate/priors.py``).
  Its predicted error is in relative units, not nats: no loss prediction without text.
"""


import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dynquant.checkpoint.free_space import folder_nbytes, need_free_space
from dynquant.checkpoint.resume import PartialDir
from dynquant.errors import DynquantError
from dynquant.format.metadata import core_version
from dynquant.format.planner import TensorSpec, excluded_modules
from dynquant.models.sources import ModelSource
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.numerics.gptq import concat_rows, gptq_quantize, ordered_factor
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.allocate.allocation import (
    AllocationError,
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
    calibration_ids,
    calibration_record,
    read_calibration,
    synthetic_ids,
    synthetic_record,
)
from dynquant.pipeline.calibrate.weights import WeightsAt, WeightSource
from dynquant.pipeline.codes.code_chooser import (
    CodeChooser,
    SecondMoments,
)
from dynquant.pipeline.execute.executor import Executor, LocalExecutor
from dynquant.pipeline.execute.heap import return_freed_memory
from dynquant.pipeline.measure.candidates import measure_modules
from dynquant.pipeline.measure.forecast_check import forecast_check
from dynquant.pipeline.measure.options import (
    MeasureOptions,
    calibration_plan,
    gptq_ratios,
    moments_dir,
    probe_bits,
)
from dynquant.pipeline.measure.probe import KLProbe, dense_model

VARIANT_ROWS_ELEMENTS = 1 << 24  # weights compensated at once for a head's width variants


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
    # kept past the measure only where asked for (--second-moments, gptq pricing): for the
    # ratios alone they are ~1.7 GB a 7B block of files that nothing reads afterwards
    keep_moments = opts.second_moments
    if gptq_ratios(opts) and out is not None:  # X^T X for each Linear's ratio
        opts = replace(opts, second_moments=True)
    method = opts.method
    # fail on a missing or empty file before any work
    read_calibration(list(opts.calibration.texts))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    specs = source.tensor_specs()
    dense_out = set(excluded_modules(specs, opts.not_convert))
    quantizable = [s for s in specs if s.quantizable and s.module not in dense_out]
    blocks = 1 + max((block_index(s.module) or 0 for s in quantizable), default=0)
    at = WeightsAt.of(source, random_init)  # this process's source, the one jobs run here use
    weights = at.open()
    if out is not None and opts.second_moments:  # before the hours that write them
        where = moments_dir(out)
        need_free_space(where, moments_nbytes(quantizable) - folder_nbytes(where),
                        "the measure's second moments (X^T X of each block Linear's inputs)")
    partial = None if out is None else PartialDir(out, measure_job(source, opts, random_init))
    widths_kl: dict[str, dict[str, float]] = {}
    stats, probe_kl = _calibrate(source, weights, quantizable, opts, method, out, progress,
                                 partial, executor, widths_kl)
    ratio_moments = (moments_dir(out) if gptq_ratios(opts) and out is not None
                     and moments_dir(out).is_dir() else None)
    entries = measure_modules(quantizable, at, opts, _chooser(opts, stats, out), probe_kl,
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
    if gptq_ratios(opts) and out is not None and opts.forecast_check:
        doc["forecast_check"] = _forecast_check(source, doc, stats, opts, out, executor,
                                                progress)
    doc["allocations"] = allocations(maps_modules(doc), opts.budgets, group_size)
    if out is not None:
        tmp = Path(out).with_name(f".{Path(out).name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, out)
        partial.discard()
        if not keep_moments:
            shutil.rmtree(moments_dir(out), ignore_errors=True)
    return doc


def _forecast_check(source: ModelSource, doc: dict, stats: dict[str, torch.Tensor],
                    opts: MeasureOptions, out: str | Path, executor: Executor | None,
                    progress: bool) -> dict | None:
    """The measure's check of its own forecast (``measure/forecast_check.py``) on the text it
    calibrated on (``gptq_ratios`` implies one), said in a line."""
    bits, gs = probe_bits(opts)
    start = time.perf_counter()
    codes = opts.check_codes
    cal = opts.calibration
    check = forecast_check(source, doc, stats, list(cal.texts), cal.length, bits, gs,
                           Path(out).parent, executor, progress, codes, opts.tuning)
    if progress:
        said = ("none made (too short a text for held-out windows, or no module at the probe "
                "width): forecasts are sums over modules" if check is None else
                "; ".join(f"{codes} codes {p['widths']} measure {p['measured_kl']:.3g} nats/token, "
                          f"the modules' sum predicts {p['predicted_kl']:.3g}"
                          for p in check["points"]) + f" ({check['held_tokens']} held-out tokens)")
        print(f"dynquant: forecast check ({time.perf_counter() - start:.0f} s): {said}",
              file=sys.stderr)
    return check


def _record(opts: MeasureOptions) -> dict | None:
    cal = opts.calibration
    if cal.texts:
        return calibration_record(list(cal.texts), cal.seqs, cal.length)
    return synthetic_record(cal.seqs, cal.length) if opts.synthetic else None


def moments_nbytes(quantizable: list[TensorSpec]) -> int:
    """At least the bytes of the second moments a measure writes (``moments_dir``): float32
    X^T X of each block Linear's input (each module its own, q/k/v too), and an expert bank's
    per expert, its smaller side taken as the input (from below: where a bank's products run
    along its rows, the input is its larger side)."""
    total = 0
    for s in quantizable:
        if block_index(s.module) is None:
            continue
        if len(s.shape) == 2:
            total += s.shape[1] ** 2
        elif len(s.shape) == 3:
            total += s.shape[0] * min(s.shape[1], s.shape[2]) ** 2
    return 4 * total


def measure_job(source: ModelSource, opts: MeasureOptions, random_init: bool) -> dict:
    """What determines a measurement: the model's files (by name, size and time), the text,
    the options; a resumed run reuses a partial result only for the same job."""
    files = [] if source.directory is None else sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.directory.iterdir()
        if p.is_file())
    calib = [(str(c), Path(c).stat().st_size, Path(c).stat().st_mtime_ns)
             for c in opts.calibration.texts]
    return {"model": source.name, "files": files, "calib": calib, "method": opts.method,
            "random_init": random_init, "options": asdict(opts), "version": core_version()}


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
    if not opts.calibration.texts and not opts.synthetic:
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
    moments = moments_dir(out) if out is not None and opts.second_moments else None
    spill = None if partial is None else partial.dir
    head_moments: dict[str, torch.Tensor] = {}
    if moments is not None and opts.moment_seqs > opts.calibration.seqs:
        # X^T X wants many more tokens than the statistics and the Fisher estimate: a
        # forward-only pass of its own
        stream = BlockStream(source, weights, _ids(source, opts, opts.moment_seqs), chunk=1,
                             dtype=resolve_dtype(opts.dtype))
        wide = run_calibration_pass(stream, modules, moments, progress, executor=executor,
                                    activations_dir=spill)
        try:  # the head's too, for its compensated width variants
            head_moments = head_input_moments(wide, modules) if method == "fisher" else {}
        finally:
            wide.close()
        moments = None
        return_freed_memory()
    ids = _ids(source, opts, opts.calibration.seqs)
    stream = BlockStream(source, weights, ids, chunk=1, dtype=resolve_dtype(opts.dtype))
    cal = run_calibration_pass(stream, modules, moments, progress, executor=executor,
                               activations_dir=spill)
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
                            variant_kls=widths_kl, head_moments=head_moments,
                            executor=executor)
            if partial is not None:
                partial.write_tensors("calibration.safetensors", {
                    **stats, **{f"kl:{m}": torch.tensor(v, dtype=torch.float64)
                                for m, v in kls.items()},
                    **{f"kl@{m}|{name}": torch.tensor(v, dtype=torch.float64)
                       for m, by in widths_kl.items() for name, v in by.items()}})
            return stats, lambda spec: kls[spec.module]
    finally:
        cal.close()
    probe = KLProbe(dense_model(source, opts.dtype), ids)
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
                if hessian is not None and gptq_ratios(opts) and bits < 8:
                    factor = ordered_factor(hessian, dtype=torch.float64) if factor is None else factor
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


def _chooser(opts: MeasureOptions, stats: dict[str, torch.Tensor], out: str | Path | None
             ) -> CodeChooser:
    moments = None
    if opts.quantizer == "gptq":
        moments = SecondMoments(moments_dir(out))
    return CodeChooser(opts.quantizer, stats, moments)


def _ids(source: ModelSource, opts: MeasureOptions, seqs: int) -> torch.Tensor:
    """``seqs`` calibration windows: of the text, or of random tokens on the data-free path."""
    if opts.synthetic:
        return synthetic_ids(source.config.vocab_size, seqs, opts.calibration.length)
    return calibration_ids(load_tokenizer(source.directory), list(opts.calibration.texts), seqs,
                           opts.calibration.length)
