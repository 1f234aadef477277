"""One-token products (decode) from 576 to 4096 wide: dynquant's packed kernels with float32, int8
and int16 activations (int16: widths up to 6, what `auto` gives modules under 4 bits) against
torch's dense float32 product of the same decoded weights.

Each product is called as a decode step calls it (the module's prepared one-token path,
``OneTokenMatvec``), on the kernel pool's threads (``--threads``, default 2; products under
``STEP_PARALLEL_MIN_ELEMENTS`` weights on one, as in a native decode step); the variants take
turns, best of 3 rounds. Shapes: SmolLM2-135M's (576 wide, MLP 1536) and 2048 / 4096 squares.
``--as-avx2``: the kernels built for x86-64-v3 and torch capped at AVX2 (an AVX-512 machine
running the AVX2 build is not an AVX2 CPU: see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import best_time, machine, rerun_as_avx2
from dynquant import quantize_tensor
from dynquant.numerics import native
from dynquant.numerics.packed_matvec import OneTokenMatvec, q8_path, simd_path
from dynquant.runtime.native_decode import STEP_PARALLEL_MIN_ELEMENTS

SHAPES = ((576, 576), (1536, 576), (576, 1536), (2048, 2048), (4096, 4096))
WIDTHS = (2, 3, 4, 8)


def prepared(q, activations: str) -> OneTokenMatvec:
    f = OneTokenMatvec(q.qweight, q.scales, q.offsets, q.layout, int8=activations == "int8",
                       int16=activations == "int16")
    f.threads = native.threads_for(q.layout.num_rows * q.layout.in_features,
                                   STEP_PARALLEL_MIN_ELEMENTS)
    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--as-avx2", action="store_true")
    args = parser.parse_args()
    if args.as_avx2:
        rerun_as_avx2("benchmarks.one_token_products", [f"--threads={args.threads}"])
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lib = native.library()
    print(f"# one-token products: kernels {simd_path()}, int8 {q8_path()}; {machine()}")
    print("| rows x cols | bits | dense float32 us | packed float us | packed int8 us | "
          "packed int16 us | float vs dense | int8 vs dense | int16 vs dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        w = torch.randn(rows, cols, generator=g)
        x = torch.randn(1, cols, generator=g)
        for bits in WIDTHS:
            q = quantize_tensor(w, bits)
            dense = q.dequantize(torch.float32)
            runs = {"dense": lambda d=dense, x=x: F.linear(x, d)}
            for kind in ("float", "int8", "int16")[:3 if bits <= 6 else 2]:
                product = prepared(q, kind)
                runs[kind] = lambda f=product, x=x: f(lib, x)
            best = dict.fromkeys(runs, float("inf"))
            repeat = max(5, int(2e7 // (rows * cols)))
            for _ in range(3):
                for name, fn in runs.items():
                    best[name] = min(best[name], best_time(fn, repeat=repeat))
            us = {k: v * 1e6 for k, v in best.items()}
            d = us["dense"]
            i16, i16_ratio = ((f"{us['int16']:.1f}", f"{d / us['int16']:.2f}x") if "int16" in us
                              else ("-", "-"))
            print(f"| {rows} x {cols} | {bits} | {d:.1f} | {us['float']:.1f} | {us['int8']:.1f} | "
                  f"{i16} | {d / us['float']:.2f}x | {d / us['int8']:.2f}x | {i16_ratio} |",
                  flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
