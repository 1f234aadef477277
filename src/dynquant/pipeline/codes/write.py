"""Write a checkpoint from per-module widths: each tensor's codes (chosen by a ``CodeChooser``,
compensated block by block when it is sequential GPTQ) or its dense bytes, streamed one tensor at
a time through a resume store, then the checkpoint written atomically."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from dynquant.checkpoint.free_space import need_checkpoint_space
from dynquant.checkpoint.resume import ResumeStore
from dynquant.checkpoint.writer import SIDE_FILES, CheckpointWriter, dense_storage_dtype
from dynquant.format import metadata as md
from dynquant.format.layout import LayerLayout
from dynquant.format.planner import TensorSpec, WidthChoice, plan_document, split_choice
from dynquant.format.safetensors_header import TensorInfo
from dynquant.format.safetensors_writer import TORCH_DTYPES
from dynquant.models.sources import ModelSource
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.calibrate.block_stream import BlockStream
from dynquant.pipeline.calibrate.weights import WeightsAt, WeightSource
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.end_to_end import end_to_end_codes
from dynquant.pipeline.codes.sequential_gptq import sequential_gptq
from dynquant.pipeline.execute.executor import Executor, LocalExecutor
from dynquant.pipeline.execute.progress import StageProgress


def _progress(enabled: bool) -> StageProgress:
    return StageProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn(), enabled=enabled)


@dataclass(frozen=True)
class TensorJob:
    """One tensor of a quantization: stored dense (``bits`` None) or quantized."""

    index: int
    spec: TensorSpec
    bits: int | None = None
    group_size: int = 0


@dataclass
class QuantizeWork:
    """What every tensor job of a quantization shares (sent to a worker once)."""

    weights: WeightsAt
    chooser: CodeChooser


def quantize_job(job: TensorJob, work: QuantizeWork) -> QuantizedTensor | torch.Tensor:
    """The pure per-tensor work (run by an executor, here or on a worker): read the tensor,
    return its codes, or the tensor itself in its storage dtype."""
    tensor = work.weights.open().get(job.spec)
    if job.bits is None:
        return tensor.to(dense_storage_dtype(tensor.dtype))
    return work.chooser.quantize(job.spec, tensor, job.bits, job.group_size)


def quantize_model(
    source: ModelSource,
    widths: Mapping[str, WidthChoice],
    out: str | Path,
    *,
    group_size: int = 128,
    random_init: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    allocator: str = "manual",
    widths_from: str | None = None,
    modules_to_not_convert: tuple[str, ...] = (),
    importance: Mapping[str, torch.Tensor] | None = None,
    chooser: CodeChooser | None = None,
    stats: str | None = None,
    calibration: dict | None = None,
    extra_files: Sequence[Path] = (),
    progress: bool = True,
    on_tensor: Callable[[int], None] | None = None,
    executor: Executor | None = None,
) -> dict:
    """Quantize every quantizable tensor of ``source`` with ``widths``; returns the metadata.
    Codes by ``chooser`` (default: round-to-nearest weighted by ``importance``); the tensors
    the sequential pass does not compute run on ``executor`` (default: this process).
    ``on_tensor`` is told the index of each tensor this run puts in the resume store (progress
    hooks, and the test that kills a run at a chosen tensor)."""
    specs = source.tensor_specs()
    plan = plan_document(specs, widths, model=source.name, group_size=group_size,
                         tied=source.tied, modules_to_not_convert=modules_to_not_convert)
    qc = plan["quantization_config"]
    writer = CheckpointWriter(out, options=md.QuantizationOptions(
        group_size, qc["lm_head_quantized"], qc["modules_to_not_convert"]), overwrite=overwrite)
    chooser = chooser or CodeChooser(importance=importance or {})
    need_checkpoint_space(out, plan["accounting"]["total_nbytes"])
    store = ResumeStore(out, {"model": source.name, "widths": sorted(widths.items()),
                              "group_size": group_size,
                              "not_convert": sorted(modules_to_not_convert),
                              "random_init": random_init, "seed": seed,
                              "codes": chooser.digest(), "version": md.core_version()})
    executor = executor or LocalExecutor()
    # this process's source, the one the sequential pass and jobs run here use
    work = QuantizeWork(WeightsAt.of(source, random_init, seed),
                        replace(chooser, sequential=None, _cached=None))
    tuning = chooser.sequential.end_to_end if chooser.sequential is not None else None
    end_to_end = tuning is not None and tuning.steps > 0
    finals = None  # the float model's last block's outputs: the end-to-end pass's teacher's
    if chooser.sequential is not None:
        finals = _sequential(source, work.weights.open(), specs, plan, widths, group_size,
                             chooser, store, progress, executor)
        finals = finals if end_to_end else None
    jobs = [_job(index, spec, plan, widths, group_size) for index, spec in enumerate(specs)
            if not store.has(index)]
    with _progress(progress) as bar:
        task = bar.add_task("quantizing", total=len(specs), completed=len(specs) - len(jobs))

        def done(index: int) -> None:
            bar.advance(task)
            if on_tensor is not None:
                on_tensor(index)

        _fill_store(store, jobs, work, executor, done)
    if end_to_end:  # every tensor's codes are in the store
        assert tuning is not None and chooser.sequential is not None
        stream = BlockStream(source, work.weights.open(), chooser.sequential.ids, chunk=1)
        end_to_end_codes(stream, specs, set(plan["layers"]), store, tuning, progress,
                         finals=finals)
    executor.idle()  # writing the checkpoint needs no workers
    for index in range(len(specs)):  # the writer keeps a way to load each, not the data
        kind, name, value, load = store.load(index)
        (writer.add_quantized if kind == "quantized" else writer.add_dense)(name, value, load)
    side = [] if source.directory is None else [
        source.directory / f for f in SIDE_FILES if (source.directory / f).is_file()]
    provenance = md.Provenance(model=source.name, allocator=allocator, widths_from=widths_from,
                               stats=stats, predicted_nbytes=plan["accounting"]["total_nbytes"],
                               calibration=calibration,
                               quantizer=None if chooser.quantizer == "rtn" else chooser.quantizer,
                               float_targets=(chooser.sequential.float_targets or None)
                               if chooser.sequential is not None else None)
    doc = writer.finish(provenance, config=source.config.to_dict(), tied=source.tied,
                        side_files=[*side, *extra_files])
    store.discard()
    return doc


def _fill_store(store: ResumeStore, jobs: list[TensorJob], work: QuantizeWork,
                executor: Executor, done: Callable[[int], None]) -> None:
    """Every job's result into the store, in the jobs' order (``done`` told each index).
    Dense tensors stored as they will be written are copied here a chunk at a time; the rest
    run on ``executor``."""
    direct = {job.index: info for job in jobs if job.bits is None
              and (info := _copyable(work.weights.open(), job.spec)) is not None}
    computed = executor.map(quantize_job, [j for j in jobs if j.index not in direct], work,
                            job_nbytes)
    for job in jobs:
        if job.index in direct:
            store.save_dense_bytes(job.index, job.spec.name, direct[job.index])
        elif isinstance(result := next(computed), QuantizedTensor):
            store.save_quantized(job.index, job.spec.module, result)
        else:
            store.save_dense(job.index, job.spec.name, result)
        done(job.index)


def _copyable(weights: WeightSource, spec: TensorSpec) -> TensorInfo | None:
    """Where a dense tensor lies in the model's files, when it is stored in its checkpoint
    dtype already (bf16, narrower, or not a float)."""
    info = weights.stored_as_is(spec)
    if info is None:
        return None
    dtype = TORCH_DTYPES[info.dtype]
    return info if dense_storage_dtype(dtype) == dtype else None


def job_nbytes(job: TensorJob) -> int:
    """The bytes of a job's result (the executor's backpressure counts them)."""
    if job.bits is None:
        return math.prod(job.spec.shape) * 4  # at most float32
    return LayerLayout.create(job.spec.shape, job.bits, job.group_size).nbytes


def _job(index: int, spec: TensorSpec, plan: dict, widths: Mapping, group_size: int
         ) -> TensorJob:
    if spec.module not in plan["layers"]:
        return TensorJob(index, spec)
    return TensorJob(index, spec, *split_choice(widths[spec.module], group_size))


def _sequential(source: ModelSource, weights: WeightSource, specs: list, plan: dict,
                widths: Mapping, group_size: int, chooser: CodeChooser, store: ResumeStore,
                progress: bool, executor: Executor) -> list[torch.Tensor] | None:
    """The decoder blocks' tensors, compensated block by block into ``store``; the float
    model's last block's outputs where the pass ran the float model (``sequential_gptq``)."""
    assert chooser.sequential is not None
    stream = BlockStream(source, weights, chooser.sequential.ids, chunk=1,
                         dtype=resolve_dtype(chooser.sequential.dtype))
    return sequential_gptq(stream, specs, set(plan["layers"]),
                           lambda m: split_choice(widths[m], group_size), chooser.quantize,
                           store, progress, executor, chooser.sequential.tuning,
                           chooser.sequential.chain, chooser.sequential.float_targets)
