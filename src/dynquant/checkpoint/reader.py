"""Reading a dynquant-packed checkpoint lazily: validated metadata + memory-mapped tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from dynquant.errors import CheckpointError
from dynquant.format import metadata as md
from dynquant.format.layout import LayerLayout, tensor_names
from dynquant.format.safetensors_header import read_header
from dynquant.format.validate import load_metadata, read_checkpoint
from dynquant.numerics.quantizer import QuantizedTensor


class Checkpoint:
    """An open checkpoint. Tensors are read from memory-mapped safetensors only when asked for."""

    def __init__(self, path: str | Path, *, validate: bool = True) -> None:
        self.path = Path(path)
        if validate:  # the metadata and every header, read once for the checks and for us
            doc, tensors, problems = read_checkpoint(str(self.path))
            if problems:
                raise problems[0]
            self.metadata: dict = doc
            self._where = {name: os.path.relpath(info.file, self.path)
                           for name, info in tensors.items()}
        else:
            self.metadata = load_metadata(str(self.path / md.METADATA_FILE))
            self._where = {name: f for f in self.metadata["files"]
                           for name in read_header(os.path.join(self.path, f))}
        self.layers: dict[str, LayerLayout] = {
            name: LayerLayout.create(e["logical_shape"], e["bits"], e["group_size"], module=name)
            for name, e in self.metadata["layers"].items()
        }
        self._handles: dict[str, object] = {}

    @property
    def quantization_config(self) -> dict:
        return self.metadata["quantization_config"]

    @property
    def tied(self) -> dict[str, str]:
        return self.metadata["tied"]

    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def dense_names(self) -> list[str]:
        packed = {n for m in self.layers for n in tensor_names(m)}
        return [n for n in sorted(self._where) if n not in packed]

    def tensor(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError("no such tensor", file=str(self.path), module=name)
        if f not in self._handles:
            self._handles[f] = safe_open(str(self.path / f), framework="pt")
        return self._handles[f].get_tensor(name)

    def quantized(self, module: str) -> QuantizedTensor:
        if module not in self.layers:
            raise CheckpointError("not a quantized module", file=str(self.path), module=module)
        lay = self.layers[module]
        entry = self.metadata["layers"][module]
        q, s, o = (self.tensor(n) for n in tensor_names(module))
        return QuantizedTensor(q, s, o, lay.logical_shape, lay.bits, lay.group_size,
                               entry.get("clipped_fraction") or 0.0,
                               entry.get("clip_improvement") or 0.0)

    def dequantize(self, module: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The module's weight in its logical shape."""
        return self.quantized(module).dequantize(dtype)


def require_checkpoint(path: str | Path) -> None:
    """Raise, naming what is missing, unless ``path`` is a folder with a dynquant.json: what
    a command that first reads something else there (the tokenizer) checks before it."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError("no such checkpoint folder", file=str(path))
    if not (folder / md.METADATA_FILE).is_file():
        raise CheckpointError(f"not a dynquant checkpoint: no {md.METADATA_FILE} in the folder",
                              file=str(path))


def open_checkpoint(path: str | Path, *, validate: bool = True) -> Checkpoint:
    return Checkpoint(path, validate=validate)
