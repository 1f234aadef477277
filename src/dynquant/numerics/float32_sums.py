"""Products summed into float32 from bfloat16 inputs without widening them first.

A bfloat16 pass's activations are bf16, and their second moments X^T X must still be summed in
float32 (a bf16 result would round every partial sum). torch's CPU build has no bf16 x bf16 ->
float32 product (widened first, the inputs multiply at the float32 rate); MKL, which that build
carries, has one (``cblas_gemm_bf16bf16f32``: bf16 products summed in float32, on the CPU's
bf16 instructions where it has them). ``add_product`` uses it where torch carries it and
widens otherwise; ``add_product_ref`` is the plain product it is held to.

Measured (BENCHMARKS.md "Scale"): a 256-row X^T X at 18,944 inputs, 2 threads, Intel with
AMX: 191 GMAC/s widened, 640 with MKL's product.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@cache
def _mkl_gemm_bf16() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """MKL's bf16 -> float32 GEMM in the loaded torch, or None (a build without MKL)."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        gemm = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    gemm.restype = None
    gemm.argtypes = [i, i, i, i, i, i, ctypes.c_float, p, i, p, i, ctypes.c_float, p, i]
    return gemm


def _operand(t: torch.Tensor) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a row-major view of ``t``, or None if its rows and
    columns are both strided."""
    if t.stride(1) == 1 and t.stride(0) >= max(t.shape[1], 1):
        return _NO_TRANS, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(t.shape[0], 1):
        return _TRANS, t.stride(1)
    return None


def product_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``add_product`` multiplies it best: bf16 kept bf16 (contiguous, so that MKL's
    product takes its views), any other dtype widened to float32."""
    return x.contiguous() if x.dtype == torch.bfloat16 else x.float()


def add_product_ref(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``c += a @ b`` in float32, the inputs widened."""
    c.addmm_(a.float(), b.float())


def add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``c += a @ b``: ``c`` a contiguous float32 matrix, ``a`` and ``b`` float32 or bf16
    matrices (views with one unit stride each, e.g. column blocks of a transposed input). bf16
    inputs are multiplied as bf16 and summed in float32 where MKL can."""
    if a.dim() != 2 or b.dim() != 2 or c.shape != (a.shape[0], b.shape[1]) \
            or a.shape[1] != b.shape[0]:
        raise ValueError(f"add_product: shapes {tuple(c.shape)} += {tuple(a.shape)} @ "
                         f"{tuple(b.shape)}")
    gemm = _mkl_gemm_bf16() if a.dtype == b.dtype == torch.bfloat16 else None
    layout_a, layout_b = _operand(a), _operand(b)
    if (gemm is None or layout_a is None or layout_b is None or not c.is_contiguous()
            or c.dtype != torch.float32 or a.device.type != "cpu" or 0 in a.shape + b.shape):
        add_product_ref(c, a, b)
        return
    (m, k), n = a.shape, b.shape[1]
    gemm(_ROW_MAJOR, layout_a[0], layout_b[0], m, n, k, 1.0, a.data_ptr(), layout_a[1],
         b.data_ptr(), layout_b[1], 1.0, c.data_ptr(), max(n, 1))


__all__ = ["add_product", "add_product_ref", "product_input"]
