"""``y = x @ W^T`` straight from a packed weight, for a few tokens at a time (decode).

The native kernel (``native/packed_matvec.c``) reads the packed codes and never materialises W: a
step of decode reads ``bits/16`` of the bytes a bf16 matrix would. It accumulates in float32, so
it is closer to the exact product than dequantizing to bf16 first. ``packed_matvec_ref`` is the
plain definition the kernel is held to. Beyond ``MAX_TOKENS`` tokens (prefill) dequantizing a
block and calling the BLAS matmul is faster, and callers do that instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynquant.format.layout import LayerLayout
from dynquant.numerics import native
from dynquant.numerics.quantizer import dequantize_rows

MAX_TOKENS = 8
# Below this many weights a product runs on one thread (a thread hand-off costs ~50 us).
PARALLEL_MIN_ELEMENTS = 1 << 20


def packed_matvec_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      offsets: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """float32 [m, rows]: ``x`` [m, in_features] times the dequantized float32 rows."""
    w = dequantize_rows(qweight, scales, offsets, layout.bits, layout.group_size,
                        layout.in_features, torch.float32)
    return x.to(torch.float32) @ w.T


def packed_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                  ) -> torch.Tensor | None:
    """float32 [m, rows] from the native kernel, or None when it is unavailable.

    ``x`` [m, in_features]; ``qweight``/``scales``/``offsets`` are any block of the layout's rows.
    ``portable`` forces the kernel's portable path (to hold the SIMD path to it).
    """
    lib = native.library()
    if lib is None:
        return None
    rows, pad = qweight.shape[0], layout.padded_in_features - layout.in_features
    xf = x.to(torch.float32)
    xf = (F.pad(xf, (0, pad)) if pad else xf).contiguous()
    qweight, scales, offsets = qweight.contiguous(), scales.contiguous(), offsets.contiguous()
    y = torch.empty(xf.shape[0], rows)

    def run(lo: int, hi: int) -> int:
        return lib.dq_matvec(qweight[lo].data_ptr(), scales[lo].data_ptr(), offsets[lo].data_ptr(),
                             hi - lo, layout.padded_in_features, layout.group_size, layout.bits,
                             xf.data_ptr(), xf.shape[0], y[0, lo].data_ptr(), rows, int(portable))

    if any(native.split_rows(run, rows, rows * layout.padded_in_features, PARALLEL_MIN_ELEMENTS)):
        raise RuntimeError("dq_matvec failed (out of memory or unsupported group size)")
    return y


def has_simd_path() -> bool:
    """Whether the kernel was built with its AVX-512 VBMI path (else it runs the portable one)."""
    lib = native.library()
    return lib is not None and bool(lib.dq_matvec_has_simd())


__all__ = ["MAX_TOKENS", "has_simd_path", "packed_matvec", "packed_matvec_ref"]
