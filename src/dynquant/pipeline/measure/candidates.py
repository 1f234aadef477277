"""A module's maps entry: its candidate widths with their bytes and errors (computed as a job an
executor runs, here or on a Ray worker), its gptq ratio, and its sensitivity."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from dynquant.checkpoint.resume import PartialDir
from dynquant.errors import DynquantError
from dynquant.format.layout import LayerLayout
from dynquant.format.planner import TensorSpec
from dynquant.numerics.gptq import output_squared_error
from dynquant.pipeline.allocate.allocation import (
    Candidate,
)
from dynquant.pipeline.calibrate.weights import WeightsAt
from dynquant.pipeline.codes.code_chooser import CodeChooser, GivenMoments
from dynquant.pipeline.execute.executor import Executor, use_threads
from dynquant.pipeline.execute.heap import heap_served
from dynquant.pipeline.execute.progress import StageProgress
from dynquant.pipeline.measure.options import MeasureOptions, probe_bits


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
    probe: tuple[int, int] | None = None  # (bits, group size) a gptq ratio is quoted at
    # a gptq ratio's output errors multiplied in bf16 (a bf16 measure's), else in float32
    bf16_errors: bool = False


@dataclass
class ModuleJob:
    """One module to measure, with its second moments when gptq prices it or its gptq ratio is
    taken (sent by the driver: a worker on another machine cannot read the driver's files)."""

    spec: TensorSpec
    hessian: torch.Tensor | None = None


def candidates_job(job: ModuleJob, work: CandidatesWork) -> list[Candidate]:
    """The pure per-module work (run by an executor, here or on a worker)."""
    if work.threads is not None:
        use_threads(work.threads)
    chooser = work.chooser if job.hessian is None else replace(
        work.chooser, moments=GivenMoments(job.spec.module, job.hessian))
    weight = work.weights.open().get(job.spec)
    return module_candidates(job.spec, weight, work.widths, work.group_sizes, chooser,
                             work.weighted)


def ratios_job(job: ModuleJob, work: CandidatesWork) -> dict[int, float]:
    """A Linear's :func:`gptq_ratios` at each candidate width and the probe's, from its second
    moments (``job.hessian``), against the round-to-nearest codes of ``work.chooser``."""
    assert job.hessian is not None and work.threads is not None and work.probe is not None
    use_threads(work.threads)
    bits, group_size = work.probe
    chooser = replace(work.chooser, moments=GivenMoments(job.spec.module, job.hessian))
    weight = work.weights.open().get(job.spec)
    return gptq_ratios(job.spec, weight, job.hessian, chooser, sorted({*work.widths, bits}),
                       group_size, work.bf16_errors)


RATIO_ROWS = 256  # rows a Linear's gptq ratio is measured on


def ratio_rows(rows: int) -> torch.Tensor:
    """The rows a ratio is measured on: evenly spaced, at most ``RATIO_ROWS``. GPTQ compensates
    each row on its own (the second moments are the inputs'), and the output error is a sum
    over rows, so a sample of rows estimates the ratio at a fraction of the cost."""
    return torch.linspace(0, rows - 1, min(rows, RATIO_ROWS)).round().long().unique()


def gptq_ratios(spec: TensorSpec, weight: torch.Tensor, hessian: torch.Tensor,
                chooser: CodeChooser, widths: Sequence[int], group_size: int,
                bf16_errors: bool = False) -> dict[int, float]:
    """Per width, the output error over the calibration inputs (H = X^T X / n) of the
    compensated codes over that of the codes ``chooser`` rounds to nearest, on
    :func:`ratio_rows`: the factor that turns a forecast for round-to-nearest codes into one
    for the gptq codes ``quantize`` writes (maps.py's :func:`width_trend` prices the widths by
    it). One row sample and one inverse factor serve every width; with ``bf16_errors`` the
    output errors are products of bf16 H and errors (summed in float32)."""
    sample = weight[ratio_rows(weight.shape[0])].float()
    spec = replace(spec, shape=tuple(sample.shape))
    gptq = replace(chooser, quantizer="gptq", moments=GivenMoments(spec.module, hessian),
                   _cached=None)
    ratios = {}
    priced = hessian.bfloat16() if bf16_errors else hessian
    for bits in widths:
        base = output_squared_error(sample, chooser.quantize(spec, sample, bits, group_size),
                                    priced)
        compensated = output_squared_error(sample, gptq.quantize(spec, sample, bits, group_size),
                                           priced)
        ratios[bits] = compensated / base if base > 0 else 1.0
    return ratios


def measure_modules(quantizable: list[TensorSpec], weights: WeightsAt, opts: MeasureOptions,
                     chooser: CodeChooser, probe_kl: Callable[[TensorSpec], float] | None,
                     partial: PartialDir | None, executor: Executor, progress: bool,
                     prior: Callable[[TensorSpec], float],
                     ratios: Mapping[str, Mapping[int, float]] | None = None) -> list[dict]:
    """Each module's maps entry, in order: from ``partial`` when a killed run finished it,
    else its candidates from ``executor`` and its sensitivity here, with its gptq ratios
    where ``ratios`` has them (module -> width -> ratio, :func:`ratios_job`'s)."""
    entries: list[dict | None] = [None if partial is None else partial.read_json(
        f"m{index:06d}.json") for index in range(len(quantizable))]
    todo = [index for index, entry in enumerate(entries) if entry is None]
    ratios = ratios or {}
    # data-free: random-token statistics steer the clip search, but the priors price plain
    # relative errors (random tokens' statistics weigh the columns unlike text does, and
    # weighting the candidates' errors by them misleads the allocation: `benchmarks/data_free.py`)
    moments = chooser.moments
    work = CandidatesWork(weights, opts.widths, opts.group_sizes,
                          replace(chooser, moments=None), weighted=opts.method != "weight",
                          threads=torch.get_num_threads() if moments else None)
    # read as they are submitted (the executor pulls jobs as tasks finish), not all at once
    jobs = (ModuleJob(quantizable[i], None if moments is None
                      else moments.get(quantizable[i].module)) for i in todo)
    bits, _ = probe_bits(opts)
    # each module's error sums remake the same chunks of rows: reused from the heap
    with StageProgress(enabled=progress) as bar, heap_served():
        task = bar.add_task("measuring", total=len(quantizable),
                            completed=len(quantizable) - len(todo))
        results = executor.map(candidates_job, jobs, work, cpus=work.threads or 1)
        for index, candidates in zip(todo, results, strict=True):
            spec = quantizable[index]
            entries[index] = module_entry(spec, candidates, opts, probe_kl, prior(spec))
            if spec.module in ratios:
                by_width = ratios[spec.module]
                entries[index]["gptq_ratio"] = by_width[bits]
                entries[index]["gptq_width_ratios"] = {str(b): r for b, r in by_width.items()}
            if partial is not None:  # a killed run starts again from here
                partial.write_json(f"m{index:06d}.json", entries[index])
            bar.advance(task)
    return [e for e in entries if e is not None]


def module_entry(spec: TensorSpec, cands: list[Candidate], opts: MeasureOptions,
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
