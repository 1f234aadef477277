"""Writing a dynquant-packed checkpoint directory, atomically and byte-reproducibly.

Layout: ``dynquant.json`` (the metadata), ``config.json`` (the source config with
``quantization_config``), ``model.safetensors`` (or shards, all listed in ``files``), and any
tokenizer / generation files copied from the source.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from dynquant.checkpoint.atomic import fsync_file, make_temp_dir, publish_dir
from dynquant.errors import CheckpointError
from dynquant.format import metadata as md
from dynquant.format.jsonstyle import dumps
from dynquant.format.layout import tensor_names
from dynquant.format.safetensors_writer import PendingTensor, write_safetensors
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor

# Copied from the source model when present, so the checkpoint runs without the source.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
)


def dense_storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dense tensors are stored in bf16 unless their source dtype is narrower or not a float."""
    if dtype.is_floating_point and torch.finfo(dtype).bits > 16:
        return torch.bfloat16
    return dtype


def _shard(names: list[str], sizes: Mapping[str, int], max_bytes: int | None) -> list[list[str]]:
    if not max_bytes:
        return [names]
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


class CheckpointWriter:
    """Collects packed modules and dense tensors, then writes the checkpoint in one atomic step.

    A tensor is held in memory, or, when it was already saved elsewhere (the resume store),
    only as a way to load it again: then the writer's memory stays small whatever the model's
    size, and the final files are streamed one tensor at a time.
    """

    def __init__(self, out_dir: str | Path, *, options: md.QuantizationOptions | None = None,
                 overwrite: bool = False, max_shard_bytes: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.options = options or md.QuantizationOptions()
        self.overwrite = overwrite
        self.max_shard_bytes = max_shard_bytes
        self.layers: dict[str, dict] = {}
        self.tensors: dict[str, PendingTensor] = {}

    def _put(self, name: str, tensor: torch.Tensor, load: Callable[[], torch.Tensor] | None
             ) -> None:
        if name in self.tensors:
            raise CheckpointError("tensor added twice", file=str(self.out_dir), module=name)
        if load is None:
            held = tensor.detach().contiguous()
            load = lambda: held  # noqa: E731
        self.tensors[name] = PendingTensor(name, tensor.dtype, tuple(tensor.shape), load)

    def add_quantized(self, name: str, qt: QuantizedTensor,
                      loaders: Mapping[str, Callable[[], torch.Tensor]] | None = None) -> None:
        """Add a packed module; ``loaders`` (tensor name -> load) avoid holding its tensors."""
        for tname, tensor in zip(tensor_names(name), (qt.qweight, qt.scales, qt.offsets),
                                 strict=True):
            self._put(tname, tensor, None if loaders is None else loaders[tname])
        self.layers[name] = qt.layer_entry()

    def add_dense(self, name: str, tensor: torch.Tensor,
                  load: Callable[[], torch.Tensor] | None = None) -> None:
        stored = tensor.to(dense_storage_dtype(tensor.dtype))
        self._put(name, stored, load)

    def dense_nbytes(self) -> int:
        packed = {n for m in self.layers for n in tensor_names(m)}
        return sum(t.nbytes for n, t in self.tensors.items() if n not in packed)

    def _files(self) -> list[list[str]]:
        sizes = {n: t.nbytes for n, t in self.tensors.items()}
        return _shard(sorted(self.tensors), sizes, self.max_shard_bytes)

    def finish(self, provenance: md.Provenance, *, config: Mapping | None = None,
               tied: Mapping[str, str] | None = None, side_files: Iterable[Path] = ()) -> dict:
        """Write everything into a temp dir and rename it into place; returns the metadata."""
        shards = self._files()
        if len(shards) == 1:
            files = list(md.DEFAULT_FILES)
        else:
            files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                     for i in range(len(shards))]
        doc = md.build_document(self.layers, dense_nbytes=self.dense_nbytes(),
                                options=self.options, provenance=provenance, tied=tied,
                                files=files)
        predicted = provenance.predicted_nbytes
        if predicted is not None and predicted != doc["accounting"]["total_nbytes"]:
            # The planner is exact: a difference is a bug, and nothing is written.
            raise CheckpointError(
                f"achieved total_nbytes {doc['accounting']['total_nbytes']} != predicted "
                f"{predicted}", file=str(self.out_dir), field="predicted_nbytes")
        tmp = make_temp_dir(self.out_dir)
        try:
            self._write_tensors(tmp, files, shards)
            cfg = dict(config or {})
            cfg["quantization_config"] = doc["quantization_config"]
            (tmp / md.CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            for src in side_files:
                shutil.copyfile(src, tmp / Path(src).name)
            # dynquant.json last: a temp dir without it never looks like a checkpoint.
            (tmp / md.METADATA_FILE).write_text(dumps(doc))
            fsync_file(tmp / md.METADATA_FILE)
            publish_dir(tmp, self.out_dir, self.overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return doc

    def _write_tensors(self, tmp: Path, files: list[str], shards: list[list[str]]) -> None:
        for fname, names in zip(files, shards, strict=True):
            write_safetensors(tmp / fname, [self.tensors[n] for n in names],
                              metadata={"format": "pt"})
            fsync_file(tmp / fname)
        if len(files) > 1:
            weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
            index = {"metadata": {"total_size": sum(t.nbytes for t in self.tensors.values())},
                     "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n")




def write_checkpoint(
    out_dir: str | Path,
    modules: Mapping[str, tuple[torch.Tensor, int]],
    dense: Mapping[str, torch.Tensor],
    *,
    group_size: int = 128,
    clip: bool = True,
    provenance: md.Provenance | None = None,
    config: Mapping | None = None,
    tied: Mapping[str, str] | None = None,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> dict:
    """Quantize ``modules`` (name -> (weight, bits)) and write them with ``dense`` tensors."""
    writer = CheckpointWriter(out_dir, options=md.QuantizationOptions(group_size=group_size),
                              overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    for name in sorted(modules):
        weight, bits = modules[name]
        writer.add_quantized(name, quantize_tensor(weight, bits, group_size, clip=clip))
    for name in sorted(dense):
        writer.add_dense(name, dense[name])
    return writer.finish(provenance or md.Provenance(model="<memory>"), config=config, tied=tied)
