"""MKL's kernels on AMD CPUs with AVX-512 (``dynquant/blas_kernels.py``): which CPUs get Intel's,
the check of MKL's function before its answer is set, and what a process that imports dynquant
runs: on this machine, as the rule says for its CPU, with products that are still right."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynquant import blas_kernels
from dynquant.blas_kernels import cached_answer_offset, intel_kernels_wanted

AVX512 = frozenset({"avx2", "avx512f", "avx512bw"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(("vendor", "flags", "setting", "wanted"), [
    ("AuthenticAMD", AVX512, "auto", True),  # Zen 4 / 5
    ("AuthenticAMD", AVX2, "auto", False),  # Zen 3: unmeasured, MKL's own
    ("AuthenticAMD", AVX2, "on", True),
    ("AuthenticAMD", AVX512, "off", False),
    ("GenuineIntel", AVX512, "on", False),  # Intel's kernels already
    ("", frozenset(), "on", False),  # not x86
])
def test_intel_kernels_only_where_the_rule_says(vendor, flags, setting, wanted):
    assert intel_kernels_wanted(vendor, flags, setting) is wanted


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="DYNQUANT_BLAS_KERNELS must be one of auto, on, off"):
        intel_kernels_wanted("AuthenticAMD", AVX512, "fast")


# mkl_serv_intel_cpu_true as in torch 2.13's MKL 2024.2: its cached answer 0x9958ffa bytes past
# the end of its first instruction; the vendor's "Genu" compared further on
_FUNCTION = bytes.fromhex("8b05fa8f950985c07801c353c7442448") + bytes(38) + \
    bytes.fromhex("b847656e7533442d") + bytes(8)


def test_the_cached_answer_is_read_off_the_function_s_first_instruction():
    assert len(_FUNCTION) == 70
    assert cached_answer_offset(_FUNCTION) == 6 + 0x09958FFA
    negative = _FUNCTION[:2] + (-16).to_bytes(4, "little", signed=True) + _FUNCTION[6:]
    assert cached_answer_offset(negative) == -10


@pytest.mark.parametrize("changed", [
    0,  # another first instruction
    7,  # no test-and-return after it
    58,  # no vendor check
])
def test_a_function_of_another_build_is_left_alone(changed):
    code = bytearray(_FUNCTION)
    code[changed] ^= 0xFF
    assert cached_answer_offset(bytes(code)) is None
    assert cached_answer_offset(_FUNCTION[:40]) is None


def _mkl_says_intel() -> int | None:
    """What MKL's vendor check answers in this process (None: torch without MKL)."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    function = getattr(lib, "mkl_serv_intel_cpu_true", None)
    if function is None:
        return None
    function.restype = ctypes.c_int
    return function()


_CHILD = """
import importlib.util, sys
if sys.argv[1] == "torch first":
    import torch
import dynquant
if sys.argv[1] == "its spec asked for first":  # as transformers does, to see it is installed
    importlib.util.find_spec("torch")
import torch
from dynquant import blas_kernels
print(blas_kernels.state["mkl"])
"""


@pytest.mark.parametrize("order", ["dynquant first", "torch first", "its spec asked for first"])
def test_a_process_that_imports_dynquant_runs_the_kernels_its_cpu_gets(order):
    vendor, flags = blas_kernels._cpu()
    out = subprocess.run([sys.executable, "-c", _CHILD, order], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    said = _mkl_says_intel()  # (this process imported dynquant first: conftest)
    if said is None:
        assert out in ("torch without MKL", "its own kernels")
    elif intel_kernels_wanted(vendor, flags, "auto"):
        assert (out, said) == ("MKL: Intel's kernels", 1)
    else:
        assert out == "its own kernels"
        assert said == (vendor == "GenuineIntel")


def test_the_kernels_mkl_runs_here_multiply_right():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 700, generator=gen), torch.randn(700, 500, generator=gen)
    exact = (a.double() @ b.double()).float()
    assert torch.allclose(a @ b, exact, rtol=0, atol=2e-4)
    gram = torch.zeros(700, 700).addmm_(a.T, a)
    assert torch.allclose(gram, (a.double().T @ a.double()).float(), rtol=0, atol=4e-4)
