"""The native quantizer kernel: built here, equal to the torch path bit for bit, safe fallback.

(Both paths are also held to the numpy reference in tests/numerics/test_quantizer.py.)
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import warnings

import pytest
import torch

from dynquant import quantize_tensor
from dynquant.numerics import native, row_kernels
from dynquant.numerics.quantizer import lane_sum
from dynquant.numerics.reference import lane_sum_ref
from quantizer_backends import backend


def _both(w: torch.Tensor, bits: int, gs: int = 128, importance: torch.Tensor | None = None):
    with backend("native"):
        fast = quantize_tensor(w, bits, gs, importance=importance)
    with backend("torch"):
        slow = quantize_tensor(w, bits, gs, importance=importance)
    return fast, slow


def _assert_same(fast, slow) -> None:
    assert torch.equal(fast.qweight, slow.qweight)
    assert torch.equal(fast.scales, slow.scales)
    assert torch.equal(fast.offsets, slow.offsets)
    assert fast.clipped_fraction == slow.clipped_fraction
    # the error sums run in another order: equal to float32 rounding
    assert fast.clip_improvement == pytest.approx(slow.clip_improvement, rel=1e-5, abs=1e-7)


def test_the_native_kernel_is_built_on_this_machine():
    with backend("native"):
        assert native.available()
    with backend("torch"):
        assert not native.available()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_native_equals_torch_path(bits, gs):
    g = torch.Generator().manual_seed(bits * 1000 + gs)
    w = torch.randn(67, 1000, generator=g) * torch.rand(67, 1, generator=g) * 3
    _assert_same(*_both(w, bits, gs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_native_equals_torch_path_for_every_input_dtype(dtype):
    # bf16 is read by the kernel in place; float16/float64 are converted to float32 first
    w = torch.randn(2, 5, 333, generator=torch.Generator().manual_seed(5)).to(dtype)
    fast, slow = _both(w, 3, 64)
    _assert_same(fast, slow)
    _assert_same(fast, quantize_tensor(w.to(torch.float32), 3, 64))


def test_native_equals_torch_path_with_importance_and_outliers():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(96, 512, generator=g)
    w[::7, ::13] *= 40  # outliers: the clip search has to choose
    w[5, :128] = 0.25  # a constant group
    imp = torch.rand(512, generator=g) ** 4 * 100
    for bits in (2, 4):
        _assert_same(*_both(w, bits, importance=imp))


def test_native_equals_torch_path_on_a_large_matrix():
    w = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    for bits in (2, 3, 4):
        _assert_same(*_both(w, bits))


def test_rows_split_across_threads_equal_one_call(monkeypatch):
    w = torch.randn(301, 384, generator=torch.Generator().manual_seed(4))  # odd row count
    with backend("native"):
        monkeypatch.setattr(row_kernels, "PARALLEL_MIN_ELEMENTS", 1 << 40)
        one = quantize_tensor(w, 3)
        monkeypatch.setattr(row_kernels, "PARALLEL_MIN_ELEMENTS", 0)
        split = quantize_tensor(w, 3)
    _assert_same(one, split)
    assert one.clip_improvement == split.clip_improvement


_PROBE = """
import hashlib, warnings, torch
from dynquant import quantize_tensor
from dynquant.numerics import native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = native.available()
qt = quantize_tensor(torch.randn(64, 300, generator=torch.Generator().manual_seed(1)), 3)
print(ok, hashlib.sha256(qt.qweight.numpy().tobytes() + qt.scales.view(torch.int16).numpy()
      .tobytes()).hexdigest(), "|".join(str(w.message) for w in caught), sep=";")
"""


def _start_probe(tmp_path, **env) -> subprocess.Popen:
    """A process with an empty cache of its own, building for the portable target: the build's
    steps (compile, link, atomic rename, load) are the same for every target, and the portable
    one compiles in a sixth of this machine's own (whose build every fresh clone's first kernel
    call makes, and test_packed_matvec's every-path test holds to the others)."""
    full = {**os.environ, "DYNQUANT_CACHE_DIR": str(tmp_path / "cache"),
            "DYNQUANT_NATIVE_ARCH": "x86-64", **env}
    full.pop("DYNQUANT_NATIVE", None)
    return subprocess.Popen([sys.executable, "-c", _PROBE], env=full, stdout=subprocess.PIPE,
                            text=True)


def _result(probe: subprocess.Popen) -> list[str]:
    out, _ = probe.communicate(timeout=300)
    assert probe.returncode == 0
    return out.strip().split(";", 2)


def test_fresh_cache_builds_and_no_compiler_falls_back_with_the_same_result(tmp_path):
    fresh = _start_probe(tmp_path)
    without = _start_probe(tmp_path / "other", CC="/nonexistent/cc")  # at the same time
    ok, digest, warned = _result(fresh)
    assert ok == "True" and warned == ""
    built = list((tmp_path / "cache" / "native").glob("*/" + native.LIBRARY_NAME))
    assert len(built) == 1
    assert list(built[0].parent.iterdir()) == built  # no temporary files left behind
    again = _result(_start_probe(tmp_path))  # loads the cached library
    assert again == [ok, digest, warned]
    ok2, digest2, warned2 = _result(without)
    assert ok2 == "False" and "native kernels unavailable" in warned2
    assert digest2 == digest


def test_a_build_that_needs_a_later_flag_set_says_why(tmp_path, monkeypatch):
    """A source the first flag set cannot compile (an unknown flag, or code the compiler rejects
    there) is built with the next one, and a warning names what failed: a slow portable library
    must never be the silent result of a compile error in the SIMD code."""
    source = tmp_path / "tiny.c"
    source.write_text("int dq_tiny(void) { return 7; }\n")
    monkeypatch.setattr(native, "SOURCES", (source,))
    monkeypatch.setattr(native, "_arch_flags", lambda: (("-mno-such-flag",), ()))
    with pytest.warns(RuntimeWarning, match="no -march flags.*-mno-such-flag"):
        path, why = native._build(os.environ.get("CC", "cc"), tmp_path / "lib")
    assert why == "" and ctypes.CDLL(str(path)).dq_tiny() == 7
    monkeypatch.setattr(native, "_arch_flags", lambda: ((),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first set builds: nothing to say
        assert native._build(os.environ.get("CC", "cc"), tmp_path / "lib2")[1] == ""


_FORK = """
import os, torch
from dynquant import quantize_tensor
from dynquant.numerics import packed_matvec, row_kernels
row_kernels.PARALLEL_MIN_ELEMENTS = 0  # every call uses the Python thread pool
packed_matvec.PARALLEL_MIN_ELEMENTS = 0  # and every matvec the native pool (pool.c)
w = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
x = torch.randn(1, 512)
a = quantize_tensor(w, 3)
y = packed_matvec.packed_matvec(x, a.qweight, a.scales, a.offsets, a.layout)
pid = os.fork()
if pid == 0:  # the child inherits the parents' pool objects, not their threads
    same = torch.equal(a.qweight, quantize_tensor(w, 3).qweight) and all(
        torch.equal(y, packed_matvec.packed_matvec(x, a.qweight, a.scales, a.offsets, a.layout))
        for _ in range(50))
    os._exit(0 if same else 1)
print(os.waitpid(pid, 0)[1])
"""


def test_a_forked_child_gets_its_own_thread_pools():
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True,
                         timeout=120, check=True)  # it hung forever with the parent's pool
    assert out.stdout.strip() == "0"


def test_near_ties_resolve_the_same_on_both_paths():
    # weights on a coarse grid make many clip candidates' errors equal to float32 rounding: the
    # winner then depends on the order of the error sums, which the format fixes (lane_sum)
    g = torch.Generator().manual_seed(0)
    for w in ((torch.randn(1024, 2048, generator=g) * 8).round() / 8,
              torch.randint(-8, 9, (1024, 2048), generator=g).float()):
        for bits in (2, 3, 4):
            fast, slow = _both(w, bits)
            _assert_same(fast, slow)


def test_lane_sum_is_the_formats_order():
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    expect = [[lane_sum_ref(row.numpy()) for row in block] for block in x]
    assert torch.equal(lane_sum(x), torch.tensor(expect))
    assert not torch.equal(lane_sum(x), x.sum(-1))  # another order gives other float32 bits
