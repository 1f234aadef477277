"""Reading and checking a safetensors file's header without torch (and without reading the data).

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON header, then the
data. Every tensor's ``data_offsets`` must lie inside the data and match its dtype and shape; a
file cut short is caught here, before any tensor is mapped.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dynquant.errors import CheckpointError

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def _tensor_info(path: str, name: str, spec: object, data_start: int, data_len: int) -> TensorInfo:
    def bad(msg: str, fld: str) -> CheckpointError:
        return CheckpointError(msg, file=path, module=name, field=fld)

    if not isinstance(spec, dict):
        raise bad("tensor entry is not an object", "header")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise bad(f"unknown dtype {dtype!r}", "dtype")
    if not isinstance(shape, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
    ):
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}", "shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"bad data_offsets {offsets!r}", "data_offsets")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets span {offsets[1] - offsets[0]} bytes, shape needs {nbytes}",
                  "data_offsets")
    if offsets[1] > data_len:
        raise bad(f"data ends at byte {offsets[1]} but the file holds {data_len} data bytes "
                  "(truncated file?)", "data_offsets")
    return TensorInfo(path, name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file, checked against the file's size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError("file shorter than a safetensors header", file=path,
                                      field="header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"header length {n} exceeds the file ({size} bytes)",
                                      file=path, field="header")
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", file=path) from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"header is not JSON ({exc})", file=path, field="header") from exc
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", file=path, field="header")
    data_start = 8 + n
    return {
        name: _tensor_info(path, name, spec, data_start, size - data_start)
        for name, spec in sorted(header.items())
        if name != "__metadata__"
    }


def bf16_nonfinite_count(info: TensorInfo) -> int:
    """How many values of a BF16 tensor are NaN or Inf (exponent bits all ones), via numpy."""
    if info.nbytes == 0:
        return 0
    bits = np.memmap(info.file, dtype="<u2", mode="r", offset=info.start, shape=(info.nbytes // 2,))
    return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))


CHUNK_BYTES = 16 << 20  # read and written at once when a tensor's bytes are copied


def byte_chunks(info: TensorInfo, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """A tensor's data as stored, ``chunk`` bytes at a time (copied, never held whole)."""
    with open(info.file, "rb") as fh:
        fh.seek(info.start)
        left = info.nbytes
        while left:
            data = fh.read(min(chunk, left))
            if not data:
                raise CheckpointError("file ends before the tensor does", file=info.file,
                                      module=info.name)
            left -= len(data)
            yield data
