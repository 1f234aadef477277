"""Give freed memory back to the system while weights stream through (glibc only).

glibc serves a large allocation with its own mmap, and returns it on free, but each such free
raises the size below which later allocations come from the heap instead (up to 32 MiB), and
heap memory stays with the process. A streamed pass allocates and frees tensors of a few MiB to
tens of MiB per block, so after the first blocks they all stay resident: on an 885 M-parameter
model the calibrated measure peaked at 1.7x the dense bf16 model instead of a block's worth.
Pinning the threshold (what ``MALLOC_MMAP_THRESHOLD_`` does at start-up) keeps every
allocation past it an mmap of its own, returned on free. Not done at import: decode allocates
small activations at a high rate, where mmap per allocation would cost time.

The price of the pin is page faults: a loop that makes and frees the same tensors of a few MiB
(the measure's error sums over chunks of rows, the Fisher pass's head terms) maps and zeroes
them afresh each time, a fifth of those stages' time at 7B shapes (BENCHMARKS.md "Scale").
Inside ``heap_served`` such tensors come from the heap, reused in place; on leaving, the pin is
back and the free pages handed back, but a chunk the heap still holds free (below a live one)
may serve a later allocation, which glibc looks for before it maps one, and stay resident after
it is freed: the streamed measure of an 885 M model peaked 7% higher with ``heap_served``, 19%
with the larger threshold for the whole measure ("Quantize memory"). Hence only around such
loops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from dynquant.freed_memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, chosen_by_user, glibc

THRESHOLD = 1 << 20
# heap_served's: above the chunks of rows the measure and the Fisher pass remake (2-4 MiB), and
# the free top the heap keeps for them (glibc's default, 128 KiB, would hand a freed chunk at the
# top back at once)
SERVED_THRESHOLD, SERVED_TOP = 8 << 20, 256 << 20
TRIM_THRESHOLD = 128 << 10  # glibc's default (a pinned threshold does not move it)

_pinned = {"threshold": 0}  # the threshold return_freed_memory set (0: none)


def return_freed_memory() -> bool:
    """Pin glibc's mmap threshold at 1 MiB for this process (unless the environment set it).
    True if set; False where there is no glibc (the streamed passes work the same, with a
    higher peak)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    libc = glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD):
        return False
    _pinned["threshold"] = THRESHOLD
    return True


@contextmanager
def heap_served(threshold: int = SERVED_THRESHOLD) -> Iterator[None]:
    """Within: allocations below ``threshold`` from the heap, where ``return_freed_memory``
    pinned a lower one (else, or where the user chose malloc's settings, nothing changes);
    after: the pin again, the free pages returned."""
    libc = glibc() if _pinned["threshold"] and not chosen_by_user() else None
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, threshold):
        yield
        return
    libc.mallopt(M_TRIM_THRESHOLD, SERVED_TOP)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, _pinned["threshold"])
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.malloc_trim(0)
