"""The reference hybrid architecture: names, shapes, cache, generate, save/load."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from dynquant.models.hybrid.inventory import hybrid_tensor_specs
from dynquant.models.hybrid.modeling import DynquantHybridForCausalLM
from dynquant.models.presets import preset_config
from dynquant.models.registration import register


def test_inventory_matches_the_model_for_every_preset():
    for name in ("tiny", "small", "seed"):
        cfg = preset_config(name)
        with torch.device("meta"):
            model = DynquantHybridForCausalLM(cfg)
        params = {n: tuple(p.shape) for n, p in model.named_parameters()}
        specs = {s.name: s.shape for s in hybrid_tensor_specs(cfg)}
        assert params == specs, name


def test_seed_preset_size():
    cfg = preset_config("seed")
    specs = hybrid_tensor_specs(cfg)
    dense = sum(s.stored_nbytes for s in specs if not s.quantizable)
    quantized = sum(torch.Size(s.shape).numel() for s in specs if s.quantizable)
    assert dense == 998_912 and quantized == 1_690_697_728


def test_cached_decoding_equals_full_recompute():
    torch.manual_seed(0)
    model = DynquantHybridForCausalLM(preset_config("tiny")).eval()
    ids = torch.randint(0, 512, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :9], use_cache=True)
        steps, cache = [out.logits], out.cache
        for i in range(9, 14):
            out = model(ids[:, i : i + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_generate_and_save_from_pretrained(tmp_path):
    register()
    torch.manual_seed(1)
    model = DynquantHybridForCausalLM(preset_config("tiny")).eval()
    prompt = torch.randint(0, 512, (1, 5))
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached) and cached.shape == (1, 13)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is DynquantHybridForCausalLM
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(again(prompt).logits, model(prompt).logits)


def test_moe_routes_only_to_topk_experts():
    torch.manual_seed(2)
    cfg = preset_config("tiny")
    moe = DynquantHybridForCausalLM(cfg).model.layers[0].moe
    x = torch.randn(1, 6, cfg.hidden_size)
    with torch.no_grad():
        y = moe(x)
        # reference: dense evaluation of every expert, masked to the top-k
        flat = x.reshape(-1, cfg.hidden_size)
        probs = moe.gate(flat).softmax(-1)
        w, idx = probs.topk(cfg.num_experts_per_tok)
        w = w / w.sum(-1, keepdim=True)
        ref = moe.sw2(torch.nn.functional.silu(moe.sw1(flat)) * moe.sw3(flat))
        for n in range(flat.shape[0]):
            for k in range(cfg.num_experts_per_tok):
                e = idx[n, k]
                h = flat[n]
                ref[n] += w[n, k] * ((torch.nn.functional.silu(h @ moe.w1[e]) * (h @ moe.w3[e]))
                                     @ moe.w2[e])
    torch.testing.assert_close(y.reshape(-1, cfg.hidden_size), ref, atol=1e-5, rtol=1e-5)
