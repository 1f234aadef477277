"""MoE decode: every routed (token, expert) pair of a bank in one kernel call, no loop over
experts; held to the per-expert kernels bit for bit and to the float model within tolerance."""

from __future__ import annotations

import pytest
import torch

from dynquant import quantize_tensor
from dynquant.format.layout import LayerLayout
from dynquant.models.hybrid import modeling
from dynquant.models.presets import preset_config
from dynquant.models.sources import resolve_model
from dynquant.numerics.packed_matvec import (
    packed_matvec,
    packed_matvec_experts,
    packed_vecmat,
    packed_vecmat_experts,
)
from dynquant.pipeline.codes.write import quantize_model
from dynquant.runtime import experts as experts_module
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.packed_modules import QuantExpertBank
from model_zoo import save_tiny_model


def _bank(e: int, rows: int, cols: int, bits: int, seed: int):
    w = torch.randn(e, rows, cols, generator=torch.Generator().manual_seed(seed))
    qt = quantize_tensor(w, bits)
    bank = QuantExpertBank(LayerLayout.create((e, rows, cols), bits, 128), torch.float32)
    bank.qweight, bank.scales, bank.offsets = qt.qweight, qt.scales, qt.offsets
    return bank, qt


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pair_kernels_equal_the_one_expert_kernels_bit_for_bit(bits):
    bank, qt = _bank(5, 48, 200, bits, bits)
    per = 48
    ids = torch.tensor([3, 0, 3, 4, 1, 1])  # repeats: two tokens routed to one expert
    g = torch.Generator().manual_seed(9)
    x_in, x_out = torch.randn(6, 200, generator=g), torch.randn(6, 48, generator=g)
    lin = packed_matvec_experts(x_in, ids, qt.qweight, qt.scales, qt.offsets, qt.layout)
    mat = packed_vecmat_experts(x_out, ids, qt.qweight, qt.scales, qt.offsets, qt.layout)
    assert lin.shape == (6, 48) and mat.shape == (6, 200)
    for p, e in enumerate(ids.tolist()):
        rows = slice(e * per, (e + 1) * per)
        block = (qt.qweight[rows], qt.scales[rows], qt.offsets[rows], qt.layout)
        assert torch.equal(lin[p], packed_matvec(x_in[p:p + 1], *block)[0])
        assert torch.equal(mat[p], packed_vecmat(x_out[p:p + 1], *block)[0])
        full = qt.dequantize(torch.float32)[e]
        torch.testing.assert_close(lin[p], full @ x_in[p], rtol=1e-5, atol=1e-4)
    assert torch.equal(bank.pairs_linear(x_in, ids), lin)
    with pytest.raises(ValueError, match="expert index out of range"):
        packed_matvec_experts(x_in, ids + 1, qt.qweight, qt.scales, qt.offsets, qt.layout)
    with pytest.raises(ValueError, match="one expert per row"):
        packed_vecmat_experts(x_out, ids[:3], qt.qweight, qt.scales, qt.offsets, qt.layout)


def test_pairs_split_across_threads_give_the_same_bits(monkeypatch):
    from dynquant.numerics import packed_matvec as pm

    bank, _ = _bank(4, 256, 384, 3, 1)
    ids = torch.tensor([2, 1, 2, 0])
    x_in, x_out = torch.randn(4, 384), torch.randn(4, 256)
    one = (bank.pairs_linear(x_in, ids), bank.pairs_matmul(x_out, ids))
    monkeypatch.setattr(pm, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(pm, "VECMAT_PARALLEL_MIN_ELEMENTS", 0)
    bank, _ = _bank(4, 256, 384, 3, 1)  # its prepared products read the thresholds when made
    assert bank._prepared(True)[0].block.min_work == 0
    assert torch.equal(bank.pairs_linear(x_in, ids), one[0])
    assert torch.equal(bank.pairs_matmul(x_out, ids), one[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [256, 200])  # 200: groups padded to 256
def test_a_banks_prepared_pairs_give_the_general_calls_bits(dtype, cols):
    """Decode's prepared pair products (``ExpertPairs``, one per bank and kind) against the
    general calls, and their own check of the expert indices."""
    bank, qt = _bank(5, 64, cols, 3, 4)
    ids = torch.tensor([4, 0, 4, 2])
    g = torch.Generator().manual_seed(5)
    x_in, x_out = torch.randn(4, cols, generator=g), torch.randn(4, 64, generator=g)
    lin = packed_matvec_experts(x_in.to(dtype), ids, qt.qweight, qt.scales, qt.offsets, qt.layout)
    mat = packed_vecmat_experts(x_out.to(dtype), ids, qt.qweight, qt.scales, qt.offsets,
                                qt.layout)
    assert torch.equal(bank.pairs_linear(x_in.to(dtype), ids), lin.to(dtype))
    assert torch.equal(bank.pairs_matmul(x_out.to(dtype), ids), mat.to(dtype))
    assert set(bank._kept_calls) == {"pairs-True-float32", "pairs-False-float32"}
    with pytest.raises(ValueError, match="expert index out of range"):
        bank.pairs_linear(x_in, ids + 1)
    with pytest.raises(ValueError, match="expert index out of range"):
        bank.pairs_matmul(x_out, torch.tensor([0, -1, 0, 0]))
    with pytest.raises(ValueError, match="one expert per row"):
        bank.pairs_matmul(x_out, ids[:3])
    other = quantize_tensor(torch.randn(5, 64, cols, generator=g), 3)
    bank.qweight, bank.scales, bank.offsets = other.qweight, other.scales, other.offsets
    assert torch.equal(bank.pairs_linear(x_in, ids),  # prepared again for the new buffers
                       packed_matvec_experts(x_in, ids, other.qweight, other.scales,
                                             other.offsets, other.layout))


def test_hybrid_moe_few_pairs_path_equals_the_grouped_path(monkeypatch):
    torch.manual_seed(0)
    moe = modeling.MoE(preset_config("tiny")).eval()
    for p in (moe.w1, moe.w3, moe.w2):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 3, moe.gate.in_features)  # 3 tokens x top-k pairs: the few-pairs path
    with torch.no_grad():
        few = moe(x)
        monkeypatch.setattr(modeling, "FEW_PAIRS", 0)  # force the grouped loop
        grouped = moe(x)
    torch.testing.assert_close(few, grouped, rtol=1e-5, atol=1e-6)


def test_hybrid_decode_reads_each_bank_once_per_step(tiny_checkpoint, monkeypatch):
    """One token through the packed hybrid model: one pairs call per bank and layer, never
    a per-expert product and never a dequantized expert."""
    checkpoint = tiny_checkpoint("tiny", 3)
    model = load(checkpoint, dtype=torch.float32)
    reference = load_dequantized(checkpoint, torch.float32)
    calls = []
    original = QuantExpertBank.pairs_matmul
    monkeypatch.setattr(QuantExpertBank, "pairs_matmul",
                        lambda self, x, e: calls.append(x.shape[0]) or original(self, x, e))
    monkeypatch.setattr(QuantExpertBank, "__getitem__", lambda *a: pytest.fail("per expert"))
    ids = torch.tensor([[7]])
    with torch.no_grad():
        got = model(ids).logits
        want = reference(ids).logits
    cfg = model.config
    assert calls == [cfg.num_experts_per_tok] * (3 * cfg.num_hidden_layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["olmoe", "lfm2_moe"])
def test_transformers_moe_through_load_stays_within_one_percent(family, tmp_path, monkeypatch):
    """dynquant.load of a tiny OLMoE / LFM2-MoE checkpoint, in either compute dtype, against the
    float32 model holding the decoded weights: within 1% of the logits' range, prefill and
    decode; decode runs the 'dynquant' experts path (one pairs call per bank)."""
    src = save_tiny_model(family, tmp_path / "src")
    source = resolve_model(str(src))
    modules = sorted(s.module for s in source.tensor_specs() if s.quantizable)
    widths = {m: (2, 3, 4, 8)[i % 4] for i, m in enumerate(modules)}
    quantize_model(source, widths, tmp_path / "q", progress=False)
    reference = load_dequantized(tmp_path / "q", torch.float32)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    original = experts_module._routed
    monkeypatch.setattr(experts_module, "_routed",
                        lambda *a: calls.append(a[1].shape[0]) or original(*a))
    for dtype in (torch.float32, torch.bfloat16):
        model = load(tmp_path / "q", dtype=dtype)
        assert model.config._experts_implementation == "dynquant"
        for batch in (ids, ids[:, :1]):
            with torch.no_grad():
                got = model(batch).logits.float()
                want = reference(batch).logits.float()
            span = (want.max() - want.min()).item()
            assert (got - want).abs().max().item() <= 0.01 * span, (dtype, batch.shape)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert 2 in calls  # the decode batch (2 tokens) went through the pairs path


def test_the_packed_experts_path_falls_back_to_eager_for_dense_banks():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(cfg).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        eager = model(ids).logits
        experts_module.use_packed_experts(model)
        assert model.config._experts_implementation == "dynquant"
        assert torch.equal(model(ids).logits, eager)  # dense banks: the model's own forward


def test_bf16_inputs_keep_their_dtype():
    bank, qt = _bank(3, 64, 128, 4, 2)
    x = torch.randn(2, 128).to(torch.bfloat16)
    y = bank.pairs_linear(x, torch.tensor([0, 2]))
    full = qt.dequantize(torch.float32)
    want = torch.stack([full[0] @ x[0].float(), full[2] @ x[1].float()])
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=0.01, atol=0.05)  # bf16 output rounding


def test_grouped_products_multiply_the_dequantized_experts(monkeypatch):
    """A long bf16 prefill's products, the experts dequantized a run at a time: each product is
    the bf16 GEMM with the expert's dequantized matrix, whatever the runs (one run, or runs of one
    and two experts), an expert with few tokens included when its run is dequantized; a run of
    such experts alone keeps the packed GEMM; float32 inputs or only such experts get None."""
    from dynquant.runtime import packed_modules

    bank, qt = _bank(5, 64, 128, 3, 4)
    g = torch.Generator().manual_seed(11)
    ids = [4, 0, 2, 3]
    counts = (40, 3, 70, 33)  # expert 0: 3 tokens
    xs_in = [torch.randn(n, 128, generator=g).to(torch.bfloat16) for n in counts]
    xs_out = [torch.randn(n, 64, generator=g).to(torch.bfloat16) for n in counts]
    full = qt.dequantize(torch.bfloat16)
    for block, alone in ((packed_modules.DEQUANT_BLOCK_ELEMENTS, False), (64 * 128, True),
                         (2 * 64 * 128, True)):
        monkeypatch.setattr(packed_modules, "DEQUANT_BLOCK_ELEMENTS", block)
        lin, mat = bank.grouped_linear(xs_in, ids), bank.grouped_matmul(xs_out, ids)
        for i, e in enumerate(ids):
            w = bank[e] if e == 0 and alone else full[e]  # expert 0 alone in its run: packed
            assert torch.equal(lin[i], torch.nn.functional.linear(xs_in[i], w)), (block, e)
            assert torch.equal(mat[i], xs_out[i] @ w), (block, e)
    assert bank.grouped_linear([x.float() for x in xs_in], ids) is None
    assert bank.grouped_linear([x[:32] for x in xs_in], ids) is None


def test_long_bf16_prefills_group_the_experts(tmp_path, monkeypatch):
    """Packed hybrid and OLMoE models, bf16, 80 tokens: the grouped products serve the routed
    experts, and the logits stay within bf16 rounding of the expert-by-expert path's (OLMoE:
    transformers' eager loop over the same packed banks; how close that path is to the float
    model: test_transformers_moe_through_load_stays_within_one_percent)."""
    src = save_tiny_model("olmoe", tmp_path / "src")
    models = {}
    for name, source in (("hybrid", resolve_model("tiny")), ("olmoe", resolve_model(str(src)))):
        widths = {s.module: 3 for s in source.tensor_specs() if s.quantizable}
        quantize_model(source, widths, tmp_path / name, random_init=name == "hybrid",
                       progress=False)
        models[name] = load(tmp_path / name, dtype=torch.bfloat16)
    ids = torch.randint(0, 384, (1, 80), generator=torch.Generator().manual_seed(0))
    calls = []
    grouped = QuantExpertBank._grouped

    def counted(self, xs, experts, transposed):
        ys = grouped(self, xs, experts, transposed)
        calls.append(ys is not None)
        return ys

    monkeypatch.setattr(QuantExpertBank, "_grouped", counted)
    for name, model in models.items():
        calls.clear()
        with torch.no_grad():
            got = model(ids).logits.float()
            assert any(calls), name  # some expert had more than 32 tokens
            with monkeypatch.context() as m:
                m.setattr(QuantExpertBank, "_grouped", lambda *a, **k: None)  # expert by expert
                per_expert = model(ids).logits.float()
        span = (per_expert.max() - per_expert.min()).item()
        assert (got - per_expert).abs().max().item() <= 0.03 * span, name  # seen: 1.6%, 0.3%
