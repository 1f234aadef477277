"""The Python side of the row kernels: quantize rows (``native/quantize_rows.c``) and dequantize
rows (``native/dequantize_rows.c``). Both answer None when the native library is unavailable;
their callers (``quantizer.py``) then run the torch paths, which compute the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynquant.numerics import native

# Below this many values a quantization is not split across threads (a hand-off costs more).
PARALLEL_MIN_ELEMENTS = 1 << 15


@dataclass
class RowsResult:
    """What the kernel writes for a block of rows."""

    qweight: torch.Tensor  # int32 [rows, groups * words_per_group], packed as format/packing.py
    scales: torch.Tensor  # bfloat16 [rows, groups]
    offsets: torch.Tensor  # bfloat16 [rows, groups]
    chosen: torch.Tensor  # uint8 [rows, groups]: index of the chosen alpha
    chosen_error: torch.Tensor  # float32 [rows, groups]
    first_error: torch.Tensor  # float32 [rows, groups]: error of alphas[0]


def quantize_rows(w: torch.Tensor, bits: int, group_size: int, alphas: torch.Tensor,
                  importance: torch.Tensor | None) -> RowsResult | None:
    """Run the kernel on rows ``w`` [rows, n] (float32 or bfloat16); None if it is unavailable.

    Raises ValueError if ``w`` holds a non-finite value. Large blocks are split by rows across
    ``torch.get_num_threads()`` threads (ctypes releases the GIL during the call); the calling
    thread takes the first part.
    """
    lib = native.library()
    if lib is None or w.dtype not in native.INPUT_DTYPES or group_size > native.MAX_GROUP_SIZE:
        return None
    w = w.contiguous()
    rows, n = w.shape
    groups = -(-n // group_size)
    res = RowsResult(torch.empty(rows, groups * bits * group_size // 32, dtype=torch.int32),
                     *(torch.empty(rows, groups, dtype=torch.bfloat16) for _ in range(2)),
                     torch.empty(rows, groups, dtype=torch.uint8),
                     *(torch.empty(rows, groups) for _ in range(2)))
    imp = None if importance is None else importance.to(torch.float32).contiguous()
    outs = (res.qweight, res.scales, res.offsets, res.chosen, res.chosen_error, res.first_error)

    def run(lo: int, hi: int) -> int:
        return lib.dq_quantize_rows(
            native.row_ptr(w, lo), native.INPUT_DTYPES[w.dtype], hi - lo, n, group_size, bits,
            alphas.data_ptr(), alphas.numel(), None if imp is None else imp.data_ptr(),
            *(native.row_ptr(t, lo) for t in outs))

    if any(native.split_rows(run, rows, w.numel(), PARALLEL_MIN_ELEMENTS)):
        raise ValueError("non-finite value")
    return res


# Below this many values a dequantization runs on one thread. On the native pool (a part reaches a
# waiting worker within a microsecond, a sleeping one in tens of µs) splitting pays from ~256 K
# values: a prefill dequantizes block after block, so the worker is awake.
DEQUANT_PARALLEL_MIN_ELEMENTS = 1 << 18


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                    group_size: int, in_features: int, dtype: torch.dtype,
                    portable: bool = False, out: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
    """[rows, in_features] in ``dtype`` (float32 or bfloat16), bit-identical to the torch path of
    ``quantizer.dequantize_rows``; None when the kernel is unavailable or the dtype is another.
    ``out`` (contiguous, that shape and dtype) is written instead of a new tensor: a fresh
    large tensor costs more in page faults than the kernel takes to fill it."""
    lib = native.library()
    if lib is None or dtype not in native.INPUT_DTYPES or group_size > native.MAX_GROUP_SIZE:
        return None
    native.check_packed_block(qweight, scales, offsets, bits, group_size, in_features)
    qweight, scales, offsets = qweight.contiguous(), scales.contiguous(), offsets.contiguous()
    rows = scales.shape[0]
    if out is None:
        out = torch.empty(rows, in_features, dtype=dtype)
    elif out.shape != (rows, in_features) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} [{rows}, {in_features}] tensor")
    if rows == 0:
        return out

    rc = lib.dq_dequantize_rows_mt(
        qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), rows, in_features, group_size,
        bits, out.data_ptr(), native.INPUT_DTYPES[dtype], int(portable),
        native.threads_for(out.numel(), DEQUANT_PARALLEL_MIN_ELEMENTS))
    if rc:
        raise RuntimeError("dq_dequantize_rows failed (unsupported group size)")
    return out


__all__ = ["RowsResult", "dequantize_rows", "quantize_rows"]
