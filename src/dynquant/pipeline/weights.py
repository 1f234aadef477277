"""Where weights come from, one tensor at a time: a model directory's safetensors, or random init."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from dynquant.errors import ModelError
from dynquant.format.planner import TensorSpec
from dynquant.format.safetensors_header import read_header
from dynquant.models.disk_layout import DiskLayout


class WeightSource:
    """Gives tensors by name; never more than one tensor materialised at a time."""

    def get(self, spec: TensorSpec) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release open files."""


class RandomWeights(WeightSource):
    """i.i.d. Gaussian matrices (std ``std``) and unit norms, seeded per tensor name."""

    def __init__(self, seed: int = 0, std: float = 0.02) -> None:
        self.seed, self.std = seed, std

    def get(self, spec: TensorSpec) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.seed}:{spec.name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        if len(spec.shape) == 1:
            return torch.ones(spec.shape)
        return torch.randn(spec.shape, generator=gen) * self.std


class SafetensorsWeights(WeightSource):
    """Memory-mapped tensors of a model directory (one file or shards with an index)."""

    def __init__(self, directory: Path, transforms: list | None = None) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ModelError("no safetensors weights in the model directory",
                             file=str(directory))
        self._where = {name: f for f in files for name in read_header(str(directory / f))}
        self.layout = DiskLayout(sorted(self._where), transforms or [])
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def _read(self, stored: str) -> torch.Tensor:
        f = self._where[stored]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(
                safe_open(str(self.directory / f), framework="pt"))
        return self._handles[f].get_tensor(stored)

    def get(self, spec: TensorSpec) -> torch.Tensor:
        tensor = self.layout.assemble(spec.name, self._read)
        if tensor is None:
            raise ModelError("tensor missing from the model's safetensors",
                             file=str(self.directory), module=spec.name)
        if tuple(tensor.shape) != spec.shape:
            raise ModelError(f"shape {list(tensor.shape)} but the config gives {list(spec.shape)}",
                             file=str(self.directory), module=spec.name, field="shape")
        return tensor

    def close(self) -> None:
        self._stack.close()


def iter_tensors(source: WeightSource, specs: list[TensorSpec]) -> Iterator[tuple[TensorSpec,
                                                                                  torch.Tensor]]:
    for spec in specs:
        yield spec, source.get(spec)
