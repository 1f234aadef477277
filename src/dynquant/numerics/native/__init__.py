"""The native (C) kernels' library: compiled once per machine on first use, loaded with ctypes.

The kernels (``*.c`` beside this file) and their Python sides:
- ``quantize_rows.c`` (``row_kernels.py``): the quantizer's clip search, codes and packing; it
  computes exactly what the torch path of ``quantizer.py`` computes (same float32 operations, IEEE
  semantics, no fused multiply-adds) without that path's per-operation overhead, paid 11 times
  per block (once per clip alpha);
- ``dequantize_rows.c`` (``row_kernels.py``): dequantization, bit-identical to the torch path;
- ``dequantize_int4pack.c`` (``runtime/int4_cpu.py``): the same from torch's int4 layout, for the
  long bf16 prefills of 4-bit modules held in that layout;
- ``packed_matvec.c``, ``packed_vecmat.c`` (``packed_matvec.py``): a few tokens times a packed
  matrix, without dequantizing it (decode); ``packed_matvec_tokens.c``: the matvec's 2-8 token
  case (VBMI or AVX2), each group's codes unpacked once for every token, reached through its own
  entry ``dq_matvec_tokens_mt``;
- ``packed_gemm.c`` (``packed_matvec.py``): many tokens times a packed matrix (prefill), panels of
  rows dequantized into a per-thread float32 buffer that stays in cache;
- ``packed_matvec_q8.c``, ``packed_matvec_q16.c`` (``packed_matvec.py``): one token with int8 or
  int16 activations, integer dot products on the codes (VNNI, AVX2 or portable; every build the
  same bits), their shared parts in ``integer_dots.h``; ``packed_experts_integer.c`` their
  expert pairs;
- ``dense_matvec.c`` (``runtime/stored_linear.py``): a few float32 tokens times a dense bf16
  matrix, converted on the fly (a dense Linear kept in its file dtype);
- ``decode_step.c`` (``runtime/native_decode.py``): a whole decode step of a Llama-style model;
- ``packed_experts.c`` (``packed_matvec.py``): a few (token, expert) pairs of a bank in one call
  (MoE decode), each pair by the one-token kernels;
- ``tuned_rounding.c`` (``tuned_scales.py``): the tuned rounding's Adam step, bit-identical to
  its torch path;
- ``tunable_dequantize.c`` (``tuned_scales.py``): the tuning's dequantize from codes as bytes and
  its gradients' group sums, bit-identical to their torch paths;
- ``kernels.h``: every exported function and the descriptor structs (mirrored by
  ``interface.py``; ``layout.c`` reports their compiled layout to the tests);
- ``unpack.h``: reading packed codes, with AVX-512 VBMI where the CPU has it;
- ``pool.c``: the products' threads (``*_mt`` entry points): a part reaches a waiting
  worker within a microsecond (a Python pool hand-off costs ~50 us, as much as a decode
  product); waits spin at most 20 us, then sleep.

The shared library is built with the system C compiler (``$CC``, else ``cc``) into
``$DYNQUANT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dynquant`` or ``~/.cache/dynquant``), keyed by
the sources, the flags, the compiler and the CPU, and written atomically so that concurrent first
uses cannot load a half-written file. Without a compiler, or with ``DYNQUANT_NATIVE=0``, the torch
paths run instead (same results, slower) and a warning says why once.

``-march=native`` lets the compiler use the vector units of the machine the library is built on;
AMX is switched off explicitly (some machines trap it, and nothing here needs it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from itertools import pairwise
from pathlib import Path

import torch

from dynquant.blas_kernels import cpuinfo
from dynquant.numerics.native import interface

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
LIBRARY_NAME = "libdynquant_native.so"
# IEEE semantics are part of the contract: never -ffast-math; no contraction into FMA. Neither
# errno from math functions (no kernel reads it) nor floating-point traps (none is enabled)
# change a value; without them a loop with a square root or a float comparison does not
# vectorize (tuned_rounding.c).
BASE_FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
              "-fPIC", "-shared", "-pthread")
# Tried in order: the first set the compiler accepts is used.
ARCH_FLAGS: tuple[tuple[str, ...], ...] = (
    ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    ("-march=native",),
    (),
)


def _arch_flags() -> tuple[tuple[str, ...], ...]:
    """``$DYNQUANT_NATIVE_ARCH`` (e.g. ``x86-64-v3``) builds for that target instead of this
    machine: a cache shared by different CPUs, or testing the AVX2 and portable paths here."""
    arch = os.environ.get("DYNQUANT_NATIVE_ARCH")
    return ((f"-march={arch}",),) if arch else ARCH_FLAGS
# The kernels read these dtypes directly (the code passed to them); others are converted first.
INPUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_GROUP_SIZE = 1024  # the kernels' per-group scratch


def cache_dir() -> Path:
    """Where dynquant keeps what it builds or fetches: ``$DYNQUANT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dynquant``, else ``~/.cache/dynquant``."""
    if os.environ.get("DYNQUANT_CACHE_DIR"):
        return Path(os.environ["DYNQUANT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynquant"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags (a cache shared between machines must not mix -march=native)."""
    return cpuinfo("flags", "Features") or platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""


def _compile(cc: str, flags: list[str], source: Path, obj: str) -> str:
    """One translation unit to an object file; "" or the compiler's last line."""
    out = subprocess.run([cc, *flags, "-c", "-o", obj, str(source)], capture_output=True,
                         text=True, timeout=120)
    return "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["failed"])[-1]


def _build(cc: str, directory: Path) -> tuple[Path | None, str]:
    """Compile the kernel into ``directory`` (atomically), its sources on all cores at once;
    (library, "") or (None, why)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY_NAME
    why, first_failure = "", None  # (flags, the compiler's line) of the first set that failed
    for arch in _arch_flags():
        with tempfile.TemporaryDirectory(dir=directory) as work:
            flags = [f for f in (*BASE_FLAGS, *arch) if f != "-shared"]
            objs = [str(Path(work) / f"{s.stem}.o") for s in SOURCES]
            tmp = str(Path(work) / LIBRARY_NAME)
            try:
                with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                    errors = list(pool.map(_compile, [cc] * len(objs), [flags] * len(objs),
                                           SOURCES, objs))
                why = next((e for e in errors if e), "")
                if not why:
                    out = subprocess.run([cc, *flags, "-shared", "-o", tmp, *objs, "-lm"],
                                         capture_output=True, text=True, timeout=120)
                    why = "" if out.returncode == 0 else (
                        out.stderr.strip().splitlines() or ["link failed"])[-1]
            except (OSError, subprocess.TimeoutExpired) as exc:
                return None, f"{cc}: {exc}"
            if not why:
                os.replace(tmp, target)
                if first_failure:  # a compiler without those flags, or code it cannot build
                    built = " ".join(arch) or "no -march flags"
                    flags, line = " ".join(first_failure[0]), first_failure[1]
                    warnings.warn(f"dynquant: native kernels built with {built} ({flags}: "
                                  f"{line}); without them the SIMD paths may be missing",
                                  RuntimeWarning, stacklevel=2)
                return target, ""
            first_failure = first_failure or (arch, why)
    return None, why


def _library_path() -> tuple[Path | None, str]:
    cc = os.environ.get("CC", "cc")
    version = _compiler_version(cc)
    if not version:
        return None, f"no working C compiler ({cc!r})"
    parts = [*(f.read_text() for f in SOURCES + HEADERS), " ".join(BASE_FLAGS), repr(_arch_flags()),
             version, platform.machine(), _cpu_fingerprint()]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    for root in (cache_dir(), Path(tempfile.gettempdir()) / "dynquant-cache"):
        directory = root / "native" / key
        if (directory / LIBRARY_NAME).is_file():
            return directory / LIBRARY_NAME, ""
        try:
            return _build(cc, directory)
        except OSError as exc:  # cache directory not writable: try the next one
            why = str(exc)
    return None, why


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when switched off (``DYNQUANT_NATIVE=0``, read at every call)
    or unavailable."""
    return None if os.environ.get("DYNQUANT_NATIVE", "1") == "0" else _load()


@cache
def _load() -> ctypes.CDLL | None:
    path, why = _library_path()
    if path is None:
        warnings.warn(f"dynquant: native kernels unavailable ({why}); using the torch paths "
                      "(same results, several times slower)", RuntimeWarning, stacklevel=3)
        return None
    return interface.bind(ctypes.CDLL(str(path)))


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first call)."""
    return library() is not None


def split_rows(run: Callable[[int, int], int], rows: int, elements: int, min_elements: int
               ) -> list[int]:
    """``run(lo, hi)`` over row ranges covering ``rows``, on ``torch.get_num_threads()`` threads
    when the work has at least ``min_elements`` values (ctypes releases the GIL during a call);
    the calling thread takes the first range. Returns each call's status."""
    threads = min(torch.get_num_threads(), rows) if elements >= min_elements else 1
    bounds = list(pairwise(rows * i // threads for i in range(threads + 1)))
    others = [_pool(threads, os.getpid()).submit(run, lo, hi) for lo, hi in bounds[1:]]
    return [run(*bounds[0])] + [f.result() for f in others]


@cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool per process: a forked child (a DataLoader worker...) inherits the parent's pool
    object but not its threads, and would wait for them forever."""
    return ThreadPoolExecutor(workers, thread_name_prefix=f"dynquant-{pid}")


# The kernel pool's thread count while torch's own is lowered for a decode step
# (runtime/decode_threads.py); None: torch's.
pool_threads: int | None = None


def kernel_threads() -> int:
    """The kernel pool's threads: ``pool_threads`` where set, else torch's thread count."""
    return pool_threads or torch.get_num_threads()


def threads_for(elements: int, min_elements: int) -> int:
    """How many threads a native ``*_mt`` call should use: :func:`kernel_threads` from
    ``min_elements`` values of work, else one."""
    return kernel_threads() if elements >= min_elements else 1


def row_ptr(t: torch.Tensor, row: int) -> int:
    """Address of ``t[row]`` (contiguous ``t``) without making a view (views cost ~2 us each)."""
    return t.data_ptr() + row * t.stride(0) * t.element_size()


def check_packed_block(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                       bits: int, group_size: int, in_features: int) -> None:
    """Raise ValueError unless the three tensors are a block of rows of that layout: the kernels
    trust the shapes they are given (a wrong one would read out of bounds)."""
    rows, groups = scales.shape if scales.ndim == 2 else (-1, -1)
    words = groups * bits * group_size // 32
    if not (qweight.dtype == torch.int32 and scales.dtype == offsets.dtype == torch.bfloat16
            and tuple(qweight.shape) == (rows, words) and offsets.shape == scales.shape
            and (groups - 1) * group_size < in_features <= groups * group_size
            and bits * group_size % 32 == 0):
        raise ValueError(
            f"not a packed block of {bits}-bit groups of {group_size} over {in_features} "
            f"columns: qweight {qweight.dtype} {list(qweight.shape)}, scales {scales.dtype} "
            f"{list(scales.shape)}, offsets {offsets.dtype} {list(offsets.shape)}")


__all__ = ["INPUT_DTYPES", "MAX_GROUP_SIZE", "available", "check_packed_block", "library",
           "row_ptr", "split_rows", "threads_for"]
