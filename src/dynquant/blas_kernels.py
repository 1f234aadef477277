"""torch's float32 products on AMD CPUs with AVX-512 at the rate of their instructions: MKL, which
torch's products run on, picks its kernels by the CPU's vendor string and runs AVX2 ones on every
CPU whose vendor is not Intel. Set up when dynquant is imported, before torch runs a product.

MKL asks ``mkl_serv_intel_cpu_true`` whether the CPU is Intel's; a PyTorch maintainer's advice
for AMD CPUs is to preload a library whose function of that name returns 1
(pytorch/builder#1245). dynquant has the same effect without a preload: the function keeps its
answer in a variable it reads first (``mov cached(%rip), %eax; test; js; ret``) and MKL chooses
its kernels at its first product, so that variable is set to 1 right after torch loads. The
function's code is checked byte for byte first; any other build is left alone. MKL then picks by
the CPU's instructions as it does on Intel's (no AMX or AVX-512 FP16 on these CPUs, and it checks).

Measured on a 2-core Zen 5 (BENCHMARKS.md "Scale"): a 4,096^3 float32 product 108 -> 243 GMAC/s.
``DYNQUANT_BLAS_KERNELS``: ``auto`` (default: AMD CPUs with AVX-512), ``on`` (any AMD x86 CPU:
MKL's Intel kernels for its instruction set, e.g. AVX2; unmeasured on a real AVX2-only CPU),
``off`` (MKL's own choice). numpy's and scipy's OpenBLAS choose well by themselves (Zen 5:
SkylakeX kernels) unless ``OPENBLAS_CORETYPE`` names others. This module imports neither torch
nor numpy.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import platform
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from dynquant.import_hooks import DelegatingLoader, spec_with_loader

ENV = "DYNQUANT_BLAS_KERNELS"
CHOICES = ("auto", "on", "off")
# mkl_serv_intel_cpu_true as MKL 2024 builds it: load the cached answer (rip-relative, 4 bytes
# of displacement between these), return it unless negative (not yet known)
_LOAD = b"\x8b\x05"
_TEST_RETURN = b"\x85\xc0\x78\x01\xc3"
_VENDOR_CHECK = b"\x47\x65\x6e\x75"  # "Genu", compared with CPUID's vendor in the same function

# what was done in this process, for the benchmarks' machine line
state: dict[str, str] = {}


@cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines, read once a process (every core's block: large on big machines)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line named one of ``keys`` (None: no such line, or
    no /proc/cpuinfo)."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value
    return None


@cache
def _cpu() -> tuple[str, frozenset[str]]:
    """This x86 CPU's vendor and flags ('' and none elsewhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "", frozenset()
    return ((cpuinfo("vendor_id") or "").strip(),
            frozenset((cpuinfo("flags") or "").lower().split()))


def intel_kernels_wanted(vendor: str, flags: frozenset[str], setting: str) -> bool:
    """Whether MKL should run Intel's kernels for this CPU's instructions."""
    if setting not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if vendor != "AuthenticAMD" or setting == "off":
        return False
    return setting == "on" or "avx512f" in flags


def cached_answer_offset(code: bytes) -> int | None:
    """Where ``mkl_serv_intel_cpu_true``'s cached answer lies, from the function's start, read
    off its first instruction; None unless ``code`` (its first bytes) is the expected function."""
    if (len(code) < 64 or code[:2] != _LOAD or code[6:11] != _TEST_RETURN
            or _VENDOR_CHECK not in code):
        return None
    return 6 + int.from_bytes(code[2:6], "little", signed=True)


def _writable(address: int) -> bool:
    """Whether ``address`` lies in a writable mapping of this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return "w" in perms
    return False


def use_intel_mkl_kernels() -> str:
    """Set MKL's cached answer to 'an Intel CPU' in the loaded torch (call before its first
    product); what was done, in words."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch not loaded"
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        function = ctypes.cast(lib.mkl_serv_intel_cpu_true, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return "torch without MKL"
    offset = cached_answer_offset(ctypes.string_at(function, 64))
    if offset is None or not _writable(function + offset):
        return "MKL of an unknown build: its own kernels"
    ctypes.c_int.from_address(function + offset).value = 1
    return "MKL: Intel's kernels"


class _ThenUseIntelKernels(DelegatingLoader):
    """torch's own loader, then MKL's answer set (before anything can run a product)."""

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WhenTorchLoads)]
        state["mkl"] = use_intel_mkl_kernels()


class _WhenTorchLoads(importlib.abc.MetaPathFinder):
    """Finds torch's spec as the other finders would, with the loader above. It stays until
    torch has loaded: transformers asks for torch's spec (``importlib.util.find_spec``) to see
    whether it is installed well before it imports it."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        return spec_with_loader(self, fullname, path, target, _ThenUseIntelKernels)


def choose_blas_kernels() -> None:
    """At ``import dynquant``: have MKL's answer set when torch loads (now, if it is loaded:
    too late where torch has run a product already)."""
    vendor, flags = _cpu()
    setting = os.environ.get(ENV, "auto").lower()
    if setting not in CHOICES:  # an import must not fail for it: said, and the default taken
        import warnings

        warnings.warn(f"dynquant: {ENV} must be one of {', '.join(CHOICES)}, got {setting!r}: "
                      "taking auto", RuntimeWarning, stacklevel=3)
        setting = "auto"
    if not intel_kernels_wanted(vendor, flags, setting):
        state["mkl"] = "its own kernels"
    elif "torch" in sys.modules:
        state["mkl"] = use_intel_mkl_kernels()
    elif not any(isinstance(f, _WhenTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenTorchLoads())


def describe() -> str:
    """The choices in one line (for the benchmarks' machine line)."""
    return f"torch's BLAS: {state.get('mkl', 'not loaded')}"


__all__ = ["CHOICES", "ENV", "cached_answer_offset", "choose_blas_kernels", "cpuinfo", "describe",
           "intel_kernels_wanted", "use_intel_mkl_kernels"]
