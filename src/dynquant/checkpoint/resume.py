"""Resumable quantization: each finished tensor is saved beside the output as it is done.

``.NAME.partial/`` holds ``job.json`` (a digest of everything that determines the result) and one
small safetensors file per finished tensor, each written atomically (temp file + rename). A run
killed at any point and restarted with the same arguments reuses those files and ends with
byte-identical output; different arguments discard them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dynquant.format.layout import tensor_names
from dynquant.format.safetensors_header import TensorInfo, byte_chunks, read_header
from dynquant.format.safetensors_writer import TORCH_DTYPES, PendingTensor, write_safetensors
from dynquant.numerics.quantizer import QuantizedTensor


class PartialDir:
    """``.NAME.partial/`` beside an output: what a job finished so far, kept only while the
    job (a digest of everything that determines the result) stays the same. Files in it are
    written atomically (temp file + rename)."""

    def __init__(self, out: str | Path, job: dict) -> None:
        self.dir = self.folder(out)
        self.job = job
        digest = hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()
        job_file = self.dir / "job.json"
        if self.dir.exists() and (not job_file.is_file()
                                  or json.loads(job_file.read_text()).get("digest") != digest):
            shutil.rmtree(self.dir)  # another job's leftovers: start afresh
        self.dir.mkdir(parents=True, exist_ok=True)
        if not job_file.is_file():
            job_file.write_text(json.dumps({"digest": digest, "job": job}, default=str))

    @staticmethod
    def folder(out: str | Path) -> Path:
        """The folder of ``out``'s partial results, whether or not it exists."""
        out = Path(out)
        return out.parent / f".{out.name}.partial"

    def write_json(self, name: str, doc: object) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.dir / name)

    def read_json(self, name: str) -> object | None:
        path = self.dir / name
        return json.loads(path.read_text()) if path.is_file() else None

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        tmp = self.dir / f".{name}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, self.dir / name)

    def read_tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        path = self.dir / name
        return load_file(str(path)) if path.is_file() else None

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)



class ResumeStore(PartialDir):
    """A quantization's finished tensors, one small safetensors file each."""

    def _path(self, index: int) -> Path:
        return self.dir / f"{index:06d}.safetensors"

    def inner(self, name: str) -> ResumeStore:
        """A store of its own inside this one (the same job; discarded with it): tensors a
        later step replaces, kept for a resumed run."""
        return ResumeStore(self.dir / name, self.job)

    def has(self, index: int) -> bool:
        return self._path(index).is_file()

    def done(self) -> int:
        return sum(1 for _ in self.dir.glob("*.safetensors"))

    def tensor(self, index: int, name: str) -> torch.Tensor:
        """Tensor ``name`` of finished tensor ``index``."""
        with safe_open(str(self._path(index)), framework="pt") as fh:
            return fh.get_tensor(name)

    def loader(self, index: int, name: str) -> Callable[[], Iterator[bytes]]:
        """The bytes of tensor ``name`` of finished tensor ``index``, when they are needed, in
        chunks (the checkpoint writer copies them; a 1 GB tensor is never held whole)."""
        path = str(self._path(index))
        return lambda: byte_chunks(read_header(path)[name])

    def load(self, index: int) -> tuple[str, str, object, object] | None:
        """What an earlier run finished for tensor ``index``, without reading its data:
        ('quantized', module, QuantizedTensor of meta tensors, loaders) or
        ('dense', name, meta tensor, loader); None if it is not finished."""
        path = self._path(index)
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads(fh.metadata()["dynquant"])
            shapes = {n: (fh.get_slice(n).get_dtype(), fh.get_slice(n).get_shape())
                      for n in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)

        def placeholder(n: str) -> torch.Tensor:
            dtype, shape = shapes[n]
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")

        if meta["kind"] == "dense":
            name = meta["name"]
            return "dense", name, placeholder(name), self.loader(index, name)
        names = tensor_names(meta["module"])
        qt = QuantizedTensor(*(placeholder(n) for n in names), tuple(meta["logical_shape"]),
                             meta["bits"], meta["group_size"], meta["clipped_fraction"],
                             meta["clip_improvement"])
        return "quantized", meta["module"], qt, {n: self.loader(index, n) for n in names}

    def quantized(self, index: int) -> QuantizedTensor | None:
        """Finished tensor ``index``'s codes, read (None unless it is finished and quantized)."""
        saved = self.load(index)
        if saved is None or saved[0] != "quantized":
            return None
        _, _, meta, loaders = saved
        q, s, o = (self.tensor(index, n) for n in loaders)
        return QuantizedTensor(q, s, o, meta.logical_shape, meta.bits, meta.group_size,
                               meta.clipped_fraction, meta.clip_improvement)

    def _save(self, index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        tmp = self.dir / f".{index:06d}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"dynquant": json.dumps(meta)})
        os.replace(tmp, self._path(index))

    def save_quantized(self, index: int, module: str, qt: QuantizedTensor) -> None:
        q, s, o = tensor_names(module)
        self._save(index, {q: qt.qweight, s: qt.scales, o: qt.offsets},
                   {"kind": "quantized", "module": module, "bits": qt.bits,
                    "group_size": qt.group_size, "logical_shape": list(qt.logical_shape),
                    "clipped_fraction": qt.clipped_fraction,
                    "clip_improvement": qt.clip_improvement})

    def save_dense(self, index: int, name: str, tensor: torch.Tensor) -> None:
        self._save(index, {name: tensor}, {"kind": "dense", "name": name})

    def save_dense_bytes(self, index: int, name: str, info: TensorInfo) -> None:
        """A dense tensor copied as stored from another safetensors file, a chunk at a time."""
        tmp = self.dir / f".{index:06d}.tmp"
        pending = PendingTensor(name, TORCH_DTYPES[info.dtype], info.shape,
                                lambda: byte_chunks(info))
        write_safetensors(tmp, [pending], {"dynquant": json.dumps({"kind": "dense",
                                                                    "name": name})})
        os.replace(tmp, self._path(index))
