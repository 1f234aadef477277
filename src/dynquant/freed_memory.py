"""Freed memory reused in place by a loop that frees and allocates the same large tensors
(glibc's malloc): what PyTorch's CPU performance guides get by preloading jemalloc or tcmalloc,
for one loop.

glibc serves every allocation above its mmap threshold (32 MB at most) with a fresh mapping and
unmaps it at free, so a tensor of hundreds of MB made again in every step of a loop is paid for
each time in page faults and the kernel's zeroing of its pages: tuning a 7B layer's scales (its
dequantized weights and their gradient, ~2 GB a step) spent as long in the kernel as in its
matrix products. Inside ``reusing_freed_memory`` no block is mapping-served and the heap's free
top is kept, so each step reuses the memory the last one freed; on leaving, the settings are
glibc's after its own tuning (mappings from 32 MB, the top trimmed past 64 MB) and the free pages
go back to the system. Only for such loops: process-wide, a heap that never unmaps fragments,
and the resident size of a whole quantize grew by 1.9 GiB that way. A user's own choice wins:
nothing changes where ``MALLOC_MMAP_MAX_`` or ``MALLOC_TRIM_THRESHOLD_`` is set or another
allocator is preloaded; other C libraries keep their policy.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h
KEPT_TOP = (1 << 31) - 1  # mallopt takes an int: the free top kept inside (2 GB)
# after: glibc's defaults once its dynamic threshold has seen a large block freed
MMAP_THRESHOLD, TRIM_THRESHOLD, MMAP_MAX = 32 << 20, 64 << 20, 65536
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")  # the environment's, glibc reads


def chosen_by_user() -> bool:
    return (any(name in os.environ for name in USER_SETTINGS)
            or any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("jemalloc", "tcmalloc")))


@cache
def glibc() -> ctypes.CDLL | None:
    """glibc's malloc controls (None: another C library, or not Linux)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's, or another C library's)
    except (OSError, AttributeError):
        return None
    return libc


@contextmanager
def reusing_freed_memory() -> Iterator[bool]:
    """Within: large freed blocks are reused in place (yields whether the setting applies);
    after: glibc's settings, and the free pages handed back."""
    libc = None if chosen_by_user() else glibc()
    if libc is None:
        yield False
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_TOP)
    try:
        yield True
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.mallopt(M_MMAP_MAX, MMAP_MAX)
        libc.malloc_trim(0)
