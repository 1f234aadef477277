"""scipy's LAPACK on a chosen number of threads.

A Cholesky factor's rounding depends on the number of threads its LAPACK runs on (SmolLM2's
576- and 1,536-wide second moments factor to other bits on 1 and 2 OpenBLAS threads). scipy's
OpenBLAS takes its thread count from the environment when it loads, and a Ray worker's
environment is not the driver's, so a factor computed in a job would round differently from the
same factor computed here. ``lapack_threads(n)`` sets the calling thread's OpenBLAS thread count
for the duration (OpenBLAS's ``openblas_set_num_threads_local``, in the library scipy ships);
where scipy was built against another LAPACK (a conda MKL build) it does nothing, and factors
computed in different processes may then differ in their last bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path


@cache
def _set_local() -> ctypes._CFuncPtr | None:
    """OpenBLAS's per-thread setter in the library scipy.linalg runs on, or None."""
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS)

    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    libs = sorted({line.split()[-1] for line in lines
                   if "scipy.libs" in line and "openblas" in line.lower()})
    for lib in libs:
        fn = getattr(ctypes.CDLL(lib), "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


@contextmanager
def lapack_threads(threads: int) -> Iterator[None]:
    """scipy's LAPACK calls made by this thread run on ``threads`` threads while the context
    lasts (no effect without scipy's own OpenBLAS)."""
    fn = _set_local()
    if fn is None:
        yield
        return
    before = fn(threads)
    try:
        yield
    finally:
        fn(before)
