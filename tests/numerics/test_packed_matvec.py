"""The kernels that read packed codes: the matvec held to the dequantize reference, the native
dequantization bit-identical to the torch path; their SIMD paths == their portable paths."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynquant import quantize_tensor
from dynquant.format.layout import LayerLayout
from dynquant.numerics import native, row_kernels
from dynquant.numerics import packed_matvec as packed_matvec_module
from dynquant.numerics.packed_matvec import (
    MAX_TOKENS,
    packed_gemm,
    packed_gemm_t,
    packed_matvec,
    packed_matvec_ref,
    packed_vecmat,
    packed_vecmat_ref,
    simd_path,
)
from dynquant.numerics.quantizer import dequantize_rows, dequantize_rows_torch
from dynquant.runtime.packed_modules import QuantLinear, _decode_product
from quantizer_backends import backend


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((ln.split() for ln in text.splitlines() if ln.startswith("flags")), []))


# What a build for one of these targets ($DYNQUANT_NATIVE_ARCH) unpacks with (v4 has no VBMI).
ARCH_PATHS = {"x86-64": "portable", "x86-64-v2": "portable", "x86-64-v3": "avx2",
              "x86-64-v4": "avx2"}


def test_the_simd_path_is_built_where_the_cpu_has_it():
    flags = _cpu_flags()
    expect = ("avx512vbmi" if {"avx512f", "avx512bw", "avx512vbmi"} <= flags else
              "avx2" if "avx2" in flags else "portable")
    assert simd_path() == ARCH_PATHS.get(os.environ.get("DYNQUANT_NATIVE_ARCH", ""), expect)


_KERNEL_OUTPUTS = """
import hashlib, torch
from dynquant import quantize_tensor
from dynquant.numerics import row_kernels
from dynquant.numerics.packed_matvec import packed_gemm, packed_matvec, packed_matvec_ref
from dynquant.numerics.packed_matvec import packed_gemm_t, packed_vecmat, packed_vecmat_ref
from dynquant.numerics.packed_matvec import packed_matvec_q8, packed_matvec_q16, q8_path
from dynquant.numerics.packed_matvec import simd_path
h = hashlib.sha256()
gemm_error = 0.0
g = torch.Generator().manual_seed(0)
for bits in (2, 3, 4, 5, 6, 8):
    for gs in (32, 128):
        w = (torch.randn(40, 300, generator=g) * 8).round() / 8
        qt = quantize_tensor(w, bits, gs)
        parts = [qt.qweight, qt.scales.view(torch.int16), qt.offsets.view(torch.int16)]
        for m in (1, 3, 6):
            parts.append(packed_matvec(torch.randn(m, 300, generator=g), qt.qweight, qt.scales,
                                       qt.offsets, qt.layout))
            parts.append(packed_vecmat(torch.randn(m, 40, generator=g), qt.qweight, qt.scales,
                                       qt.offsets, qt.layout))
            parts.append(packed_matvec_q8(torch.randn(m, 300, generator=g) * 3, qt.qweight,
                                          qt.scales, qt.offsets, qt.layout))
            if bits <= 6:
                parts.append(packed_matvec_q16(torch.randn(m, 300, generator=g), qt.qweight,
                                               qt.scales, qt.offsets, qt.layout))
        parts.append(row_kernels.dequantize_rows(qt.qweight, qt.scales, qt.offsets, bits, gs, 300,
                                                 torch.bfloat16).view(torch.int16))
        for t in parts:
            h.update(t.contiguous().numpy().tobytes())
        x = torch.randn(21, 300, generator=g)  # the GEMM's tile differs by build: a tolerance
        ref = packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        y = packed_gemm(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        gemm_error = max(gemm_error, ((y - ref).abs().max() / ref.abs().max()).item())
        x = torch.randn(21, 40, generator=g)
        ref = packed_vecmat_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        y = packed_gemm_t(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        gemm_error = max(gemm_error, ((y - ref).abs().max() / ref.abs().max()).item())
print(simd_path(), q8_path(), h.hexdigest(), gemm_error)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 targets (-march=x86-64-v3)")
def test_every_unpack_path_gives_the_same_bits():
    """The AVX2 and portable builds (not this machine's own) against the default build; the
    int8 products too (VNNI where this CPU has it, vpmaddubsw in the AVX2 build)."""
    outputs, q8_paths, runs = {}, set(), []
    for arch in ("", "x86-64-v3", "x86-64"):  # at once; each build in dynquant's own cache
        env = {**os.environ, "DYNQUANT_NATIVE_ARCH": arch}
        env.pop("DYNQUANT_NATIVE", None)
        runs.append(subprocess.Popen([sys.executable, "-c", _KERNEL_OUTPUTS], env=env,
                                     stdout=subprocess.PIPE, text=True))
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0
        path, q8, digest, gemm_error = out.split()
        outputs[path] = digest
        q8_paths.add(q8)
        assert float(gemm_error) < 1e-6, (path, gemm_error)
    assert {"avx2", "portable"} <= set(outputs) and {"avx2", "portable"} <= q8_paths
    assert ("vnni" in q8_paths) == bool({"avx_vnni", "avx512_vnni"} & _cpu_flags())
    assert len(set(outputs.values())) == 1, outputs


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_matvec_matches_the_reference_and_the_portable_path(bits, gs):
    g = torch.Generator().manual_seed(bits * 100 + gs)
    w = torch.randn(45, 300, generator=g)  # 300: the last group is padded
    qt = quantize_tensor(w, bits, gs)
    for m in (1, 2, 3, 5, MAX_TOKENS):  # the few-token kernels: 1 and 2 passes (AVX2: 4 a pass)
        x = torch.randn(m, 300, generator=g)
        ref = packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        fast = packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        portable = packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(fast, portable)  # same lanes, same tree: bit-identical


def test_matvec_on_a_row_block_and_across_threads(monkeypatch):
    monkeypatch.setattr(packed_matvec_module, "PARALLEL_MIN_ELEMENTS", 0)  # every call split
    w = torch.randn(1037, 1024, generator=torch.Generator().manual_seed(1))
    qt = quantize_tensor(w, 3)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(2))
    whole = packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    torch.testing.assert_close(whole, packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets,
                                                        qt.layout), rtol=1e-5, atol=1e-3)
    block = packed_matvec(x, qt.qweight[500:600], qt.scales[500:600], qt.offsets[500:600],
                          qt.layout)
    assert torch.equal(block, whole[:, 500:600])  # rows are independent of the split


def _linear(bits: int, out: int = 96, inp: int = 200) -> tuple[QuantLinear, torch.Tensor]:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(bits))
    qt = quantize_tensor(w, bits)
    lin = QuantLinear(LayerLayout.create((out, inp), bits, 128), bias=torch.randn(out))
    lin.qweight, lin.scales, lin.offsets = qt.qweight, qt.scales, qt.offsets
    lin.prepare()
    return lin, qt.dequantize(torch.float32)


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_quant_linear_uses_the_packed_product_for_decode_and_blocks_for_prefill(bits):
    from dynquant.runtime.packed_modules import BF16_GEMM_MAX_TOKENS

    lin, w = _linear(bits)
    decode = torch.randn(1, 1, 200)
    prefill = torch.randn(1, MAX_TOKENS + 1, 200)
    for x in (decode, prefill):
        expect = x @ w.T + lin.bias
        torch.testing.assert_close(lin(x), expect, rtol=1e-5, atol=1e-4)  # float32 in, out
    # float32: the matvec, and the packed GEMM past MAX_TOKENS; long bf16 prefills: row blocks
    assert lin.matvec(decode) is not None and lin.matvec(prefill) is not None
    long_bf16 = torch.randn(1, BF16_GEMM_MAX_TOKENS + 1, 200).to(torch.bfloat16)
    assert lin.matvec(long_bf16) is None
    torch.testing.assert_close(lin(long_bf16).float(), long_bf16.float() @ w.T + lin.bias,
                               rtol=0.02, atol=0.3)
    with backend("torch"):  # no native kernels: the dequantize path answers the same
        assert lin.matvec(decode) is None
        torch.testing.assert_close(lin(decode), decode @ w.T + lin.bias, rtol=1e-5, atol=1e-4)
    y = lin(decode.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (1, 1, 96)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_native_dequantize_is_bit_identical_to_the_torch_path(bits, gs):
    w = torch.randn(33, 300, generator=torch.Generator().manual_seed(bits + gs)) * 7
    qt = quantize_tensor(w, bits, gs)
    args = (qt.qweight, qt.scales, qt.offsets, bits, gs, 300)
    for dtype in (torch.float32, torch.bfloat16):
        slow = dequantize_rows_torch(*args, dtype)
        fast = row_kernels.dequantize_rows(*args, dtype)
        portable = row_kernels.dequantize_rows(*args, dtype, portable=True)
        assert fast.dtype == dtype and torch.equal(fast, slow) and torch.equal(portable, slow)
        assert torch.equal(dequantize_rows(*args, dtype), slow)  # the public entry uses it
    assert row_kernels.dequantize_rows(*args, torch.float16) is None  # other dtypes: torch path
    tiny = qt.scales.clone(), qt.offsets.clone()  # denormal and overflowing values
    tiny[0][0], tiny[1][0] = torch.tensor(1e-39, dtype=torch.bfloat16), 0.0
    tiny[0][1], tiny[1][1] = 2e-38, -1e-38
    tiny[0][2, 0], tiny[1][2, 0] = 3e38, 3e38
    odd = (qt.qweight, *tiny, bits, gs, 300)
    assert torch.equal(row_kernels.dequantize_rows(*odd, torch.bfloat16).view(torch.int16),
                       dequantize_rows_torch(*odd, torch.bfloat16).view(torch.int16))
    big = quantize_tensor(torch.randn(1100, 1024), bits, gs)  # split across threads
    args = (big.qweight, big.scales, big.offsets, bits, gs, 1024)
    assert torch.equal(row_kernels.dequantize_rows(*args, torch.bfloat16),
                       dequantize_rows_torch(*args, torch.bfloat16))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 128])
def test_vecmat_matches_the_reference_and_the_portable_path(bits, gs, monkeypatch):
    g = torch.Generator().manual_seed(bits * 10 + gs)
    w = torch.randn(70, 300, generator=g)  # x @ W: contracts the 70 rows, groups along 300
    qt = quantize_tensor(w, bits, gs)
    for m in (1, 3, 6, MAX_TOKENS):  # tokens go four at a time: every remainder
        x = torch.randn(m, 70, generator=g)
        ref = packed_vecmat_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        fast = packed_vecmat(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        portable = packed_vecmat(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
        assert fast.shape == (m, 300)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(fast, portable)
    monkeypatch.setattr(packed_matvec_module, "VECMAT_PARALLEL_MIN_ELEMENTS", 0)  # groups split
    big = quantize_tensor(torch.randn(1024, 1100, generator=g), bits, gs)
    x = torch.randn(2, 1024, generator=g)
    torch.testing.assert_close(packed_vecmat(x, big.qweight, big.scales, big.offsets, big.layout),
                               packed_vecmat_ref(x, big.qweight, big.scales, big.offsets,
                                                 big.layout), rtol=1e-5, atol=1e-3)


def test_the_kernels_refuse_blocks_that_do_not_fit_their_layout():
    qt = quantize_tensor(torch.randn(16, 256), 3)
    lay = qt.layout
    bad = [(qt.qweight[:, :-1], qt.scales, qt.offsets), (qt.qweight, qt.scales.float(), qt.offsets),
           (qt.qweight, qt.scales, qt.offsets[:8]), (qt.qweight.view(torch.uint8), qt.scales,
                                                      qt.offsets)]
    x = torch.randn(1, 256)
    for block in bad:
        with pytest.raises(ValueError, match="not a packed block"):
            packed_matvec(x, *block, lay)
        with pytest.raises(ValueError, match="not a packed block"):
            row_kernels.dequantize_rows(*block, 3, 128, 256, torch.float32)
    with pytest.raises(ValueError, match=r"\[tokens, 256\]"):
        packed_matvec(torch.randn(1, 255), qt.qweight, qt.scales, qt.offsets, lay)
    with pytest.raises(ValueError, match=r"\[tokens, 16\]"):
        packed_vecmat(torch.randn(1, 256), qt.qweight, qt.scales, qt.offsets, lay)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 128])
def test_packed_gemm_matches_the_reference(bits, gs, monkeypatch):
    """Many tokens (prefill) times a packed matrix: float32 sums in another order than the
    BLAS, so held to the reference within float32 rounding; the SIMD and portable unpacking
    give the same bits, and any split of rows across threads too."""
    g = torch.Generator().manual_seed(bits * 7 + gs)
    w = torch.randn(77, 300, generator=g)  # rows not a multiple of the tile, padded columns
    qt = quantize_tensor(w, bits, gs)
    for m in (MAX_TOKENS + 1, 13, 64):  # tokens not a multiple of the tile either
        x = torch.randn(m, 300, generator=g)
        ref = packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        fast = packed_gemm(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        assert fast.shape == (m, 77)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)
        portable = packed_gemm(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
        assert torch.equal(fast, portable)
    monkeypatch.setattr(packed_matvec_module, "GEMM_PARALLEL_MIN_MACS", 0)  # every call split
    whole = packed_gemm(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    block = packed_gemm(x, qt.qweight[30:50], qt.scales[30:50], qt.offsets[30:50], qt.layout)
    assert torch.equal(block, whole[:, 30:50]) and torch.equal(whole, fast)


@pytest.mark.parametrize("gs", [32, 128])
def test_packed_gemm_leaves_the_padding_out_with_the_same_bits(gs):
    """An in_features the kernels' vectors fit (336 = 21 x 16, padded to 352 / 384): x goes in
    unpadded and the padding's columns are not multiplied; the product has the bits of x padded
    with zeros through the whole padded width (adding 0 * w changes no sum), for the strips
    (many tokens) and the dot form (few)."""
    lib = native.library()
    g = torch.Generator().manual_seed(gs)
    qt = quantize_tensor(torch.randn(40, 336, generator=g), 3, gs)
    lay = qt.layout
    assert lay.padded_in_features > lay.in_features
    for m in (3, 64):
        x = torch.randn(m, 336, generator=g)
        padded = torch.nn.functional.pad(x, (0, lay.padded_in_features - 336))
        outs = []
        for xs in (x, padded):
            y = torch.empty(m, 40)
            assert lib.dq_gemm_mt(qt.qweight.data_ptr(), qt.scales.data_ptr(),
                                  qt.offsets.data_ptr(), 40, lay.padded_in_features, gs, 3,
                                  xs.data_ptr(), xs.shape[1], m, y.data_ptr(), 40, 0, 1) == 0
            outs.append(y)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(packed_gemm(x, qt.qweight, qt.scales, qt.offsets, lay), outs[0])
        torch.testing.assert_close(outs[0], packed_matvec_ref(x, qt.qweight, qt.scales,
                                                              qt.offsets, lay),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 128])
def test_packed_gemm_t_matches_the_reference(bits, gs, monkeypatch):
    """x @ W with many tokens for W stored in groups along its output dimension (expert banks):
    held to the reference; portable unpacking and any split of groups give the same bits."""
    g = torch.Generator().manual_seed(bits * 3 + gs)
    w = torch.randn(70, 300, generator=g)  # contracts the 70 rows, groups along 300 (padded)
    qt = quantize_tensor(w, bits, gs)
    for m in (MAX_TOKENS + 1, 13, 40):
        x = torch.randn(m, 70, generator=g)
        ref = packed_vecmat_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        fast = packed_gemm_t(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
        assert fast.shape == (m, 300)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)
        portable = packed_gemm_t(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
        assert torch.equal(fast, portable)
    monkeypatch.setattr(packed_matvec_module, "GEMM_PARALLEL_MIN_MACS", 0)  # groups split
    assert torch.equal(packed_gemm_t(x, qt.qweight, qt.scales, qt.offsets, qt.layout), fast)


@pytest.mark.parametrize("rows, cols", [(600, 2048), (70, 4160)])
def test_packed_gemm_on_a_large_matrix_stays_within_float32_rounding(rows, cols):
    """Panels of rows (the kernel takes a few rows at a time) and long rows (4160: the strips'
    column chunks, 1024-4096 by build, end in a part): relative error of the whole product
    against float64 stays at float32 rounding."""
    g = torch.Generator().manual_seed(11)
    qt = quantize_tensor(torch.randn(rows, cols, generator=g), 3)
    x = torch.randn(40, cols, generator=g)
    exact = x.double() @ qt.dequantize(torch.float32).double().T
    y = packed_gemm(x, qt.qweight, qt.scales, qt.offsets, qt.layout).double()
    blas = x @ qt.dequantize(torch.float32).T
    ours = ((y - exact).abs().max() / exact.abs().max()).item()
    assert ours < 1e-6 and ours < 2 * ((blas - exact).abs().max() / exact.abs().max()).item()


def test_the_one_token_fast_path_gives_the_kernels_bits_and_follows_new_buffers():
    lin, _ = _linear(3, out=96, inp=256)
    x = torch.randn(1, 1, 256)
    general = packed_matvec(x[0], lin.qweight, lin.scales, lin.offsets, lin.layout)
    assert torch.equal(lin.matvec(x)[0], general) and "matvec-float32" in lin._kept_calls
    xb = x.to(torch.bfloat16)  # bf16 activations: through float32, as the general path does
    y = lin.matvec(xb)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 1, 96)
    expect_bf16 = _decode_product(packed_matvec, xb, lin.qweight, lin.scales, lin.offsets,
                                  lin.layout)
    assert torch.equal(y, expect_bf16)
    other = quantize_tensor(torch.randn(96, 256), 3)
    lin.qweight, lin.scales, lin.offsets = other.qweight, other.scales, other.offsets
    expect = packed_matvec(x[0], other.qweight, other.scales, other.offsets, other.layout)
    assert torch.equal(lin.matvec(x)[0], expect)  # rebuilt for the new buffers
    padded, _ = _linear(3, out=40, inp=200)  # 200 inputs in two groups of 128: padded to 256
    x = torch.randn(1, 1, 200)
    general = packed_matvec(x[0], padded.qweight, padded.scales, padded.offsets, padded.layout)
    assert torch.equal(padded.matvec(x)[0], general) and "matvec-float32" in padded._kept_calls


def test_the_native_pool_splits_any_count_of_parts_and_keeps_the_bits(monkeypatch):
    """pool.c: every thread count (parts larger than the work included), many jobs in a row (a
    worker that sleeps between them and one that spins), the same bits as one thread."""
    import time

    qt = quantize_tensor(torch.randn(37, 512, generator=torch.Generator().manual_seed(3)), 3)
    x = torch.randn(1, 512)
    one = packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    monkeypatch.setattr(packed_matvec_module, "PARALLEL_MIN_ELEMENTS", 0)
    for threads in (2, 3, 8, 64):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        for i in range(20):
            assert torch.equal(packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout), one)
            if i % 5 == 0:
                time.sleep(0.001)  # past the workers' spin: they sleep and are woken
    lib = native.library()
    lib.dq_pool_hold(1)  # a native step's hold: waits spin up to a millisecond
    try:
        for i in range(10):
            assert torch.equal(packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout), one)
            if i % 5 == 0:
                time.sleep(0.003)  # past even a held wait: the workers sleep and are woken
    finally:
        lib.dq_pool_hold(0)
    time.sleep(0.001)
    assert torch.equal(packed_matvec(x, qt.qweight, qt.scales, qt.offsets, qt.layout), one)
