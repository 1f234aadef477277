"""`dynquant eval`: perplexity, KL(base || model), top-1 agreement, on the shipped models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dynquant import evaluate
from dynquant.cli import main
from dynquant.errors import ModelError
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.evaluate import evaluate_models, text_windows
from dynquant.runtime.any_model import load_any
from model_zoo import save_tiny_model, save_tiny_tokenizer

ROOT = Path(__file__).parents[2]
HYBRID = ROOT / "models" / "hybrid-ref"
HELDOUT = ROOT / "data" / "heldout.txt"


def test_model_against_itself_is_kl_zero(capsys):
    assert main(["eval", str(HYBRID), "--base", str(HYBRID), "--text", str(HELDOUT),
                 "--ctx", "128", "--max-tokens", "512", "--spread", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens"] == 512 and r["ctx"] == 128
    assert r["kl_mean"] == 0.0 and r["kl_p99"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["ppl_model"] == r["ppl_base"] and r["delta_ppl"] == 0.0


def test_perplexity_agrees_with_direct_cross_entropy():
    tok = load_tokenizer(HYBRID)
    model = load_any(HYBRID)
    ids = torch.tensor(tok(HELDOUT.read_text()[:4000])["input_ids"])
    windows = text_windows(tok, HELDOUT.read_text()[:4000], ctx=64, max_tokens=256)
    result = evaluate_models(model, model, windows, progress=False)
    nll = 0.0
    with torch.no_grad():
        for w in range(4):
            x = ids[w * 64 : (w + 1) * 64 + 1]
            logits = model(x[None, :-1]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
    assert result.tokens == 256
    assert result.ppl_model == pytest.approx(math.exp(nll / 256), rel=1e-6)


def test_spread_windows_sample_the_whole_text():
    tok = load_tokenizer(HYBRID)
    text = HELDOUT.read_text()[:20000]
    ids = torch.tensor(tok(text)["input_ids"])
    every = text_windows(tok, text, ctx=128)
    assert len(every) == (len(ids) - 1) // 128
    assert torch.equal(every[3], ids[3 * 128 : 4 * 128 + 1])
    assert torch.equal(text_windows(tok, text, ctx=128, max_tokens=500), every[:3])
    spread = text_windows(tok, text, ctx=128, max_tokens=500, spread=True)
    n = len(every) - 1
    assert torch.equal(spread, every[[0, round(n / 2), n]])
    assert torch.equal(text_windows(tok, text, ctx=128, spread=True), every)


def test_quantized_reference_kl_is_small_and_ordered(tmp_path):
    source = resolve_model(str(HYBRID))
    modules = [s.module for s in source.tensor_specs() if s.quantizable]
    kl = {}
    for bits in (8, 4):
        quantize_model(source, {m: bits for m in modules}, tmp_path / f"q{bits}", progress=False)
        kl[bits] = evaluate(tmp_path / f"q{bits}", HYBRID, HELDOUT, ctx=256, max_tokens=2048,
                            progress=False)
    assert 0 < kl[8].kl_mean < kl[4].kl_mean < 0.2
    assert kl[8].kl_mean < 0.01
    assert kl[8].top1_agreement > kl[4].top1_agreement > 0.7
    assert abs(kl[8].delta_ppl) < abs(kl[4].delta_ppl) + 0.5


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="no such text file"):
        evaluate(HYBRID, HYBRID, tmp_path / "missing.txt")
    (tmp_path / "short.txt").write_text("Once upon a time.")
    with pytest.raises(ModelError, match="fewer than one context"):
        evaluate(HYBRID, HYBRID, tmp_path / "short.txt", ctx=512)
    other = save_tiny_model("dynquant_hybrid", tmp_path / "other")
    save_tiny_tokenizer(other, vocab_size=512)
    with pytest.raises(ModelError, match="different tokenizers"):
        evaluate(other, HYBRID, HELDOUT)
