"""Where weights come from, one tensor at a time: a model directory's safetensors, random init,
or a dynquant checkpoint's dequantized codes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynquant.checkpoint.reader import Checkpoint
from dynquant.errors import ModelError
from dynquant.format.planner import TensorSpec
from dynquant.format.safetensors_header import TensorInfo, read_header
from dynquant.format.safetensors_writer import TORCH_DTYPES
from dynquant.models.disk_layout import DiskLayout
from dynquant.models.sources import ModelSource
from dynquant.numerics.quantizer import dequantize_rows


class WeightSource:
    """Gives tensors by name; never more than one tensor materialised at a time."""

    def get(self, spec: TensorSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor of ``spec``, in its stored dtype or converted to ``dtype``."""
        raise NotImplementedError

    def get_rows(self, spec: TensorSpec, rows: torch.Tensor, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """Rows ``rows`` of the 2-D tensor of ``spec`` (what an embedding lookup needs)."""
        return self.get(spec, dtype)[rows]

    def stored_as_is(self, spec: TensorSpec) -> TensorInfo | None:
        """Where the tensor of ``spec`` lies in a file, when it is stored there as is (one
        stored tensor of its shape): its bytes can be copied without reading it whole."""
        return None

    def close(self) -> None:
        """Release open files."""


RANDOM_CHUNK = 1 << 22  # weights drawn from one generator: the unit of parallel random init


class RandomWeights(WeightSource):
    """i.i.d. Gaussian matrices (std ``std``) and unit norms, seeded per tensor name and chunk of
    rows, so that chunks are drawn on all of torch's threads and the values do not depend on
    their number (torch's generator draws on one thread)."""

    def __init__(self, seed: int = 0, std: float = 0.02) -> None:
        self.seed, self.std = seed, std

    def get(self, spec: TensorSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        if len(spec.shape) == 1:
            return torch.ones(spec.shape, dtype=dtype)
        out = torch.empty(spec.shape, dtype=torch.float32)
        rows = out.view(-1, spec.shape[-1])
        step = max(1, RANDOM_CHUNK // spec.shape[-1])

        def draw(start: int) -> None:
            key = f"{self.seed}:{spec.name}" + (f":{start}" if start else "")
            digest = hashlib.sha256(key.encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            chunk = rows[start : start + step]
            chunk.normal_(0.0, self.std, generator=gen)

        starts = range(0, rows.shape[0], step)
        if len(starts) == 1:
            draw(0)
        else:
            with ThreadPoolExecutor(torch.get_num_threads()) as pool:
                list(pool.map(draw, starts))
        return out if dtype in (None, torch.float32) else out.to(dtype)


READ_CHUNK = 16 << 20  # bytes read and converted at once


class SafetensorsWeights(WeightSource):
    """The tensors of a model directory (one file or shards with an index), one at a time."""

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
        self._info = {name: info for f in files
                      for name, info in read_header(str(directory / f)).items()}
        self.layout = DiskLayout(sorted(self._info), transforms or [])

    def _read(self, stored: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, read with a positioned read rather than through a memory map: mapped
        pages would stay resident (and count in RSS) for the whole run; these are freed as soon
        as the tensor is. Converted to ``dtype`` a slice at a time when asked (never the whole
        tensor twice in memory)."""
        info = self._info[stored]
        if info.dtype not in TORCH_DTYPES:
            raise ModelError(f"unsupported dtype {info.dtype}", file=info.file, module=stored,
                             field="dtype")
        if dtype is not None and dtype != TORCH_DTYPES[info.dtype]:
            return self._read_converted(stored, dtype)
        buf = bytearray(info.nbytes)
        with open(info.file, "rb") as fh:
            fh.seek(info.start)
            if fh.readinto(buf) != info.nbytes:
                raise ModelError("file ends before the tensor does", file=info.file,
                                 module=stored)
        if not buf:
            return torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def _read_converted(self, stored: str, dtype: torch.dtype) -> torch.Tensor:
        info = self._info[stored]
        source = TORCH_DTYPES[info.dtype]
        out = torch.empty(info.shape, dtype=dtype)
        flat, item = out.view(-1), source.itemsize
        step = max(1, READ_CHUNK // item)
        with open(info.file, "rb") as fh:
            fh.seek(info.start)
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                buf = bytearray(n * item)
                if fh.readinto(buf) != len(buf):
                    raise ModelError("file ends before the tensor does", file=info.file,
                                     module=stored)
                flat[i : i + n] = torch.frombuffer(buf, dtype=source)
        return out

    def stored_as_is(self, spec: TensorSpec) -> TensorInfo | None:
        stored = self.layout.direct.get(spec.name)
        info = None if stored is None else self._info[stored]
        if info is None or info.dtype not in TORCH_DTYPES or tuple(info.shape) != spec.shape:
            return None
        return info

    def get_rows(self, spec: TensorSpec, rows: torch.Tensor, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """Only the asked rows read from the file (a 128k-token embedding is 1-2 GB; a
        calibration run looks up a few thousand of its rows), when the tensor is stored as is."""
        info = self.stored_as_is(spec)
        if info is None or len(info.shape) != 2:
            return super().get_rows(spec, rows, dtype)
        stored = info.name
        source = TORCH_DTYPES[info.dtype]
        row_bytes = info.shape[1] * source.itemsize
        out = torch.empty(len(rows), info.shape[1], dtype=source)
        with open(info.file, "rb") as fh:
            for i, r in enumerate(rows.tolist()):
                if not 0 <= r < info.shape[0]:
                    raise ModelError(f"row {r} outside [0, {info.shape[0]})", file=info.file,
                                     module=stored)
                fh.seek(info.start + r * row_bytes)
                buf = bytearray(row_bytes)
                if fh.readinto(buf) != row_bytes:
                    raise ModelError("file ends before the tensor does", file=info.file,
                                     module=stored)
                out[i] = torch.frombuffer(buf, dtype=source)
        return out if dtype is None else out.to(dtype)

    def get(self, spec: TensorSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.layout.assemble(spec.name, lambda stored: self._read(stored, dtype))
        if tensor is None:
            raise ModelError("tensor missing from the model's safetensors",
                             file=str(self.directory), module=spec.name)
        if tuple(tensor.shape) != spec.shape:
            raise ModelError(f"shape {list(tensor.shape)} but the config gives {list(spec.shape)}",
                             file=str(self.directory), module=spec.name, field="shape")
        return tensor


class CheckpointWeights(WeightSource):
    """The weights a dynquant checkpoint holds, by the model's parameter names: a quantized
    module's dequantized from its codes, a dense tensor as stored (the model run by a block
    stream as ``load_dequantized`` would build it, one tensor at a time)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    def get(self, spec: TensorSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        ck = self.checkpoint
        module = spec.name if spec.name in ck.layers else spec.module
        if module in ck.layers:
            tensor = ck.dequantize(module, dtype or torch.float32)
        else:
            tensor = ck.tensor(spec.name)
            tensor = tensor if dtype is None else tensor.to(dtype)
        if tuple(tensor.shape) != spec.shape:
            raise ModelError(f"shape {list(tensor.shape)} but the config gives {list(spec.shape)}",
                             file=str(ck.path), module=spec.name, field="shape")
        return tensor

    def get_rows(self, spec: TensorSpec, rows: torch.Tensor, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """Only the asked rows of a quantized table dequantized (a calibration run looks up a
        few thousand rows of a 128k-row embedding: 4 GB in float32 at 70 B)."""
        if spec.module not in self.checkpoint.layers or len(spec.shape) != 2:
            return super().get_rows(spec, rows, dtype)
        qt = self.checkpoint.quantized(spec.module)
        return dequantize_rows(qt.qweight[rows], qt.scales[rows], qt.offsets[rows], qt.bits,
                               qt.group_size, spec.shape[1], dtype or torch.float32)


def weight_source(source: ModelSource, random_init: bool, seed: int = 0) -> WeightSource:
    if random_init:
        return RandomWeights(seed, std=getattr(source.config, "initializer_range", 0.02))
    if source.directory is None:
        raise ModelError("a preset has no weights: pass --random-init", file=source.name)
    return SafetensorsWeights(source.directory, source.conversion_transforms())


@dataclass(frozen=True)
class WeightsAt:
    """Where a run's weights come from, small enough to send to a worker process, which opens
    it itself (once per process: ``open``)."""

    source: ModelSource = field(compare=False)
    random_init: bool = False
    seed: int = 0
    key: tuple = ()

    @classmethod
    def of(cls, source: ModelSource, random_init: bool, seed: int = 0) -> WeightsAt:
        # the files' sizes and times in the key: a folder written again is opened again
        files = () if source.directory is None else tuple(sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in source.directory.glob("*.safetensors*")))
        return cls(source, random_init, seed,
                   (source.name, str(source.directory), files, random_init, seed))

    def open(self) -> WeightSource:
        """This process's ``WeightSource`` for it (opened once: a safetensors folder's headers
        and the model's conversion transforms are read on first use)."""
        if self.key not in _OPENED:
            if len(_OPENED) >= 4:
                _OPENED.pop(next(iter(_OPENED))).close()
            _OPENED[self.key] = weight_source(self.source, self.random_init, self.seed)
        return _OPENED[self.key]


_OPENED: dict[tuple, WeightSource] = {}


def iter_tensors(source: WeightSource, specs: list[TensorSpec]) -> Iterator[tuple[TensorSpec,
                                                                                  torch.Tensor]]:
    for spec in specs:
        yield spec, source.get(spec)
