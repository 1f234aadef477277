"""`dynquant generate`: streamed greedy completion from a packed checkpoint."""

from __future__ import annotations

import re

import pytest
import torch

from dynquant.cli import main
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.generate import generate_text
from dynquant.runtime.loader import load_dequantized
from model_zoo import save_tiny_model, save_tiny_tokenizer


def test_generate_streams_the_greedy_completion(tiny_checkpoint, capsys):
    checkpoint = tiny_checkpoint("dynquant_hybrid", 4, tokenizer=512)
    assert (checkpoint / "tokenizer.json").is_file()  # side files travel with the checkpoint

    assert main(["generate", str(checkpoint), "--prompt", "Once upon a time",
                 "--max-new-tokens", "6", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert printed.startswith("Once upon a time")  # the text alone; what runs is on stderr
    assert "\n[compute dtype float32 (CPU " in "\n" + captured.err
    # llama.cpp's three: prefill and decode speed, resident weights
    assert re.search(r"^\[prefill \d+ tokens [\d.]+ tok/s; decode \d+ tokens [\d.]+ tok/s; "
                     r"weights [\d.]+ MiB resident\]$", captured.err, re.M), captured.err

    stats = []
    completion = generate_text(checkpoint, "Once upon a time", 6, stream=False,
                               stats=stats)
    tok = load_tokenizer(checkpoint)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = load_dequantized(checkpoint).generate(ids, max_new_tokens=6, do_sample=False,
                                                        pad_token_id=tok.eos_token_id)
    assert completion == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert printed.strip().endswith(completion.strip())
    new = ref.shape[1] - ids.shape[1]
    assert (stats[0].prompt_tokens, stats[0].new_tokens) == (ids.shape[1], new)
    assert stats[0].prefill_s > 0 and stats[0].weight_nbytes > 0


def test_chat_uses_the_models_template(tmp_path, capsys):
    import json

    src = save_tiny_model("llama", tmp_path / "src")
    save_tiny_tokenizer(src)
    source = resolve_model(str(src))
    quantize_model(source, {s.module: 8 for s in source.tensor_specs() if s.quantizable},
                   tmp_path / "q", progress=False)
    args = ["generate", str(tmp_path / "q"), "--prompt", "hi", "--max-new-tokens", "2", "--chat"]
    capsys.readouterr()
    assert main(args) == 2  # no template: one line
    err = capsys.readouterr().err
    assert "chat template" in err and err.count("\n") == 1
    config = tmp_path / "q" / "tokenizer_config.json"
    doc = json.loads(config.read_text())
    doc["chat_template"] = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<bot>"
    config.write_text(json.dumps(doc))
    stats = []
    generate_text(tmp_path / "q", "hi", 2, stream=False, chat=True, stats=stats)
    tok = load_tokenizer(tmp_path / "q")
    assert stats[0].prompt_tokens == len(tok("<user>hi<bot>")["input_ids"])


def test_generate_without_tokenizer_is_a_clear_error(tiny_checkpoint, capsys):
    assert main(["generate", str(tiny_checkpoint("tiny", 4)), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynquant: error:") and "tokenizer" in err and err.count("\n") == 1


def test_generate_on_a_path_that_is_not_a_checkpoint_names_what_is_missing(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "no-such"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint folder" in err and "no-such" in err and err.count("\n") == 1
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer.json").write_text("{}")  # a folder, but no checkpoint
    assert main(["generate", str(tmp_path / "plain"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no dynquant.json" in err and "tokenizer" not in err and err.count("\n") == 1


def test_sampling_is_seeded_and_kept_to_the_top_k_and_top_p():
    from types import SimpleNamespace

    from dynquant.pipeline.report.generate import Sampler

    logits = torch.tensor([0.0, 3.0, 1.0, 2.5])  # probabilities 0.03, 0.56, 0.08, 0.34
    top2 = SimpleNamespace(top_k=2, top_p=None)
    assert {Sampler(1.0, top2, seed)(logits) for seed in range(40)} == {1, 3}
    assert len({Sampler(1.0, top2, 7)(logits) for _ in range(5)}) == 1  # seeded
    nucleus = SimpleNamespace(top_k=None, top_p=0.5)  # the most likely token already holds 0.56
    assert {Sampler(1.0, nucleus, seed)(logits) for seed in range(20)} == {1}
    wider = SimpleNamespace(top_k=None, top_p=0.9)  # the token that crosses 0.9 stays
    assert {Sampler(1.0, wider, seed)(logits) for seed in range(200)} == {1, 2, 3}


def test_decoding_stops_at_an_end_of_text_token(tiny_checkpoint):
    from dynquant.pipeline.report.generate import decode_tokens, greedy
    from dynquant.runtime.loader import load

    model = load(tiny_checkpoint("tiny", 4), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 3]])
    heard = []
    tokens = decode_tokens(model, ids, 6, greedy, on_token=heard.append)
    assert len(tokens) == 6 and heard == tokens
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              pad_token_id=0)
    assert tokens == want[0, 3:].tolist()
    end = tokens[-1]  # the first time it comes, the run ends (with it)
    assert decode_tokens(model, ids, 6, greedy, stop={end}) == tokens[:tokens.index(end) + 1]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "lfm2", "dynquant_hybrid",
                                    "gemma3"])
def test_a_prefill_keeps_the_last_positions_logits_and_the_cache(family):
    """The prompt's forward as generate runs it (last position's logits, the last layer's
    feed-forward on that position only) gives the full forward's last logits, and the cache it
    leaves decodes the next token to the same logits."""
    from transformers import AutoModelForCausalLM

    from dynquant.pipeline.report.generate import prefill
    from model_zoo import family_configs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_configs()[family]).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.05)
        ids = torch.randint(0, 384, (1, 20))
        full = model(input_ids=ids, use_cache=True)
        last = getattr(model.model.layers[-1], "mlp", None)
        seen = []
        if last is not None:  # lfm2 and the hybrid name theirs otherwise: run whole
            last.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].shape[1]))
        fast = prefill(model, ids)
        assert seen == ([] if last is None else [1])
        torch.testing.assert_close(fast.logits[0, -1], full.logits[0, -1], rtol=1e-5,
                                   atol=1e-5)
        nxt = torch.tensor([[5]])
        step = {}
        for name, out in (("full", full), ("fast", fast)):
            step[name] = model(input_ids=nxt, cache=out.cache,
                               use_cache=True).logits[0, -1]
        torch.testing.assert_close(step["fast"], step["full"], rtol=1e-5, atol=1e-5)
