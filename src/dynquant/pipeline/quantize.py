"""Quantize a model with given widths: stream tensors, pack, and write the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dynquant.checkpoint.writer import SIDE_FILES, CheckpointWriter
from dynquant.errors import DynquantError
from dynquant.format import metadata as md
from dynquant.format.planner import WidthChoice, plan_document, split_choice
from dynquant.models.sources import ModelSource
from dynquant.numerics.quantizer import quantize_tensor
from dynquant.pipeline.weights import RandomWeights, SafetensorsWeights, WeightSource


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), disable=not enabled, transient=True)


def weight_source(source: ModelSource, random_init: bool, seed: int = 0) -> WeightSource:
    if random_init:
        return RandomWeights(seed, std=getattr(source.config, "initializer_range", 0.02))
    if source.directory is None:
        raise DynquantError("a preset has no weights: pass --random-init", file=source.name)
    return SafetensorsWeights(source.directory, source.conversion_transforms())


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
    lm_head_quantized: bool = False,
    modules_to_not_convert: tuple[str, ...] = (),
    progress: bool = True,
) -> dict:
    """Quantize every quantizable tensor of ``source`` with ``widths``; returns the metadata."""
    specs = source.tensor_specs(lm_head_quantized)
    plan = plan_document(specs, widths, model=source.name, group_size=group_size,
                         tied=source.tied, modules_to_not_convert=modules_to_not_convert,
                         lm_head_quantized=lm_head_quantized)
    writer = CheckpointWriter(out, options=md.QuantizationOptions(
        group_size, lm_head_quantized, plan["quantization_config"]["modules_to_not_convert"]),
        overwrite=overwrite)
    weights = weight_source(source, random_init, seed)
    try:
        with _progress(progress) as bar:
            task = bar.add_task("quantizing", total=len(specs))
            for spec in specs:
                tensor = weights.get(spec)
                if spec.module in plan["layers"]:
                    bits, gs = split_choice(widths[spec.module], group_size)
                    writer.add_quantized(spec.module, quantize_tensor(tensor, bits, gs))
                else:
                    writer.add_dense(spec.name, tensor)
                del tensor
                bar.advance(task)
    finally:
        weights.close()
    side = [] if source.directory is None else [
        source.directory / f for f in SIDE_FILES if (source.directory / f).is_file()]
    provenance = md.Provenance(model=source.name, allocator=allocator, widths_from=widths_from,
                               predicted_nbytes=plan["accounting"]["total_nbytes"])
    return writer.finish(provenance, config=source.config.to_dict(), tied=source.tied,
                         side_files=side)
