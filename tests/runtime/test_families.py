"""Every supported family: quantize a tiny random instance, load it packed, match the float model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dynquant import validate_checkpoint
from dynquant.models.sources import resolve_model
from dynquant.numerics import native
from dynquant.pipeline.codes.write import quantize_model
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.packed_modules import QuantEmbedding, QuantExpertBank, QuantLinear
from dynquant.runtime.stored_linear import StoredLinear
from model_zoo import family_configs, save_tiny_model

FAMILIES = sorted(family_configs())
CYCLE = (2, 3, 4, 8)


@pytest.fixture(autouse=True)
def float32_kv_cache(monkeypatch):
    """Native steps compared with the eager path keep their keys and values in float32 (the
    eager cache's own numbers); ``test_a_float16_kv_cache`` covers the default."""
    monkeypatch.setenv("DYNQUANT_KV_CACHE", "float32")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family -> (source dir, checkpoint dir, metadata, specs)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        src_dir = save_tiny_model(family, root / "src")
        source = resolve_model(str(src_dir))
        specs = source.tensor_specs()
        modules = sorted(s.module for s in specs if s.quantizable)
        widths = {m: CYCLE[i % len(CYCLE)] for i, m in enumerate(modules)}
        doc = quantize_model(source, widths, root / "q", progress=False)
        out[family] = (src_dir, root / "q", doc, specs)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_valid_and_accounts_for_every_weight(quantized, family):
    src_dir, ck_dir, doc, specs = quantized[family]
    assert validate_checkpoint(str(ck_dir)) == []
    original = AutoModelForCausalLM.from_pretrained(src_dir)
    total = sum(p.numel() for p in original.parameters())  # tied weights counted once
    dense = sum(math.prod(s.shape) for s in specs if not s.quantizable)
    assert doc["accounting"]["quantized_elements"] + dense == total
    banks = [s.module for s in specs if s.quantizable and len(s.shape) == 3]
    assert doc["expert_banks"] == sorted(banks)
    if family in ("qwen3_moe", "mixtral", "olmoe", "lfm2_moe", "dynquant_hybrid"):
        assert banks, "an MoE family must expose its experts as banks"
    # nothing routed as a router or norm was quantized
    assert not any(n.endswith((".gate", ".router")) or "norm" in n for n in doc["layers"])


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_model_matches_the_dequantized_float_model(quantized, family):
    _, ck_dir, doc, _ = quantized[family]
    # float32: the packed kernels accumulate in float32, and a bf16 reference's rounding could
    # flip a near-tie in MoE routing of these tiny random models
    packed = load(ck_dir, dtype=torch.float32)
    kinds = {type(m) for m in packed.modules()}
    assert QuantLinear in kinds and QuantEmbedding in kinds
    assert (QuantExpertBank in kinds) == bool(doc["expert_banks"])
    reference = load_dequantized(ck_dir, torch.float32)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    # 24 tokens: Linears dequantize blocks (prefill); 2 tokens: the packed matvec kernels (decode)
    for batch in (ids, ids[:, :1]):
        with torch.no_grad():
            a = packed(batch).logits.float()
            b = reference(batch).logits.float()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_dequantized_weights_are_close_to_the_source(quantized, family):
    src_dir, ck_dir, doc, _ = quantized[family]
    from dynquant import open_checkpoint
    from dynquant.pipeline.calibrate.weights import SafetensorsWeights

    ck = open_checkpoint(ck_dir)
    source = resolve_model(str(src_dir))
    weights = SafetensorsWeights(src_dir, source.conversion_transforms())
    for spec in source.tensor_specs():
        if spec.module in doc["layers"] and doc["layers"][spec.module]["bits"] == 8:
            w = weights.get(spec).float()
            rel = ((ck.dequantize(spec.module).float() - w).norm() / w.norm()).item()
            assert rel < 0.01, spec.module


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_model_from_pretrained_loads_the_checkpoint(quantized, family):
    import dynquant  # noqa: F401  (registers the dynquant quantizer with transformers)

    _, ck_dir, doc, _ = quantized[family]
    model = AutoModelForCausalLM.from_pretrained(ck_dir).eval()
    assert model.config.quantization_config.to_dict() == doc["quantization_config"]
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert model.generate.model is model  # one-thread decode steps too (decode_threads)
    ids = torch.randint(0, 384, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(ids).logits.float()
        b = load(ck_dir)(ids).logits.float()
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_an_untied_head_is_quantized_unless_kept_dense(tmp_path, capsys):
    from dynquant.cli import main

    src = save_tiny_model("llama", tmp_path / "src")  # untied lm_head
    source = resolve_model(str(src))
    quantizable = {s.module for s in source.tensor_specs() if s.quantizable}
    assert "lm_head" in quantizable
    without = {s.module for s in source.tensor_specs(lm_head_quantized=False) if s.quantizable}
    assert quantizable == without | {"lm_head"}
    # every path gives the head a width: uniform, data-free budget, calibrated with a pin
    short = ["--calib-len", "32", "--calib-seqs", "2", "--gptq-seqs", "4", "--quiet"]
    for name, extra in (("u", ["--uniform", "4"]), ("d", ["--budget", "5.0", "--no-calib"]),
                        ("c", ["--budget", "7.0", "--pin", "lm_head=8", *short])):
        assert main(["quantize", str(src), "-o", str(tmp_path / name), "--quiet", *extra]) == 0
        doc = json.loads((tmp_path / name / "dynquant.json").read_text())
        assert doc["quantization_config"]["lm_head_quantized"] is True, name
        want = {"u": {4}, "d": {2, 3, 4, 8}, "c": {8}}[name]
        assert doc["layers"]["lm_head"]["bits"] in want, name
    assert main(["quantize", str(src), "-o", str(tmp_path / "k"), "--uniform", "4",
                 "--not-convert", "lm_head", "--quiet"]) == 0
    kept = json.loads((tmp_path / "k" / "dynquant.json").read_text())
    assert "lm_head" not in kept["layers"]
    assert kept["quantization_config"]["lm_head_quantized"] is False
    assert kept["quantization_config"]["modules_to_not_convert"] == ["lm_head"]
    widths = {m: 4 for m in quantizable}
    (tmp_path / "w.json").write_text(json.dumps(widths))
    assert main(["quantize", str(src), "--widths", str(tmp_path / "w.json"), "-o",
                 str(tmp_path / "q"), "--not-convert", "*.mlp.down_proj"]) == 0
    out = capsys.readouterr().out
    assert "elements by tensor type" in out and "mlp.down_proj" in out
    doc = json.loads((tmp_path / "q" / "dynquant.json").read_text())
    qc = doc["quantization_config"]
    assert qc["lm_head_quantized"] is True and "lm_head" in doc["layers"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.down_proj",
                                            "model.layers.1.mlp.down_proj"]
    assert not any(n.endswith("down_proj") for n in doc["layers"])
    # kept dense, held in bfloat16 as stored: an nn.Linear where the model computes in bfloat16,
    # a StoredLinear (bfloat16 weight, float32 product) where it computes in float32
    for dtype, kept_type in ((torch.bfloat16, torch.nn.Linear), (torch.float32, StoredLinear)):
        kept = load(tmp_path / "q", dtype=dtype).model.layers[0].mlp.down_proj
        assert type(kept) is kept_type and kept.weight.dtype == torch.bfloat16
    model = load(tmp_path / "q")
    assert isinstance(model.lm_head, QuantLinear)
    reference = load_dequantized(tmp_path / "q")
    ids = torch.randint(0, 384, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), reference(ids).logits.float(),
                                   atol=2e-2, rtol=2e-2)


def test_from_pretrained_validates_the_checkpoint_first(quantized, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    import dynquant  # noqa: F401  (registers the dynquant quantizer with transformers)
    from dynquant import CheckpointError

    _, ck_dir, doc, _ = quantized["llama"]
    broken = tmp_path / "broken"
    shutil.copytree(ck_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = next(iter(doc["layers"]))
    tensors[f"{name}.scales"][0, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="NaN"):
        AutoModelForCausalLM.from_pretrained(broken)


def _greedy(model, ids, steps: int = 6):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


def _assert_native_steps_match_eager(model, monkeypatch) -> None:
    """Greedy tokens of the native steps equal the eager path's, and so do the logits up to
    float32 summation order."""
    ids = torch.randint(0, 384, (1, 7), generator=torch.Generator().manual_seed(2))
    native_tokens, native_scores = _greedy(model, ids)
    monkeypatch.setenv("DYNQUANT_NATIVE_DECODE", "0")
    eager_tokens, eager_scores = _greedy(model, ids)
    assert torch.equal(native_tokens, eager_tokens)
    torch.testing.assert_close(native_scores, eager_scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_decode_steps_give_the_eager_tokens(quantized, family, monkeypatch):
    """Every family of the suite decodes natively (one C call a step): Llama, Qwen3, LFM2
    (attention and short-convolution layers), the MoE Qwen3-MoE, Mixtral, OLMoE, LFM2-MoE and the
    reference hybrid (x @ W[e] banks and a shared expert), Gemma-3 where it is native; greedy
    tokens equal the eager path's (float32), and so do the logits up to float32 summation
    order."""
    from dynquant.runtime.native_decode import FAMILIES as NATIVE
    from dynquant.runtime.native_decode import has_native_decode

    _, ck_dir, _, _ = quantized[family]
    model = load(ck_dir, dtype=torch.float32)
    assert has_native_decode(model) == (family in NATIVE)
    assert set(NATIVE) < set(FAMILIES)
    _assert_native_steps_match_eager(model, monkeypatch)


def test_attention_over_blocks_of_positions_and_a_grown_cache(quantized, monkeypatch):
    """Past 128 cached positions the attention is several blocks merged (flash-decoding), the
    same bits on one and two threads and the eager tokens; a cache that outgrows its capacity
    mid-generation is copied into a larger one."""
    from dynquant.runtime import native_decode

    _, ck_dir, _, _ = quantized["llama"]
    monkeypatch.setattr(native_decode, "ATTENTION_PARALLEL_MIN_MACS", 0)
    monkeypatch.setattr(native_decode, "FIRST_CAPACITY", 8)
    grown = []
    grow = native_decode.NativeDecode._grow
    monkeypatch.setattr(native_decode.NativeDecode, "_grow",
                        lambda self: (grown.append(self.program.capacity), grow(self)))
    long = torch.randint(0, 384, (1, 300), generator=torch.Generator().manual_seed(3))
    short = long[:, :7]  # capacity 16 at the first step: grown after 9 steps
    for ids, steps in ((long, 4), (short, 12)):
        runs = {}
        for threads in (1, 2):
            monkeypatch.setattr(native, "pool_threads", threads)
            runs[threads] = _greedy(load(ck_dir, dtype=torch.float32), ids, steps)
        assert torch.equal(runs[1][0], runs[2][0]) and torch.equal(runs[1][1], runs[2][1])
        monkeypatch.setenv("DYNQUANT_NATIVE_DECODE", "0")
        eager = _greedy(load(ck_dir, dtype=torch.float32), ids, steps)
        monkeypatch.delenv("DYNQUANT_NATIVE_DECODE")
        assert torch.equal(runs[1][0], eager[0])
        torch.testing.assert_close(runs[1][1], eager[1], rtol=1e-4, atol=1e-4)
    assert grown == [16, 16]  # the short prompt's runs, one a thread count


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_float16_kv_cache(quantized, family, monkeypatch):
    """The default cache holds keys and values in float16 (as llama.cpp's): over several blocks
    of positions, the same bits on one and two threads, the eager tokens, logits within float16's
    rounding of the keys and values."""
    from dynquant.runtime import native_decode

    monkeypatch.setenv("DYNQUANT_KV_CACHE", "float16")
    monkeypatch.setattr(native_decode, "ATTENTION_PARALLEL_MIN_MACS", 0)
    _, ck_dir, _, _ = quantized[family]
    ids = torch.randint(0, 384, (1, 200), generator=torch.Generator().manual_seed(4))
    runs = {}
    for threads in (1, 2):
        monkeypatch.setattr(native, "pool_threads", threads)
        model = load(ck_dir, dtype=torch.float32)
        runs[threads] = _greedy(model, ids, 4)
    assert torch.equal(runs[1][0], runs[2][0]) and torch.equal(runs[1][1], runs[2][1])
    cache = model.forward.program.k
    assert cache.dtype == torch.float16
    monkeypatch.setenv("DYNQUANT_NATIVE_DECODE", "0")
    eager = _greedy(load(ck_dir, dtype=torch.float32), ids, 4)
    assert torch.equal(runs[1][0], eager[0])
    torch.testing.assert_close(runs[1][1], eager[1], rtol=0, atol=5e-3)
    assert not torch.equal(runs[1][1], eager[1])  # float16 keys and values: not the same bits


@pytest.mark.parametrize("family", ["llama", "dynquant_hybrid"])
def test_attention_heads_split_over_threads_keep_the_bits(quantized, family, monkeypatch):
    """A native step's attention with its heads split over the kernel pool (every step, two
    threads) gives the logits of one thread bit for bit, and the eager tokens."""
    from dynquant.runtime import native_decode

    _, ck_dir, _, _ = quantized[family]
    ids = torch.randint(0, 384, (1, 7), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(native_decode, "ATTENTION_PARALLEL_MIN_MACS", 0)
    runs = {}
    for threads in (1, 2):
        monkeypatch.setattr(native, "pool_threads", threads)
        runs[threads] = _greedy(load(ck_dir, dtype=torch.float32), ids)
    assert torch.equal(runs[1][0], runs[2][0]) and torch.equal(runs[1][1], runs[2][1])
    _assert_native_steps_match_eager(load(ck_dir, dtype=torch.float32), monkeypatch)


def test_lfm2_moe_routers_expert_bias_and_scaling_in_native_steps(quantized, monkeypatch):
    """LFM2-MoE's router (sigmoids, top k by sigmoid + expert bias, routed scaling) in the native
    step gives the eager tokens and logits with a non-zero expert bias and a scale."""
    _, ck_dir, _, _ = quantized["lfm2_moe"]
    model = load(ck_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    blocks = [m for m in model.modules() if hasattr(m, "expert_bias")]
    assert blocks and all(b.use_expert_bias for b in blocks)
    for block in blocks:
        block.expert_bias.copy_(torch.randn(block.expert_bias.shape, generator=g) * 0.3)
        block.gate.routed_scaling_factor = 1.7
    _assert_native_steps_match_eager(model, monkeypatch)


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmoe", "lfm2"])
def test_int8_activations_stay_close_to_float_ones(quantized, family):
    """int8 decode products (native steps for Llama and Qwen3, transformers' forward with the
    packed modules elsewhere): each step's logits within 3% of their span of the float32
    activations' logits, up to the first token where the two greedy runs part (the stated
    tolerance; tokens may part at near-ties)."""
    _, ck_dir, _, _ = quantized[family]
    ids = torch.randint(0, 384, (1, 10), generator=torch.Generator().manual_seed(3))
    float_tokens, float_logits = _greedy(load(ck_dir, dtype=torch.float32), ids)
    int8 = load(ck_dir, dtype=torch.float32, activations="int8")
    assert all(m.activations.kind == "int8" for m in int8.modules() if hasattr(m, "activations"))
    int8_tokens, int8_logits = _greedy(int8, ids)
    new = int8_tokens[0, ids.shape[1]:] != float_tokens[0, ids.shape[1]:]
    same = int(new.nonzero()[0, 0]) + 1 if new.any() else new.numel()
    span = (float_logits.max() - float_logits.min()).item()
    assert same >= 2 and not torch.equal(int8_logits[1:same], float_logits[1:same])
    assert (int8_logits[:same] - float_logits[:same]).abs().max().item() <= 0.03 * span
    if family in ("llama", "qwen3"):  # a 10-token prompt: the float32 GEMM
        assert torch.equal(int8_logits[0], float_logits[0])


@pytest.mark.parametrize("family", ["llama", "lfm2", "dynquant_hybrid"])
def test_native_steps_hand_their_cache_back_to_transformers(quantized, family, monkeypatch):
    """A cache continued by native steps and then by a prefill-sized forward (which transformers
    runs) gives that forward the same logits as an all-eager run: keys and values, and LFM2's
    convolution states, written back."""
    from transformers.cache_utils import DynamicCache

    _, ck_dir, _, _ = quantized[family]
    model = load(ck_dir, dtype=torch.float32)
    ids = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(4))

    def run() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :5], cache=cache)
            for i in range(5, 9):  # native steps where enabled
                model(input_ids=ids[:, i:i + 1], cache=cache)
            return model(input_ids=ids[:, 9:], cache=cache).logits

    native = run()
    monkeypatch.setenv("DYNQUANT_NATIVE_DECODE", "0")
    torch.testing.assert_close(native, run(), rtol=1e-4, atol=1e-4)


def test_native_decode_through_from_pretrained_and_without_kernels(quantized, monkeypatch):
    import dynquant  # noqa: F401
    from dynquant.runtime.native_decode import has_native_decode

    _, ck_dir, _, _ = quantized["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(ck_dir, dtype=torch.float32).eval()
    assert has_native_decode(model)
    ids = torch.randint(0, 384, (1, 5), generator=torch.Generator().manual_seed(5))
    tokens, _ = _greedy(model, ids)
    monkeypatch.setenv("DYNQUANT_NATIVE", "0")  # no kernels: transformers' forward, same tokens
    assert not has_native_decode(model)
    assert torch.equal(_greedy(model, ids)[0], tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_weights_equal_the_file(quantized, family):
    """Every stored tensor held in its file dtype: the packed modules' codes, scales and offsets
    are exactly the file's packed bytes, and resident weights within 5% of the file's tensor
    bytes in either compute dtype (float32 norms and routers are the rest)."""
    from dynquant.runtime.memory import resident_weight_nbytes
    from dynquant.runtime.packed_modules import PackedWeight

    _, ck_dir, doc, _ = quantized[family]
    model = load(ck_dir, dtype=torch.float32)
    packed = sum(t.nbytes for m in model.modules() if isinstance(m, PackedWeight)
                 for t in (m.qweight, m.scales, m.offsets))
    assert packed == doc["accounting"]["packed_nbytes"]
    total = doc["accounting"]["total_nbytes"]
    for dtype in (torch.float32, torch.bfloat16):
        assert resident_weight_nbytes(load(ck_dir, dtype=dtype)) <= 1.05 * total, dtype


def test_a_dense_bf16_head_stays_bf16_in_a_float32_model(tmp_path, monkeypatch):
    """An untied head the checkpoint keeps dense (bf16) is held as stored (StoredLinear) while
    the model computes in float32: no float32 copy, the same logits as the float32 model
    holding the decoded weights, and native decode steps read it as bf16."""
    from dynquant.runtime.memory import resident_weight_nbytes
    from dynquant.runtime.stored_linear import StoredLinear

    src = save_tiny_model("llama", tmp_path / "src")  # untied lm_head
    source = resolve_model(str(src))
    modules = sorted(s.module for s in source.tensor_specs()
                     if s.quantizable and s.module != "lm_head")
    doc = quantize_model(source, {m: 4 for m in modules}, tmp_path / "q", progress=False,
                         modules_to_not_convert=("lm_head",))
    assert "lm_head" not in doc["layers"]
    model = load(tmp_path / "q", dtype=torch.float32)
    assert isinstance(model.lm_head, StoredLinear)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert resident_weight_nbytes(model) <= 1.05 * doc["accounting"]["total_nbytes"]
    reference = load_dequantized(tmp_path / "q", torch.float32)
    ids = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(6))
    for batch in (ids, ids[:, :1]):  # prefill: float32 blocks; one token: the bf16 kernel
        with torch.no_grad():
            torch.testing.assert_close(model(batch).logits, reference(batch).logits,
                                       rtol=1e-4, atol=1e-4)
    tokens, _ = _greedy(model, ids)
    monkeypatch.setenv("DYNQUANT_NATIVE_DECODE", "0")
    assert torch.equal(_greedy(model, ids)[0], tokens)


def test_a_padded_prompt_keeps_transformers_forward(quantized):
    """An attention mask that hides positions (left padding) is transformers' to apply: those
    steps are not native, and the tokens are the eager path's."""
    _, ck_dir, _, _ = quantized["llama"]
    model = load(ck_dir, dtype=torch.float32)
    ids = torch.randint(1, 384, (1, 8), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    calls = []
    step = type(model.forward)._step
    model.forward._step = lambda *a: calls.append(1) or step(model.forward, *a)
    with torch.no_grad():
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                       do_sample=False)
    assert len(calls) == 3  # the unpadded run's three decode steps alone
    with torch.no_grad():
        eager = load(ck_dir, dtype=torch.float32)
        eager.forward = type(eager).forward.__get__(eager)  # transformers' forward only
        assert torch.equal(padded, eager.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                  do_sample=False))
