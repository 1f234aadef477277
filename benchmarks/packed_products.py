"""Packed products at 4096 x 4096 in float32 against torch's dense float32 products, on this
machine's own kernel build, or as on an AVX2-only CPU (``--as-avx2``: the kernels built for
x86-64-v3 and torch's own kernels capped at AVX2 through ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA
and MKL_ENABLE_INSTRUCTIONS; the nearest this AVX-512 machine gets to a real AVX2 part).

- one token: the packed matvec at 2/3/4/8 bits vs the dense float32 GEMV (target >= 2x);
- 9, 64 and 512 tokens: the packed GEMM vs the dense float32 GEMM (target >= 1x);
- beside them: torch's int4 kernel with bf16 and float32 activations, and dense bf16;
- hand-off: the one-token matvec on 1 and 2 threads at 64 K - 4 M weights, each call after
  60 us of other work (as in a decode step, where the pool's worker has gone to sleep) and
  back to back: where splitting a decode product pays (``PARALLEL_MIN_ELEMENTS``);
- from memory: one-token products over 16 distinct 4096 x 4096 matrices (far past the caches, as
  in a real model's decode step), packed 3/8-bit on 1 and 2 threads vs dense bf16 and float32,
  in G weights/s, against the same products on one matrix that stays in cache.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import best_time, figure, machine, rerun_as_avx2
from dynquant import quantize_tensor
from dynquant.numerics import native
from dynquant.numerics.packed_matvec import (
    OneTokenMatvec,
    packed_gemm,
    packed_matvec,
    simd_path,
)
from dynquant.runtime.int4_cpu import pack_int4


def main(n: int = 4096) -> None:
    if "--as-avx2" in sys.argv:
        rerun_as_avx2("benchmarks.packed_products", [])
    print(f"# packed products, {n} x {n}, float32, kernels: {simd_path()}, {machine()}")
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=g)
    quantized = {bits: quantize_tensor(w, bits) for bits in (2, 3, 4, 8)}
    dense = quantized[3].dequantize(torch.float32)
    x1 = torch.randn(1, n, generator=g)
    t_gemv = best_time(lambda: F.linear(x1, dense), repeat=30)
    figure("dense float32 GEMV", t_gemv * 1e3, "ms")
    best = dict.fromkeys(quantized, float("inf"))
    for _ in range(3):  # the widths take turns: the first one measured alone ran 0.62-1.06 ms
        for bits, q in quantized.items():
            best[bits] = min(best[bits], best_time(
                lambda q=q: packed_matvec(x1, q.qweight, q.scales, q.offsets, q.layout),
                repeat=10))
    for bits, t in best.items():
        figure(f"packed matvec {bits}-bit", t * 1e3, "ms")
        figure(f"packed matvec {bits}-bit speed vs dense float32 GEMV", t_gemv / t, "x")
    q = quantized[3]
    for m in (9, 64, 512):
        x = torch.randn(m, n, generator=g)
        t_dense = best_time(lambda x=x: F.linear(x, dense), repeat=5)
        t = best_time(lambda x=x: packed_gemm(x, q.qweight, q.scales, q.offsets, q.layout),
                      repeat=5)
        figure(f"{m} tokens: dense float32 GEMM", t_dense * 1e3, "ms")
        figure(f"{m} tokens: packed GEMM 3-bit", t * 1e3, "ms")
        figure(f"{m} tokens: packed GEMM speed vs dense float32", t_dense / t, "x")
    q4 = quantized[4]
    packed, scale_zero = pack_int4(q4.qweight, q4.scales, q4.offsets)
    for dtype in (torch.bfloat16, torch.float32):
        x = x1.to(dtype)
        sz = scale_zero.to(dtype)
        t = best_time(lambda x=x, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, 128, sz), repeat=10)
        figure(f"torch int4 kernel, {str(dtype)[6:]} activations, one token", t * 1e3, "ms")
    dense_bf16, x_bf16 = dense.to(torch.bfloat16), x1.to(torch.bfloat16)
    figure("dense bf16 GEMV", best_time(lambda: F.linear(x_bf16, dense_bf16), repeat=30) * 1e3,
           "ms")
    hand_off()
    from_memory()


def from_memory(n: int = 4096, count: int = 16) -> None:
    """G weights/s of one-token products cycling through ``count`` distinct n x n matrices
    (each is read from memory, not from the caches) and on one matrix (in cache)."""
    lib = native.library()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, n, generator=g)
    for bits in (3, 8):
        q = quantize_tensor(torch.randn(n, n, generator=g), bits)
        copies = [OneTokenMatvec(q.qweight.clone(), q.scales.clone(), q.offsets.clone(),
                                 q.layout) for _ in range(count)]
        for threads in (1, 2):
            for f in copies:
                f.threads = threads
            cached = best_time(lambda f=copies[0]: f(lib, x), repeat=20)
            streamed = best_time(lambda c=copies: [f(lib, x) for f in c], repeat=3) / count
            figure(f"from memory: packed {bits}-bit matvec, {threads} thread(s)",
                   n * n / streamed / 1e9, "G weights/s")
            figure(f"from memory: packed {bits}-bit matvec, {threads} thread(s), vs in cache",
                   cached / streamed, "x")
    for dtype in (torch.bfloat16, torch.float32):
        mats = [torch.randn(n, n, generator=g).to(dtype) for _ in range(count)]
        xd = x.to(dtype)
        streamed = best_time(lambda xd=xd, ms=mats: [F.linear(xd, w) for w in ms],
                             repeat=3) / count
        figure(f"from memory: dense {str(dtype)[6:]} GEMV", n * n / streamed / 1e9,
               "G weights/s")


def _busy(microseconds: float) -> None:
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


def hand_off(gap_us: float = 60, calls: int = 200) -> None:
    """One-token 3-bit matvec on 1 vs 2 threads, with ``gap_us`` of other work before each call
    (the worker asleep when it comes) and back to back (the worker spinning)."""
    lib = native.library()
    g = torch.Generator().manual_seed(1)
    for rows, cols in ((256, 256), (512, 1024), (1024, 1024), (2048, 2048)):
        q = quantize_tensor(torch.randn(rows, cols, generator=g), 3)
        f = OneTokenMatvec(q.qweight, q.scales, q.offsets, q.layout)
        x = torch.randn(1, cols, generator=g)
        for gap in (gap_us, 0):
            for threads in (1, 2):
                f.threads = threads
                best = float("inf")
                for _ in range(5):
                    total = 0
                    for _ in range(calls):
                        _busy(gap)
                        start = time.perf_counter_ns()
                        f(lib, x)
                        total += time.perf_counter_ns() - start
                    best = min(best, total / calls / 1000)
                figure(f"hand-off: {rows * cols // 1024} K weights, {gap:g} us before each "
                       f"call, {threads} thread(s)", best, "us")


if __name__ == "__main__":
    main()
