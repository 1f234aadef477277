"""Packed modules against the dequantize reference; resident memory; the int4 fast path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynquant import CheckpointError, quantize_tensor, write_checkpoint
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import unpack_codes
from dynquant.models.hybrid.modeling import DynquantHybridForCausalLM
from dynquant.models.presets import preset_config
from dynquant.models.sources import resolve_model
from dynquant.numerics import row_kernels
from dynquant.numerics.packed_matvec import MAX_TOKENS
from dynquant.numerics.quantizer import dequantize_rows
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.demo import demo_widths
from dynquant.runtime import packed_modules
from dynquant.runtime.int4_cpu import (
    dequantize_int4_rows,
    int4_linear,
    layout_block_rows,
    layout_is_known,
    pack_int4,
    unpack_int4_codes,
)
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.memory import resident_weight_nbytes
from dynquant.runtime.packed_modules import (
    BF16_GEMM_MAX_TOKENS,
    PackedExpert,
    QuantEmbedding,
    QuantExpertBank,
    QuantLinear,
    TiedQuantHead,
)
from quantizer_backends import backend


def _packed(cls, w: torch.Tensor, bits: int, gs: int = 128, **kw):
    qt = quantize_tensor(w, bits, gs)
    module = cls(LayerLayout.create(tuple(w.shape), bits, gs), **kw)
    module.qweight, module.scales, module.offsets = qt.qweight, qt.scales, qt.offsets
    return module, qt


def test_int4_kernel_matches_the_dequantize_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 512, generator=g)
    lin, qt = _packed(QuantLinear, w, 4)
    assert lin.use_int4
    x = torch.randn(3, 5, 512, generator=g).to(torch.bfloat16)
    ref = x.float() @ qt.dequantize(torch.float32).T
    lin.prepare()
    assert lin._int4 is not None
    y = lin(x)
    assert y.shape == (3, 5, 192) and y.dtype == torch.bfloat16
    # bf16 tolerance: the kernel takes bf16 zero points and accumulates bf16 activations
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2
    # the weights read back from the kernel's layout are exactly the format's
    assert layout_is_known()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(lin.dequantize(dtype), qt.dequantize(dtype))


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_read_from_the_int4_layout_are_the_formats(native_on, threads, monkeypatch):
    """The kernel's layout read back by the native kernel (on one thread, and split by blocks over
    two) and by the plain reference: the format's values bit for bit, for whole blocks, a last
    block of 16 rows and row ranges that cut blocks."""
    monkeypatch.setenv("DYNQUANT_NATIVE", native_on)
    monkeypatch.setattr(row_kernels, "DEQUANT_PARALLEL_MIN_ELEMENTS", 1 if threads == 2 else 1 << 40)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(208, 256, generator=g)  # 3 blocks of 64 rows (6 of 32) and one of 16
    qt = quantize_tensor(w, 4, 64)
    codes = unpack_codes(qt.qweight, 4).to(torch.int32)
    packed, scale_zero = pack_int4(qt.qweight, qt.scales, qt.offsets)
    block_rows = layout_block_rows()  # 64 with torch's AVX-512 kernels, 32 with AVX2
    assert block_rows in (64, 32)
    assert torch.equal(unpack_int4_codes(packed, 208, 256, block_rows), codes)
    for dtype in (torch.float32, torch.bfloat16):
        full = qt.dequantize(dtype)
        for start, stop in ((0, 208), (5, 200), (64, 128), (190, 208), (31, 33)):
            rows = dequantize_int4_rows(packed, scale_zero, qt.offsets, 64, start, stop, dtype)
            assert torch.equal(rows, full[start:stop]), (dtype, start, stop)


def test_long_bf16_prefills_of_int4_modules_multiply_dequantized_blocks():
    """Past BF16_GEMM_MAX_TOKENS tokens a 4-bit module on the int4 kernel multiplies its exact
    dequantized weights with the bf16 GEMM (the kernel is ~2.7x slower there); fewer tokens
    keep the kernel (bf16 zero points: not the same bits)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 384, generator=g)
    bias = torch.randn(256, generator=g).to(torch.bfloat16)
    lin, qt = _packed(QuantLinear, w, 4, bias=bias)
    lin.prepare()
    assert lin._int4 is not None and lin.scales.numel() == 0 and lin.offsets.numel() == 256 * 3
    wb = qt.dequantize(torch.bfloat16)
    long = torch.randn(1, BF16_GEMM_MAX_TOKENS + 1, 384, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(long), F.linear(long, wb) + bias)
    short = long[:, :BF16_GEMM_MAX_TOKENS]
    kernel = int4_linear(short, *lin._int4, 128) + bias
    assert torch.equal(lin(short), kernel)
    assert not torch.equal(kernel, F.linear(short, wb) + bias)
    # its resident bytes: the kernel's copy and our offsets
    assert lin.resident_nbytes() == sum(t.numel() * t.element_size()
                                        for t in (*lin._int4, lin.offsets, lin.bias))


def test_dequantize_path_for_other_widths_and_bias():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 100, generator=g)
    bias = torch.randn(24, generator=g)
    lin, qt = _packed(QuantLinear, w, 3, bias=bias, compute_dtype=torch.float32)
    lin.prepare()
    assert lin._int4 is None
    x = torch.randn(4, 100, generator=g)
    torch.testing.assert_close(lin(x), x @ qt.dequantize(torch.float32).T + bias)


def test_embedding_dequantizes_only_looked_up_rows(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1000, 64, generator=g)
    emb, qt = _packed(QuantEmbedding, w, 4, compute_dtype=torch.float32)
    ids = torch.tensor([[5, 999, 5], [0, 17, 3]])
    table = qt.dequantize(torch.float32)
    rows = []

    def counting(qweight, *args, **kwargs):
        rows.append(qweight.shape[0])
        return dequantize_rows(qweight, *args, **kwargs)

    monkeypatch.setattr(packed_modules, "dequantize_rows", counting)
    looked_up = emb(ids)
    assert rows == [6]  # one call for the six ids, none for the other 994 rows
    torch.testing.assert_close(looked_up, table[ids], atol=0, rtol=0)
    head = TiedQuantHead(emb)
    h = torch.randn(2, 64, generator=g)
    torch.testing.assert_close(head(h), h @ table.T)


def test_expert_bank_indexes_one_expert():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, 96, generator=g)
    bank, qt = _packed(QuantExpertBank, w, 2, compute_dtype=torch.float32)
    full = qt.dequantize(torch.float32)
    for e in range(4):
        assert torch.equal(bank[e], full[e])
    assert len(bank) == 4 and bank.shape == (4, 64, 96)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_memory_within_ten_percent_of_the_checkpoint(tmp_path, dtype):
    source = resolve_model("small")
    modules = [s.module for s in source.tensor_specs() if s.quantizable]
    doc = quantize_model(source, demo_widths(modules), tmp_path / "q", random_init=True,
                         progress=False)
    model = load(tmp_path / "q", dtype=dtype)
    # a natively decoding family keeps the format's codes: no copy for torch's int4 kernel
    assert not any(m._int4 is not None for m in model.modules() if isinstance(m, QuantLinear))
    resident = resident_weight_nbytes(model)
    total = doc["accounting"]["total_nbytes"]
    # float32 compute keeps the dense parts (norms, router, conv) in float32: 2x their bytes
    dense_extra = sum(t.numel() * 2 for t in model.state_dict().values()
                      if t.dtype == torch.float32)
    assert resident <= 1.10 * total + dense_extra, (resident, total, dense_extra)
    with torch.device("meta"):
        dense = DynquantHybridForCausalLM(preset_config("small"))
    dense_bf16 = sum(p.numel() for p in dense.parameters()) * 2
    assert resident < dense_bf16 / 3


@pytest.mark.parametrize("tokens", [1, 5, 9])
def test_expert_products_run_from_the_packed_codes(tokens, monkeypatch):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 64, 200, generator=g)  # groups along the last axis (200: padded)
    bank, qt = _packed(QuantExpertBank, w, 3, compute_dtype=torch.float32)
    full = qt.dequantize(torch.float32)
    x_in = torch.randn(tokens, 200, generator=g)  # F.linear(x, W[e]) contracts the last axis
    x_out = torch.randn(2, tokens, 64, generator=g)  # x @ W[e] contracts the first
    bias = torch.randn(64, generator=g)
    close = {"rtol": 1e-5, "atol": 1e-4}  # float32 sums in another order
    for e in range(3):
        expert = bank[e]
        torch.testing.assert_close(F.linear(x_in, expert), x_in @ full[e].T, **close)
        torch.testing.assert_close(F.linear(x_in, expert, bias), x_in @ full[e].T + bias, **close)
        torch.testing.assert_close(x_out @ expert, x_out @ full[e], **close)
        torch.testing.assert_close(torch.matmul(x_out[0], expert), x_out[0] @ full[e], **close)
        # float32: the matvec / vecmat kernels, or the packed GEMMs past MAX_TOKENS
        assert expert.linear(x_in) is not None and expert.rmatmul(x_out) is not None
    with monkeypatch.context() as m:  # the operators themselves take the packed path
        m.setattr(PackedExpert, "dense", lambda *a: pytest.fail("dequantized"))
        F.linear(x_in, bank[0])
        x_in[:, :64] @ bank[0]
        x_in[:, :64].matmul(bank[0])
        torch.matmul(x_in[:, :64], bank[0])
    y = F.linear(x_in.to(torch.bfloat16), bank[1])
    assert y.dtype == torch.bfloat16
    # anything else sees the dequantized matrix
    assert bank[2].shape == (64, 200) and torch.equal(bank[2].T, full[2].T)
    assert torch.equal(torch.cat([bank[0], bank[1]]), torch.cat([full[0], full[1]]))


def test_both_loaders_reject_a_tensor_the_model_does_not_have(tmp_path):
    model = DynquantHybridForCausalLM(preset_config("tiny")).eval()
    quantizable = {s.name: s.module for s in resolve_model("tiny").tensor_specs() if s.quantizable}
    params = dict(model.named_parameters())  # the tied head appears once, as the embedding
    modules = {quantizable[n]: (p.detach(), 4) for n, p in params.items() if n in quantizable}
    dense = {n: p.detach() for n, p in params.items() if n not in quantizable}
    dense["model.bogus.weight"] = torch.ones(3)
    write_checkpoint(tmp_path / "ck", modules, dense, config=model.config.to_dict())
    for loader in (load, load_dequantized):
        with pytest.raises(CheckpointError, match=r"does not have: \['model.bogus.weight'\]"):
            loader(tmp_path / "ck")


def test_prefill_blocks_reuse_one_scratch_buffer(monkeypatch):
    import dynquant.runtime.packed_modules as pm

    # long bf16 prefills dequantize row blocks for the bf16 GEMM (float32 takes the packed GEMM)
    monkeypatch.setattr(pm, "DEQUANT_BLOCK_ELEMENTS", 64 * 200)  # 64-row blocks: 4 of them
    monkeypatch.setattr(pm._scratch_buffers, "buf", None, raising=False)  # whatever ran before
    w = torch.randn(250, 200, generator=torch.Generator().manual_seed(5))
    lin, qt = _packed(QuantLinear, w, 3, compute_dtype=torch.bfloat16)
    x = torch.randn(pm.BF16_GEMM_MAX_TOKENS + 3, 200).to(torch.bfloat16)
    expect = x @ qt.dequantize(torch.bfloat16).T
    torch.testing.assert_close(lin(x), expect)
    buf = pm._scratch_buffers.buf
    torch.testing.assert_close(lin(x), expect)  # same buffer, same answer
    assert pm._scratch_buffers.buf is buf and buf.numel() == 64 * 200


def test_gradients_flow_through_packed_modules_to_their_inputs():
    # the native kernels and torch's int4 kernel have no backward: an input that needs a
    # gradient takes the torch path
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(6))
    for bits in (3, 4):  # 4-bit in bf16 compute: torch's int4 kernel
        lin, qt = _packed(QuantLinear, w, bits,
                          compute_dtype=torch.bfloat16 if bits == 4 else torch.float32)
        lin.prepare()
        assert (lin._int4 is not None) == (bits == 4)
        dense = lin.dequantize(torch.float32)  # the weights the forward uses (int4: its layout)
        torch.testing.assert_close(dense, qt.dequantize(torch.float32), rtol=0.02, atol=0.02)
        for tokens in (1, MAX_TOKENS + 4):  # decode and prefill sizes
            x = torch.randn(tokens, 256, requires_grad=True)
            (lin(x) * torch.arange(96.0)).sum().backward()
            torch.testing.assert_close(x.grad, (torch.arange(96.0) @ dense).expand(tokens, 256),
                                       rtol=1e-5, atol=2e-3)
    bank, qb = _packed(QuantExpertBank, torch.randn(2, 64, 128), 4, compute_dtype=torch.float32)
    x = torch.randn(1, 64, requires_grad=True)
    (x @ bank[1]).sum().backward()
    torch.testing.assert_close(x.grad[0], qb.dequantize(torch.float32)[1].sum(1),
                               rtol=1e-5, atol=1e-4)


def test_an_unknown_int4_layout_keeps_the_kernel_for_every_size(monkeypatch):
    """Where torch writes another int4 layout than the one dynquant reads, the module never reads
    it: long prefills stay on the kernel and the weights are rebuilt through it (its bf16 zero
    points: within their rounding of the format's values)."""
    from dynquant.runtime import packed_modules

    monkeypatch.setattr(packed_modules, "layout_is_known", lambda: False)
    g = torch.Generator().manual_seed(7)
    lin, qt = _packed(QuantLinear, torch.randn(64, 256, generator=g), 4)
    lin.prepare()
    long = torch.randn(1, BF16_GEMM_MAX_TOKENS + 8, 256, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(long), int4_linear(long, *lin._int4, 128))
    torch.testing.assert_close(lin.dequantize(torch.float32), qt.dequantize(torch.float32),
                               atol=0.02, rtol=0.01)


@pytest.mark.parametrize("cols", [64, 200])  # 200: a tail past the 16 lanes
def test_stored_linear_multiplies_its_bf16_weight_in_float32(cols):
    """StoredLinear against F.linear with the weight converted first: the bf16 kernel for a few
    tokens (its own summation order: float32 rounding), float32 blocks beyond; bf16 inputs see
    the weight as stored."""
    from dynquant.runtime.stored_linear import StoredLinear

    g = torch.Generator().manual_seed(7)
    lin = StoredLinear(cols, 48, bias=True)
    lin.weight = torch.nn.Parameter(torch.randn(48, cols, generator=g).to(torch.bfloat16),
                                    requires_grad=False)
    lin.bias = torch.nn.Parameter(torch.randn(48, generator=g), requires_grad=False)
    for tokens in (1, 3, 20):
        x = torch.randn(2, tokens, cols, generator=g)
        want = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (2, tokens, 48)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    xb = torch.randn(1, 2, cols, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(xb), torch.nn.functional.linear(xb, lin.weight) + lin.bias.to(xb.dtype))
    with backend("torch"):  # no kernels: the float32 blocks
        x = torch.randn(1, 1, cols, generator=g)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(
            x, lin.weight.float(), lin.bias), rtol=1e-5, atol=1e-4)
