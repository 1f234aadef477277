"""Writing a safetensors file one tensor at a time (the file never exists twice in memory).

Tensors are laid out largest itemsize first, then by name, so every tensor starts at an offset
aligned to its own itemsize (the header is padded with spaces to a multiple of 8, as the spec
allows). Deterministic: the same tensors always give the same bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: its name, dtype and shape now, its data when ``load`` is called (a
    tensor, or its bytes as stored in chunks: copied without holding the tensor whole)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor | Iterable[bytes]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_safetensors(path: Path, tensors: Sequence[PendingTensor], metadata: dict[str, str]
                      ) -> None:
    order = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in order:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for t in order:
            data = t.load()
            if not isinstance(data, torch.Tensor):
                written = sum(fh.write(chunk) for chunk in data)
                if written != t.nbytes:
                    raise ValueError(f"{t.name}: expected {t.nbytes} bytes, got {written}")
                continue
            if data.dtype != t.dtype or tuple(data.shape) != t.shape:
                raise ValueError(f"{t.name}: expected {t.dtype} {list(t.shape)}, got "
                                 f"{data.dtype} {list(data.shape)}")
            if t.nbytes:
                fh.write(data.contiguous().reshape(-1).view(torch.uint8).numpy().data)
