"""Which float dtype a model computes in on this CPU: bfloat16 only where bf16 dot products are
native, float32 everywhere else.

bfloat16 is only the compute/storage dtype of activations (and of the dense weights a loaded
model keeps); the packed format and its dequantization (float32 multiply, then add) do not
change. Where a CPU lacks bf16 dot-product instructions, torch emulates a bf16 matmul by
converting every operand: measured on a 2-core AVX2-only EPYC, a [512x1024]x[1024x1024] product
ran at 0.9 GFLOPS in bf16 and 76.6 GFLOPS in float32 (85x). ``torch.backends.cpu
.get_cpu_capability()`` says AVX2 / AVX512 but not whether bf16 is native, so the decision reads
the CPU's own feature flags:

- x86: ``avx512_bf16`` (VDPBF16PS) or ``amx_bf16`` -> bfloat16;
- Arm: ``bf16`` (FEAT_BF16: BFDOT/BFMMLA) -> bfloat16;
- anything else, or flags that cannot be read -> float32.

``DYNQUANT_DTYPE`` (``auto``, ``bfloat16``, ``float32``) overrides the automatic choice for a whole
process; a ``dtype=`` argument or ``--dtype`` overrides both.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable
from functools import cache

import torch

from dynquant.blas_kernels import cpuinfo

BF16_NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
               "fp32": torch.float32, "float": torch.float32}
CHOICES = ("auto", "bfloat16", "float32")


def _darwin_flags() -> frozenset[str]:
    """macOS has no /proc/cpuinfo; Apple silicon says FEAT_BF16 through sysctl."""
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset({"bf16"}) if out.stdout.strip() == "1" else frozenset()


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (x86 ``flags`` / Arm ``Features`` of /proc/cpuinfo), lower case."""
    value = cpuinfo("flags", "Features")
    if value is not None:
        return frozenset(value.lower().split())
    return _darwin_flags() if platform.system() == "Darwin" else frozenset()


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo's ``model name``), else the architecture."""
    value = cpuinfo("model name")
    return " ".join(value.split()) if value else platform.processor() or platform.machine()


def bf16_native(flags: Iterable[str]) -> bool:
    """Whether a CPU with these feature flags has native bf16 dot products."""
    return not BF16_NATIVE_FLAGS.isdisjoint(f.lower() for f in flags)


def cpu_class(flags: Iterable[str] | None = None) -> str:
    """The class the benchmarks report: ``avx512-bf16``, ``avx512``, ``avx2``, ``arm-bf16``,
    ``arm`` or ``portable``."""
    f = {x.lower() for x in (cpu_flags() if flags is None else flags)}
    if "avx512f" in f:
        return "avx512-bf16" if bf16_native(f) else "avx512"
    if "avx2" in f:  # (every x86 CPU with bf16 dot products has AVX-512 or AMX)
        return "avx2"
    if "asimd" in f or "neon" in f:
        return "arm-bf16" if bf16_native(f) else "arm"
    return "portable"


def auto_dtype(flags: Iterable[str] | None = None) -> torch.dtype:
    """bfloat16 where bf16 dot products are native, else float32."""
    return torch.bfloat16 if bf16_native(cpu_flags() if flags is None else flags) else torch.float32


# Past this many quantized weights the measure's calibration passes and the codes' pass (its
# block forwards, second moments' inputs and tuning steps) run in bfloat16 where the CPU
# multiplies it natively (``size_dtype``): on a 7B-shaped block the quantize takes 0.73x
# float32's time (bf16 tuning alone), for KL within about 1% on the real models at hand
# (BENCHMARKS.md "Scale"); models up to this size keep float32, and CPU-independent codes.
AUTO_BF16_WEIGHTS = 2_000_000_000


def size_dtype(quantized_weights: int, flags: Iterable[str] | None = None) -> str:
    """The codes' pass's dtype by default: "bfloat16" for a model of more than
    ``AUTO_BF16_WEIGHTS`` quantized weights on a CPU with native bf16 products (``flags``: this
    CPU's by default), else "float32"."""
    low = quantized_weights > AUTO_BF16_WEIGHTS and bf16_native(
        cpu_flags() if flags is None else flags)
    return "bfloat16" if low else "float32"


def size_dtype_reason(quantized_weights: int) -> str:
    """Why ``size_dtype`` answered bfloat16, for the line that says so."""
    return (f"{quantized_weights / 1e9:.1f} G quantized weights, past "
            f"{AUTO_BF16_WEIGHTS / 1e9:.1f} G, on a CPU with native bf16 products")


def resolve_dtype(dtype: str | torch.dtype | None = None,
                  flags: Iterable[str] | None = None) -> torch.dtype:
    """The compute dtype for a request: a torch dtype or name (``bfloat16``/``float32``) as
    given; ``None`` or ``"auto"``: ``$DYNQUANT_DTYPE`` if set, else :func:`auto_dtype`."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute dtype must be bfloat16 or float32, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        env = os.environ.get("DYNQUANT_DTYPE", "auto")
        return auto_dtype(flags) if env == "auto" else _named(env, "DYNQUANT_DTYPE")
    return _named(dtype, "dtype")


def _named(name: str, what: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(dtype: torch.dtype) -> str:
    """One line for ``generate``/``eval``: what runs and why."""
    native = bf16_native(cpu_flags())
    why = f"CPU {cpu_class()}: {'native bf16 dot products' if native else 'no native bf16'}"
    if dtype != auto_dtype():
        why += f", auto would be {dtype_name(auto_dtype())}; as asked"
    return f"compute dtype {dtype_name(dtype)} ({why})"


__all__ = ["AUTO_BF16_WEIGHTS", "CHOICES", "auto_dtype", "bf16_native", "cpu_class", "cpu_flags",
           "describe", "dtype_name", "resolve_dtype", "size_dtype",
           "size_dtype_reason"]
