"""Every supported family: quantize a tiny random instance, load it packed, match the float model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dynquant import validate_checkpoint
from dynquant.models.sources import resolve_model
from dynquant.pipeline.quantize import quantize_model
from dynquant.runtime.loader import load, load_dequantized
from dynquant.runtime.packed_modules import QuantEmbedding, QuantExpertBank, QuantLinear
from model_zoo import family_configs, save_tiny_model

FAMILIES = sorted(family_configs())
CYCLE = (2, 3, 4, 8)


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
    from dynquant.pipeline.weights import SafetensorsWeights

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


def test_lm_head_when_asked_and_modules_kept_dense(tmp_path, capsys):
    from dynquant.cli import main

    src = save_tiny_model("llama", tmp_path / "src")  # untied lm_head
    source = resolve_model(str(src))
    plain = {s.module for s in source.tensor_specs() if s.quantizable}
    assert "lm_head" not in plain
    with_head = {s.module for s in source.tensor_specs(lm_head_quantized=True) if s.quantizable}
    assert with_head == plain | {"lm_head"}
    widths = {m: 4 for m in with_head}
    (tmp_path / "w.json").write_text(json.dumps(widths))
    assert main(["quantize", str(src), "--widths", str(tmp_path / "w.json"), "-o",
                 str(tmp_path / "q"), "--lm-head", "--not-convert", "*.mlp.down_proj"]) == 0
    out = capsys.readouterr().out
    assert "elements by tensor type" in out and "mlp.down_proj" in out
    doc = json.loads((tmp_path / "q" / "dynquant.json").read_text())
    qc = doc["quantization_config"]
    assert qc["lm_head_quantized"] is True and "lm_head" in doc["layers"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.down_proj",
                                            "model.layers.1.mlp.down_proj"]
    assert not any(n.endswith("down_proj") for n in doc["layers"])
    model = load(tmp_path / "q")
    assert isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
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
