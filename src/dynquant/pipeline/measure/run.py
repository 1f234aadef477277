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
import math
import os
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
from dynquant.numerics.compute_dtype import resolve_dtype, size_dtype, size_dtype_reason
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
from dynquant.pipeline.calibrate.calibration_pass import (
    MomentsSink,
    moments_files,
    run_calibration_pass,
)
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
from dynquant.pipeline.execute.executor import Executor, InOrder, LocalExecutor
from dynquant.pipeline.execute.heap import heap_served, return_freed_memory
from dynquant.pipeline.measure.candidates import (
    CandidatesWork,
    ModuleJob,
    measure_modules,
    ratios_job,
)
from dynquant.pipeline.measure.forecast_check import forecast_check
from dynquant.pipeline.measure.options import (
    MeasureOptions,
    calibration_plan,
    default_group_sizes,
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
    method = opts.method
    # fail on a missing or empty file before any work
    read_calibration(list(opts.calibration.texts))
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    specs = source.tensor_specs()
    dense_out = set(excluded_modules(specs, opts.not_convert))
    quantizable = [s for s in specs if s.quantizable and s.module not in dense_out]
    size = sum(math.prod(s.shape) for s in quantizable)
    opts = _passes_dtype(opts, size, progress)
    if opts.group_sizes is None:
        opts = replace(opts, group_sizes=default_group_sizes(size))
    blocks = 1 + max((block_index(s.module) or 0 for s in quantizable), default=0)
    at = WeightsAt.of(source, random_init)  # this process's source, the one jobs run here use
    weights = at.open()
    if out is not None and opts.second_moments:  # before the hours that write them
        where = moments_dir(out)
        need_free_space(where, moments_nbytes(quantizable) - folder_nbytes(where),
                        "the measure's second moments (X^T X of each block Linear's inputs)")
    partial = None if out is None else PartialDir(out, measure_job(source, opts, random_init))
    widths_kl: dict[str, dict[str, float]] = {}
    ratios: dict[str, dict[int, float]] = {}
    stats, probe_kl = _calibrate(source, weights, quantizable, opts, method, out, progress,
                                 partial, executor, widths_kl, ratios)
    entries = measure_modules(quantizable, at, opts, _chooser(opts, stats, out), probe_kl,
                               partial, executor or LocalExecutor(), progress,
                               lambda spec: data_free_sensitivity(spec, blocks,
                                                                  bool(source.tied)),
                               ratios)
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
        doc["forecast_check"] = _forecast_check(source, doc, stats, opts, partial.dir,
                                                executor, progress)
    doc["allocations"] = allocations(maps_modules(doc), opts.budgets, group_size)
    if out is not None:
        tmp = Path(out).with_name(f".{Path(out).name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, out)
        partial.discard()
    return doc


def _forecast_check(source: ModelSource, doc: dict, stats: dict[str, torch.Tensor],
                    opts: MeasureOptions, work: Path, executor: Executor | None,
                    progress: bool) -> dict | None:
    """The measure's check of its own forecast (``measure/forecast_check.py``) on the text it
    calibrated on (``gptq_ratios`` implies one), said in a line. Its checkpoints are made in
    ``work``, the measure's partial folder: a killed check leaves nothing beside maps.json."""
    bits, gs = probe_bits(opts)
    start = time.perf_counter()
    codes = opts.check_codes
    cal = opts.calibration
    check = forecast_check(source, doc, stats, list(cal.texts), cal.length, bits, gs,
                           work, executor, progress, codes, opts.tuning)
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


def _passes_dtype(opts: MeasureOptions, weights: int, progress: bool
                  ) -> MeasureOptions:
    """``opts`` with the calibration passes' dtype decided (``MeasureOptions.dtype``); with
    ``progress``, a line where the default takes bfloat16 for the model's size."""
    if opts.dtype is not None:
        return opts
    exact = opts.method in ("kl", "kl-exact")  # (differences of small KLs: float32)
    dtype = "float32" if exact else size_dtype(weights)
    if progress and dtype == "bfloat16":
        print(f"dynquant: calibration passes in bfloat16: {size_dtype_reason(weights)} "
              "(--dtype float32 keeps float32)", file=sys.stderr)
    return replace(opts, dtype=dtype)


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
               widths_kl: dict[str, dict[str, float]] | None = None,
               ratios: dict[str, dict[int, float]] | None = None
               ) -> tuple[dict[str, torch.Tensor], Callable[[TensorSpec], float] | None]:
    """Input statistics (saved beside ``out``) and how to get a module's KL at the probe width:
    nothing without text or synthetic tokens; else one streamed pass for the statistics, then
    (with text) the Fisher pass over the same stream or the exact probe on the dense model. The
    statistics and Fisher KLs are kept in ``partial`` for a resumed run. ``widths_kl`` gets
    the Fisher KL of the output head and input embedding at each candidate's codes, ``ratios``
    each block Linear's gptq ratios where the measure prices them (``gptq_ratios``)."""
    widths_kl = {} if widths_kl is None else widths_kl
    ratios = {} if ratios is None else ratios
    if not opts.calibration.texts and not opts.synthetic:
        return {}, None
    if source.directory is None:
        raise DynquantError("calibration needs model weights (a model directory)",
                            file=source.name)
    kept = None if partial is None else partial.read_tensors("calibration.safetensors")
    if kept is not None and method == "fisher":
        _read_kept(kept, widths_kl, ratios)
        kls = {k.removeprefix("kl:"): float(v) for k, v in kept.items() if k.startswith("kl:")}
        return ({k: v for k, v in kept.items() if not k.startswith(_KEPT)},
                lambda spec: kls[spec.module])
    modules = {s.module for s in quantizable}
    tied = set(source.tied.values())
    return_freed_memory()
    files = moments_dir(out) if out is not None and opts.second_moments else None
    spill = None if partial is None else partial.dir
    # X^T X in a pass of their own (after the statistics, which price the ratios) where they
    # want more windows than the statistics or a Linear's gptq ratio is taken from them
    own_pass = gptq_ratios(opts) or (files is not None
                                     and opts.moment_seqs > opts.calibration.seqs)
    ids = _ids(source, opts, opts.calibration.seqs)
    stream = BlockStream(source, weights, ids, chunk=1, dtype=resolve_dtype(opts.dtype))
    cal = run_calibration_pass(stream, modules, None if own_pass or files is None
                               else moments_files(files), progress, executor=executor,
                               activations_dir=spill)
    try:
        stats = cal.stats
        if out is not None:
            save_stats(stats, Path(out).with_name(Path(out).stem + ".stats.safetensors"))
        if method == "weight":  # data-free: statistics for the quantizer, priors for the rest
            return stats, None
        bits, gs = probe_bits(opts)

        head_moments: dict[str, torch.Tensor] = {}
        if own_pass:  # (the ratios' chooser rounds to nearest: it reads no moments)
            taker = _RatioSink(quantizable, WeightsAt.of(source, False),
                               _chooser(opts, stats, out), opts, executor or LocalExecutor()
                               ) if gptq_ratios(opts) else None
            sinks = ([] if files is None else [moments_files(files)]) + (
                [] if taker is None else [taker])  # (in this order: the taker pops them)
            head_moments = _moments_pass(source, weights, modules, opts, sinks, method,
                                         progress, executor, spill)
            if taker is not None:
                taker.head({m: h for m, h in head_moments.items() if m not in tied})
                ratios.update(taker.collect())
        chooser = _chooser(opts, stats, out)  # gptq pricing: reads the moments' files

        def probe_quantized(spec: TensorSpec, w: torch.Tensor) -> QuantizedTensor:
            return chooser.quantize(spec, w, bits, gs)

        if method == "fisher":
            kls = fisher_kl(cal, modules, probe_quantized, draws=opts.fisher_draws,
                            progress=progress,
                            variants=_width_variants(chooser, opts, compensated=tied),
                            variant_kls=widths_kl, head_moments=head_moments,
                            executor=executor)
            if partial is not None:
                partial.write_tensors("calibration.safetensors", {
                    **stats, **{f"kl:{m}": torch.tensor(v, dtype=torch.float64)
                                for m, v in kls.items()},
                    **{f"kl@{m}|{name}": torch.tensor(v, dtype=torch.float64)
                       for m, by in widths_kl.items() for name, v in by.items()},
                    **{f"ratio@{m}|{b}": torch.tensor(r, dtype=torch.float64)
                       for m, by in ratios.items() for b, r in by.items()}})
            return stats, lambda spec: kls[spec.module]
    finally:
        cal.close()
    probe = KLProbe(dense_model(source, opts.dtype), ids)
    return stats, lambda spec: probe.kl_with(  # the weight read again here, on the driver
        spec.module, probe_quantized(spec, weights.get(spec).float()).dequantize(torch.float32))


_KEPT = ("kl:", "kl@", "ratio@")  # a kept calibration's entries that are not statistics


def _read_kept(kept: dict[str, torch.Tensor], widths_kl: dict[str, dict[str, float]],
               ratios: dict[str, dict[int, float]]) -> None:
    """A killed measure's head / embedding KLs by codes and gptq ratios by width, as written."""
    for k, v in kept.items():
        if k.startswith(("kl@", "ratio@")):
            module, _, name = k.partition("@")[2].partition("|")
            if k.startswith("kl@"):
                widths_kl.setdefault(module, {})[name] = float(v)
            else:
                ratios.setdefault(module, {})[int(name)] = float(v)


def _moments_pass(source: ModelSource, weights: WeightSource, modules: set[str],
                  opts: MeasureOptions, sinks: list[MomentsSink], method: str, progress: bool,
                  executor: Executor | None, spill: Path | None) -> dict[str, torch.Tensor]:
    """A forward-only pass over ``opts.moment_seqs`` windows handing each block's X^T X to
    ``sinks`` in turn; returns the head's input moments (for its compensated width variants)."""
    def sink(block: int, moments: dict[str, torch.Tensor], say: Callable[[str], None]) -> None:
        for each in sinks:
            each(block, moments, say)

    stream = BlockStream(source, weights, _ids(source, opts, opts.moment_seqs), chunk=1,
                         dtype=resolve_dtype(opts.dtype))
    wide = run_calibration_pass(stream, modules, sink, progress, executor=executor,
                                activations_dir=spill)
    try:
        return head_input_moments(wide, modules) if method == "fisher" else {}
    finally:
        wide.close()
        return_freed_memory()


class _RatioSink:
    """A sink taking each block Linear's gptq ratios (``ratios_job``) from its moments as the
    pass sums them, so that no X^T X outlives its block (48.8 GB of files at a 7B's shapes).
    The jobs are submitted and taken back in order later (on a cluster they wait on no block)."""

    def __init__(self, quantizable: list[TensorSpec], weights: WeightsAt, chooser: CodeChooser,
                 opts: MeasureOptions, executor: Executor) -> None:
        self.linears = {s.module: s for s in quantizable if len(s.shape) == 2}
        self.work = CandidatesWork(weights, opts.widths, opts.group_sizes,
                                   replace(chooser, moments=None), weighted=True,
                                   threads=torch.get_num_threads(), probe=probe_bits(opts),
                                   bf16_errors=resolve_dtype(opts.dtype) == torch.bfloat16)
        self.executor = executor
        self.pending: InOrder[list[str], dict[int, float]] = InOrder(executor,
                                                                     torch.get_num_threads())
        self.ratios: dict[str, dict[int, float]] = {}

    def __call__(self, block: int, moments: dict[str, torch.Tensor],
                 say: Callable[[str], None]) -> None:
        """The moments pass's sink: block ``block``'s Linears' moments."""
        self._submit(moments, say)

    def head(self, moments: dict[str, torch.Tensor]) -> None:
        """An untied head's moments (from the pass's end): its ratios as a block Linear's."""
        self._submit(moments, lambda _: None)

    def _submit(self, moments: dict[str, torch.Tensor], say: Callable[[str], None]) -> None:
        names = [m for m in moments if m in self.linears]
        jobs = []
        with heap_served():  # each ratio's error sums remake the same chunks of rows
            for m in names:
                say(f"{m}'s gptq ratio")
                jobs.append(self.executor.submit(ratios_job, ModuleJob(self.linears[m],
                                                                       moments.pop(m)),
                                                 self.work, cpus=torch.get_num_threads()))
        self.pending.add(names, jobs)
        self._take()

    def collect(self) -> dict[str, dict[int, float]]:
        """Every block's ratios (module -> width -> ratio), once the pass is over."""
        self._take(end=True)
        return self.ratios

    def _take(self, end: bool = False) -> None:
        for names, results in self.pending.ready(end):
            self.ratios.update(zip(names, results, strict=True))


def _price_by_width(entry: dict, kls: dict[str, float]) -> None:
    """A head's or input embedding's candidates priced by the Fisher KL measured at each of
    their codes (both uses of a tied embedding; no extrapolation from the probe width), and,
    where its compensated codes were measured too (a tied embedding), their ratio to the
    rounded ones' KL (``gptq_ratio`` per candidate: quantize compensates a head at every width,
    and the allocator prices its candidates by the ratio where it is below 1)."""
    s = entry["sensitivity"]
    for c in entry["candidates"]:
        at = f"{c['bits']}:{c['group_size']}"
        rounded, compensated = kls.get(f"rtn:{at}"), kls.get(f"gptq:{at}")
        if rounded is None or s <= 0:
            continue
        c["error"] = rounded / s
        if compensated is not None:
            c["gptq_ratio"] = compensated / rounded if rounded > 0 else 1.0


def _width_variants(chooser: CodeChooser, opts: MeasureOptions, compensated: set[str]):
    """The codes a head or input embedding is measured at besides the probe: rounded at every
    candidate width, and (for gptq codes, given the head's input moments) compensated where
    the module is in ``compensated``: a tied embedding, whose compensated codes change its
    lookup too. An untied head's compensated codes are priced as a block Linear's are (its
    gptq ratio, ``_calibrate``), without a vocabulary-wide GPTQ at each width."""
    def variants(spec: TensorSpec, weight: torch.Tensor, hessian: torch.Tensor | None
                 ) -> Iterator[tuple[str, QuantizedTensor | None]]:
        factor = None
        compensate = hessian is not None and gptq_ratios(opts) and spec.module in compensated
        for gs in opts.group_sizes:
            for bits in opts.widths:
                yield f"rtn:{bits}:{gs}", chooser.quantize(spec, weight, bits, gs)
                if compensate and bits < 8:
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
