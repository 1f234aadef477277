"""The machine's memory read rate beside the rate the decode products read packed weights at.

A token of decode reads every weight once, so past the caches a decode step is bound by how
fast memory is read. ``read``: a STREAM-like sum over a buffer of 1 GiB or twice the
last-level cache, the larger (float32, torch, each thread count); ``copy``: the same buffer
copied (read + write). Then one-token products of 7B-shaped matrices (MLP 18,944 x 3,584 and its
transpose) at 3 and 4 bits with the activations ``auto`` picks (int16 under 4 bits, int8 from 4)
and float32, each rotating over copies of one packed matrix that together hold twice the
last-level cache or more (some server parts have hundreds of MiB of it: four 7B MLP matrices
fit), as GB/s of the codes, scales and offsets read: their share of ``read`` is how close the
kernels come to the memory's rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import best_time, figure, machine
from dynquant import quantize_tensor
from dynquant.numerics import native
from dynquant.numerics.packed_matvec import OneTokenMatvec

SHAPES = ((18944, 3584), (3584, 18944))
BUFFER_BYTES = 1 << 30
DEFAULT_LLC_BYTES = 32 << 20  # where the system does not say


def last_level_cache_bytes() -> int:
    """The largest cache the kernel reports for CPU 0 (Linux sysfs), else DEFAULT_LLC_BYTES."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=DEFAULT_LLC_BYTES)


def stream(threads: int) -> tuple[float, float]:
    """(read, copy) GB/s over the larger of BUFFER_BYTES and two last-level caches on
    ``threads`` threads."""
    torch.set_num_threads(threads)
    x = torch.ones(max(BUFFER_BYTES, 2 * last_level_cache_bytes()) // 4)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read = best_time(lambda: x.sum(), repeat=5)
    copy = best_time(lambda: y.copy_(x), repeat=5)
    return nbytes / read / 1e9, 2 * nbytes / copy / 1e9


def product_rate(rows: int, cols: int, bits: int, activations: str, copies: int = 0) -> float:
    """GB/s of packed bytes a one-token product reads, rotating over ``copies`` copies of one
    packed matrix (0: as many as hold twice the last-level cache, at least 4)."""
    qt = quantize_tensor(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)),
                         bits)
    nbytes = qt.qweight.nbytes + qt.scales.nbytes + qt.offsets.nbytes
    copies = copies or max(4, -(-2 * last_level_cache_bytes() // nbytes))
    made = [OneTokenMatvec(qt.qweight.clone(), qt.scales.clone(), qt.offsets.clone(), qt.layout,
                           int8=activations == "int8", int16=activations == "int16")
            for _ in range(copies)]
    lib, x = native.library(), torch.randn(cols)
    turn = iter(range(1 << 62))

    def one() -> None:
        made[next(turn) % copies](lib, x)

    return nbytes / best_time(one, repeat=50, warmup=copies) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=0,
                        help="matrices a product rotates over (0: twice the last-level cache)")
    args = parser.parse_args(argv)
    print(f"# memory bandwidth, {machine()}")
    figure("last-level cache", last_level_cache_bytes() >> 20, "MiB")
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
