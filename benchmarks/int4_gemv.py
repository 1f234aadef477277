"""Packed GEMV at 4096 x 4096 vs a dense bf16 GEMV: the 4-bit QuantLinear (torch's CPU int4
kernel), the packed matvec kernel at 2, 3, 4 and 8 bits, and the dequantize-then-GEMV path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import best_time, figure, machine
from dynquant import quantize_tensor
from dynquant.format.layout import LayerLayout
from dynquant.numerics.packed_matvec import MAX_TOKENS, packed_matvec
from dynquant.runtime.packed_modules import QuantLinear


def main(n: int = 4096) -> None:
    print(f"# int4 GEMV, {n} x {n}, {machine()}")
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    qt = quantize_tensor(w, 4)
    lin = QuantLinear(LayerLayout.create((n, n), 4, 128))
    lin.qweight, lin.scales, lin.offsets = qt.qweight, qt.scales, qt.offsets
    dense = qt.dequantize(torch.bfloat16)
    deq = QuantLinear(LayerLayout.create((n, n), 4, 128), use_int4=False)
    deq.qweight, deq.scales, deq.offsets = qt.qweight, qt.scales, qt.offsets
    lin.prepare()
    x = torch.randn(1, n).to(torch.bfloat16)
    rows = torch.randn(MAX_TOKENS + 1, n).to(torch.bfloat16)  # past the matvec: row blocks
    with torch.no_grad():
        t_dense = best_time(lambda: F.linear(x, dense), repeat=50)
        t_int4 = best_time(lambda: lin(x), repeat=50)
        t_deq = best_time(lambda: deq(rows), repeat=5)
        t_dense_rows = best_time(lambda: F.linear(rows, dense), repeat=5)
    figure("dense bf16 GEMV", t_dense * 1e3, "ms")
    figure("int4 kernel GEMV", t_int4 * 1e3, "ms")
    figure(f"dequantize-then-GEMM ({MAX_TOKENS + 1} tokens, the prefill path)", t_deq * 1e3, "ms")
    figure(f"dense bf16 GEMM ({MAX_TOKENS + 1} tokens)", t_dense_rows * 1e3, "ms")
    figure("int4 speed-up vs dense bf16", t_dense / t_int4, "x")
    for bits in (2, 3, 4, 8):
        qb = quantize_tensor(w, bits)
        t_mv = best_time(lambda q=qb: packed_matvec(x, q.qweight, q.scales, q.offsets, q.layout),
                         repeat=50)
        figure(f"packed matvec {bits}-bit GEMV", t_mv * 1e3, "ms")
        figure(f"packed matvec {bits}-bit speed vs dense bf16", t_dense / t_mv, "x")
        figure(f"packed matvec {bits}-bit speed vs dequantize-then-GEMV", t_deq / t_mv, "x")


if __name__ == "__main__":
    main()
