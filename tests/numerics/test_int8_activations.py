"""int8 activations: the token quantized in blocks of 32 and multiplied with the packed codes as
integers (``native/packed_matvec_q8.c``). The quantizer and the integer dot products against
exact references, the whole product bit for bit against its operation-by-operation reference in
every build, and the modules and models that use it."""

from __future__ import annotations

import pytest
import torch

from dynquant import quantize_tensor
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import pack_codes
from dynquant.numerics import packed_matvec as packed_matvec_module
from dynquant.numerics.packed_matvec import (
    Q8_BLOCK,
    group_dots,
    group_dots_ref,
    packed_matvec_q8,
    packed_matvec_q8_ref,
    packed_matvec_q16,
    packed_matvec_ref,
    quantize_activations,
    quantize_activations_ref,
)
from dynquant.runtime.activations import resolve_activations, use_activations
from dynquant.runtime.packed_modules import QuantExpertBank, QuantLinear
from dynquant.runtime.product_paths import Activations, product_path
from quantizer_backends import backend

WIDTHS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def _token(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[3] = 25.0  # an outlier channel, as real models have
    return x


def test_the_activation_quantizer_matches_its_reference():
    x = torch.randn(8 * Q8_BLOCK, generator=torch.Generator().manual_seed(0)) * 4
    x[:Q8_BLOCK] = 0.0  # an all-zero block
    x[Q8_BLOCK:2 * Q8_BLOCK] = 1e-35  # below the smallest block scale: zeros
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.0])  # scale exactly 1
    x[2 * Q8_BLOCK:2 * Q8_BLOCK + 8] = ties
    x[2 * Q8_BLOCK + 8:3 * Q8_BLOCK] = 0.0
    xq, d = quantize_activations(x)
    ref_q, ref_d = quantize_activations_ref(x)
    assert torch.equal(xq, ref_q) and torch.equal(d, ref_d)
    assert xq.dtype == torch.int8 and d.shape == (8,)
    assert torch.equal(xq[2 * Q8_BLOCK:2 * Q8_BLOCK + 8].long(),
                       torch.tensor([127, 0, 2, 2, 0, -2, -126, 3]))  # ties to even
    assert not xq[:2 * Q8_BLOCK].any() and d[0] == 0 and d[1] == 0
    blocks = x.view(-1, Q8_BLOCK)
    assert torch.equal(d, blocks.abs().amax(1) / 127 * (blocks.abs().amax(1) >= 1e-30))
    err = (xq.float().view(-1, Q8_BLOCK) * d[:, None] - blocks).abs()
    assert (err <= d[:, None] * 0.5 * (1 + 1e-6) + 1e-30).all()  # half a step (or a tiny block)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("gs", GROUPS)
def test_integer_dot_products_equal_the_int64_reference(bits, gs):
    """Per (row, group), SIMD and portable, including the largest codes against +-127 (where
    vpmaddubsw would saturate without the kernels' nibble split at 8 bits)."""
    g = torch.Generator().manual_seed(bits * 1000 + gs)
    qt = quantize_tensor(torch.randn(19, 320, generator=g), bits, gs)
    n = qt.layout.padded_in_features
    xq = torch.randint(-127, 128, (n,), generator=g, dtype=torch.int8)
    xq[:128] = 127
    xq[128:256] = -127
    top = (1 << bits) - 1  # every code at its largest, then alternating with zero
    codes_max = pack_codes(torch.full((19, n), top, dtype=torch.uint8), bits)
    codes_alt = pack_codes((torch.arange(19 * n) % 2 * top).to(torch.uint8).view(19, n), bits)
    for q in (qt.qweight, codes_max, codes_alt):
        ref = group_dots_ref(xq, q, qt.layout)
        for portable in (False, True):
            assert torch.equal(group_dots(xq, q, qt.layout, portable).long(), ref)
    assert group_dots_ref(xq, codes_max, qt.layout)[0, 0] == top * 127 * gs


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("gs", GROUPS)
def test_the_int8_product_is_its_reference_bit_for_bit(bits, gs):
    g = torch.Generator().manual_seed(bits * 100 + gs)
    qt = quantize_tensor(torch.randn(45, 300, generator=g), bits, gs)  # 300: padded groups
    x = torch.stack([_token(300, seed) for seed in range(3)])
    fast = packed_matvec_q8(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    portable = packed_matvec_q8(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
    ref = torch.stack([packed_matvec_q8_ref(t, qt.qweight, qt.scales, qt.offsets, qt.layout)
                       for t in x])
    assert torch.equal(fast, ref) and torch.equal(portable, ref)
    exact = packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    # int8's own error: the outlier's block quantizes in steps of 25 / 127
    assert ((fast - exact).norm() / exact.norm()).item() < 0.02


def test_the_int8_product_across_threads_and_row_blocks(monkeypatch):
    qt = quantize_tensor(torch.randn(1037, 1024, generator=torch.Generator().manual_seed(1)), 3)
    x = torch.stack([_token(1024, 7), _token(1024, 8)])
    whole = packed_matvec_q8(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    monkeypatch.setattr(packed_matvec_module, "PARALLEL_MIN_ELEMENTS", 0)
    for threads in (2, 3, 8):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        assert torch.equal(packed_matvec_q8(x, qt.qweight, qt.scales, qt.offsets, qt.layout),
                           whole)
    block = packed_matvec_q8(x, qt.qweight[500:600], qt.scales[500:600], qt.offsets[500:600],
                             qt.layout)
    assert torch.equal(block, whole[:, 500:600])


def _linear(bits: int, out: int, inp: int) -> QuantLinear:
    qt = quantize_tensor(torch.randn(out, inp, generator=torch.Generator().manual_seed(bits)),
                         bits)
    lin = QuantLinear(LayerLayout.create((out, inp), bits, 128), torch.randn(out),
                      torch.float32)
    lin.qweight, lin.scales, lin.offsets = qt.qweight, qt.scales, qt.offsets
    return lin


def test_modules_multiply_with_int8_activations_when_asked():
    lin = _linear(3, 96, 200)
    g = torch.Generator().manual_seed(6)
    one, few, many = (torch.randn(1, n, 200, generator=g) for n in (1, 4, 20))
    float_one = lin(one)
    lin.activations = Activations("int8")
    for x in (one, few):
        want = packed_matvec_q8(x[0], lin.qweight, lin.scales, lin.offsets, lin.layout)
        assert torch.equal(lin(x)[0], want + lin.bias)
    assert "matvec-int8" in lin._kept_calls  # the one-token prepared call
    assert not torch.equal(lin(one), float_one)
    assert ((lin(one) - float_one).norm() / float_one.norm()).item() < 0.01
    prefill = lin(many)  # prefill keeps the float32 GEMM ...
    lin.activations = Activations()
    assert torch.equal(prefill, lin(many))
    lin.activations = Activations("int8", every_token=True)  # ... unless every token is asked for
    assert torch.equal(lin(many)[0], packed_matvec_q8(many[0], lin.qweight, lin.scales,
                                                      lin.offsets, lin.layout) + lin.bias)
    with backend("torch"):  # no native kernels: the dequantized float product
        lin.activations = Activations()
        expect = lin(one)
        lin.activations = Activations("int8")
        assert torch.equal(lin(one), expect)


@pytest.mark.parametrize("kind", ["int8", "int16"])
def test_an_expert_banks_pairs_use_integer_activations_when_asked(kind):
    bits = 4 if kind == "int8" else 3  # auto's choice for each
    w = torch.randn(5, 64, 200, generator=torch.Generator().manual_seed(4))
    qt = quantize_tensor(w, bits)
    bank = QuantExpertBank(LayerLayout.create((5, 64, 200), bits, 128), torch.float32)
    bank.qweight, bank.scales, bank.offsets = qt.qweight, qt.scales, qt.offsets
    bank.activations = Activations(kind)
    product = packed_matvec_q8 if kind == "int8" else packed_matvec_q16
    ids = torch.tensor([4, 0, 4, 2])
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(5))
    got = bank.pairs_linear(x, ids)
    per = qt.qweight.shape[0] // 5
    for p, e in enumerate(ids.tolist()):
        rows = slice(e * per, (e + 1) * per)
        want = product(x[p:p + 1], qt.qweight[rows], qt.scales[rows], qt.offsets[rows],
                       bank.layout)
        assert torch.equal(got[p], want[0])
    assert f"pairs-True-{kind}" in bank._kept_calls
    out = torch.randn(4, 64)  # x @ W[e] contracts over rows: float32 products stay
    bank_float = bank.pairs_matmul(out, ids)
    bank.activations = Activations()
    assert torch.equal(bank.pairs_matmul(out, ids), bank_float)


def test_the_activations_setting(monkeypatch):
    monkeypatch.delenv("DYNQUANT_ACTIVATIONS", raising=False)
    from dynquant.numerics.packed_matvec import q8_path

    auto = "auto" if q8_path() in ("vnni", "avx2") else "float"  # SIMD integer dot products
    assert resolve_activations() == resolve_activations("auto") == auto
    with backend("torch"):  # no kernels: float
        assert resolve_activations() == "float"
    assert resolve_activations("int8") == "int8"
    monkeypatch.setenv("DYNQUANT_ACTIVATIONS", "int8")
    assert resolve_activations(None) == "int8" and resolve_activations("float") == "float"
    monkeypatch.setenv("DYNQUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="DYNQUANT_ACTIVATIONS must be one of"):
        resolve_activations()
    with pytest.raises(ValueError, match="activations must be one of"):
        resolve_activations("fp8")
    model = torch.nn.Sequential(_linear(2, 8, 64), torch.nn.ReLU(), _linear(4, 8, 8))
    assert use_activations(model, "int8") == "int8"
    assert model[0].activations == model[2].activations == Activations("int8")
    use_activations(model, "float", every_token=True)
    assert model[0].activations == model[2].activations == Activations()  # nothing to every token
    monkeypatch.setenv("DYNQUANT_ACTIVATIONS", "auto")
    if use_activations(model) == "auto":  # by width: the 2-bit module takes int16
        assert model[0].activations.kind == "int16" and model[2].activations.kind == "int8"


@pytest.mark.parametrize("gs", GROUPS)
def test_the_int16_quantizer_matches_its_reference(gs):
    """int16 tokens are quantized per group of the layout (one scale a group)."""
    x = torch.randn(6 * 128, generator=torch.Generator().manual_seed(9)) * 3
    x[:gs] = 0.0  # an all-zero group
    x[gs] = 40.0
    xq, d = quantize_activations(x, torch.int16, gs)
    ref_q, ref_d = quantize_activations_ref(x, torch.int16, gs)
    assert xq.dtype == torch.int16 and torch.equal(xq, ref_q) and torch.equal(d, ref_d)
    assert d.shape == (6 * 128 // gs,) and d[0] == 0 and torch.isclose(d[1], torch.tensor(40 / 32767))
    assert xq.abs().max() == 32767 and not xq[:gs].any()
    # half a step, plus float32's rounding of x * (32767 / amax): up to ~2^-24 * 32767 of a step
    err = (xq.float().view(-1, gs) * d[:, None] - x.view(-1, gs)).abs()
    assert (err <= d[:, None] * (0.5 + 4e-3)).all()
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_activations(x, torch.int8, gs * 2)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("gs", GROUPS)
def test_int16_dot_products_and_product_equal_their_references(bits, gs):
    """int16 activations (the default for modules under 4 bits): integer dots against int64,
    SIMD and portable, the largest codes against +32767 and -32767 included; the product bit for bit
    against its reference, and within float32-like error of the exact product."""
    g = torch.Generator().manual_seed(bits * 10 + gs)
    qt = quantize_tensor(torch.randn(19, 320, generator=g), bits, gs)
    n = qt.layout.padded_in_features
    xq = torch.randint(-32767, 32768, (n,), generator=g, dtype=torch.int16)
    xq[:128] = 32767  # the largest sums a lane holds (2 and 3 bits: before their shifts)
    xq[128:256] = -32767
    top = (1 << bits) - 1
    codes_max = pack_codes(torch.full((19, n), top, dtype=torch.uint8), bits)
    for q in (qt.qweight, codes_max):
        ref = group_dots_ref(xq, q, qt.layout)
        for portable in (False, True):
            assert torch.equal(group_dots(xq, q, qt.layout, portable).long(), ref)
    assert group_dots_ref(xq, codes_max, qt.layout)[0, 0] == top * 32767 * gs
    x = torch.stack([_token(320, seed) for seed in range(3)])
    fast = packed_matvec_q16(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    portable = packed_matvec_q16(x, qt.qweight, qt.scales, qt.offsets, qt.layout, portable=True)
    ref = torch.stack([packed_matvec_q8_ref(t, qt.qweight, qt.scales, qt.offsets, qt.layout,
                                            torch.int16) for t in x])
    assert torch.equal(fast, ref) and torch.equal(portable, ref)
    exact = packed_matvec_ref(x, qt.qweight, qt.scales, qt.offsets, qt.layout)
    assert ((fast - exact).norm() / exact.norm()).item() < 1e-4


def test_modules_multiply_with_int16_activations_when_asked():
    lin = _linear(3, 96, 200)
    x = torch.randn(1, 1, 200, generator=torch.Generator().manual_seed(10))
    lin.activations = Activations("int16")
    want = packed_matvec_q16(x[0], lin.qweight, lin.scales, lin.offsets, lin.layout)
    assert torch.equal(lin(x)[0], want + lin.bias) and "matvec-int16" in lin._kept_calls
    lin.activations = Activations("int8")
    assert torch.equal(lin(x)[0], packed_matvec_q8(x[0], lin.qweight, lin.scales, lin.offsets,
                                                   lin.layout) + lin.bias)


def test_the_widths_registry_picks_each_module_s_kernels():
    """One function picks a module's products from the registry: the asked activations where the
    width's kernels take them (int16: 2-6 bits), else float32; prefills take the float32 GEMM
    unless every token is asked for."""
    from dynquant.format.widths import SUPPORTED_BITS, width
    from dynquant.numerics.packed_matvec import packed_gemm, packed_matvec

    assert width(6).activations == ("float32", "int8", "int16")
    assert width(8).activations == ("float32", "int8")
    for bits in SUPPORTED_BITS:
        for kind in ("float32", "int8", "int16"):
            path = product_path(bits, Activations(kind))
            assert path.activations == (kind if kind in width(bits).activations else "float32")
            assert path.many_tokens is packed_gemm
    assert product_path(8, Activations("int16")).few_tokens is packed_matvec
    assert product_path(3, Activations("int16")).few_tokens is packed_matvec_q16
    assert product_path(3, Activations("int8", every_token=True)).many_tokens is packed_matvec_q8
    assert product_path(3, Activations("float32", every_token=True)).many_tokens is packed_gemm
    with pytest.raises(ValueError, match="activations must be one of"):
        Activations("fp8")
    lin = _linear(8, 32, 64)  # an 8-bit module asked for int16 multiplies float32 activations
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(1))
    expect = lin(x)
    lin.activations = Activations("int16")
    assert torch.equal(lin(x), expect) and "matvec-float32" in lin._kept_calls
