"""The machine's memory read rate beside the rate the decode products read packed weights at.

A token of decode reads every weight once, so past the caches a decode step is bound by how
fast memory is read. ``read``: a STREAM-like sum over a buffer eight times the last-level cache
or more (float32, torch, each thread count); ``copy``: the same buffer copied (read + write).
Then one-token products of 7B-shaped matrices (MLP 18,944 x 3,584 and its transpose) at 3 and 4
bits with the activations ``auto`` picks (int16 under 4 bits, int8 from 4) and float32, each
rotating over copies that together exceed the cache, as GB/s of the codes, scales and offsets
read: their share of ``read`` is how close the kernels come to the memory's rate.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import best_time, figure, machine
from dynquant import quantize_tensor
from dynquant.numerics import native
from dynquant.numerics.packed_matvec import OneTokenMatvec

SHAPES = ((18944, 3584), (3584, 18944))
BUFFER_BYTES = 1 << 30


def stream(threads: int) -> tuple[float, float]:
    """(read, copy) GB/s over BUFFER_BYTES on ``threads`` threads."""
    torch.set_num_threads(threads)
    x = torch.ones(BUFFER_BYTES // 4)
    y = torch.empty_like(x)
    read = best_time(lambda: x.sum(), repeat=5)
    copy = best_time(lambda: y.copy_(x), repeat=5)
    return BUFFER_BYTES / read / 1e9, 2 * BUFFER_BYTES / copy / 1e9


def product_rate(rows: int, cols: int, bits: int, activations: str, copies: int) -> float:
    """GB/s of packed bytes a one-token product reads, rotating over ``copies`` matrices."""
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(copies):
        qt = quantize_tensor(torch.randn(rows, cols, generator=g), bits)
        made.append(OneTokenMatvec(qt.qweight, qt.scales, qt.offsets, qt.layout,
                                   int8=activations == "int8", int16=activations == "int16"))
    nbytes = sum(t.nbytes for t in made[0].tensors)
    lib, x = native.library(), torch.randn(cols)
    turn = iter(range(1 << 62))

    def one() -> None:
        made[next(turn) % copies](lib, x)

    return nbytes / best_time(one, repeat=50, warmup=copies) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=4, help="matrices a product rotates over")
    args = parser.parse_args(argv)
    print(f"# memory bandwidth, {machine()}")
    reads = {}
    for threads in sorted({1, args.threads}):
        reads[threads], copy = stream(threads)
        figure(f"read, {threads} thread(s)", round(reads[threads], 1), "GB/s")
        figure(f"copy, {threads} thread(s)", round(copy, 1), "GB/s")
    peak = reads[args.threads]
    torch.set_num_threads(args.threads)
    print("| product | bits | activations | GB/s | of read |")
    print("|---|---|---|---|---|")
    for rows, cols in SHAPES:
        for bits in (3, 4):
            for activations in ("int16" if bits < 4 else "int8", "float32"):
                rate = product_rate(rows, cols, bits, activations, args.copies)
                print(f"| {rows} x {cols} | {bits} | {activations} | {rate:.1f} | "
                      f"{rate / peak:.0%} |")


if __name__ == "__main__":
    main()
