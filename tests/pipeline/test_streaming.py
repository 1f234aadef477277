"""Layer-streamed calibration and Fisher sensitivities, held to the whole-model computations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import spearmanr
from transformers import AutoModelForCausalLM, LlamaConfig

from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.divergence import log_probs, token_kl
from dynquant.numerics.quantizer import quantize_tensor
from dynquant.pipeline.calibrate import fisher as fisher_module
from dynquant.pipeline.calibrate.block_stream import ActivationStore, BlockStream
from dynquant.pipeline.calibrate.calibration_pass import moments_files, run_calibration_pass
from dynquant.pipeline.calibrate.fisher import fisher_kl
from dynquant.pipeline.calibrate.statistics import InputStatistics, collect_stats
from dynquant.pipeline.calibrate.text import calibration_ids
from dynquant.pipeline.calibrate.weights import SafetensorsWeights
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.probe import KLProbe
from dynquant.pipeline.measure.run import measure
from dynquant.runtime.any_model import load_any
from model_zoo import save_tiny_model, save_tiny_tokenizer
from worker_executor import AsAWorker

ROOT = Path(__file__).parents[2]
FAMILIES = ("llama", "qwen3", "qwen3_moe", "olmoe", "lfm2", "lfm2_moe", "dynquant_hybrid")


def _stream(model_dir: Path, ids: torch.Tensor, chunk: int = 2,
            dtype: torch.dtype = torch.float32):
    source = resolve_model(str(model_dir))
    modules = {s.module for s in source.tensor_specs() if s.quantizable}
    weights = SafetensorsWeights(model_dir, source.conversion_transforms())
    return BlockStream(source, weights, ids, chunk=chunk, dtype=dtype), modules


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_statistics_equal_whole_model_statistics(family, tmp_path):
    model_dir = save_tiny_model(family, tmp_path / family)
    ids = torch.randint(0, 384, (3, 24), generator=torch.Generator().manual_seed(1))
    stream, modules = _stream(model_dir, ids)
    cal = run_calibration_pass(stream, modules)
    model = load_any(model_dir, dtype="float32")
    whole = collect_stats(model, ids, modules)
    assert sorted(cal.stats) == sorted(whole)
    for name, value in whole.items():
        torch.testing.assert_close(cal.stats[name], value, rtol=2e-5, atol=1e-7, msg=name)
    banks = [n for n in whole if n.endswith(".routed_tokens")]
    if family in ("qwen3_moe", "olmoe", "lfm2_moe", "dynquant_hybrid"):
        assert banks, "expert banks record their routed tokens"
        k = model.config.num_experts_per_tok
        assert all(int(whole[b].sum()) == ids.numel() * k for b in banks)
    # whatever follows the blocks, run from the streamed last hidden states, gives the logits
    for name, module in stream.head_modules():
        stream.materialize(module, name)
    final = cal.inputs.get(len(stream.blocks))
    logits = torch.cat([stream.head_logits(f, c) for f, c in zip(final, stream.chunks(),
                                                                    strict=True)])
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    cal.close()


def test_streaming_holds_one_block_of_a_multi_shard_model(tmp_path):
    """Parameters in memory never exceed the largest block (or the embedding), whatever the
    model's size: what is not running stays on the meta device."""
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=172,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) >= 3
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    stream, modules = _stream(tmp_path / "m", ids)
    peak = [0]

    def live() -> int:
        return sum(p.numel() for p in stream.model.parameters() if p.device.type != "meta")

    for method in ("materialize", "release"):
        original = getattr(stream, method)

        def tracked(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            peak[0] = max(peak[0], live())
            return out
        setattr(stream, method, tracked)
    cal = run_calibration_pass(stream, modules)
    fisher_kl(cal, modules, lambda _s, w: quantize_tensor(w, 8, 32))
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.lm_head.weight.numel() + model.model.norm.weight.numel()
    assert 0 < peak[0] <= max(block, head, model.model.embed_tokens.weight.numel())
    assert live() == 0
    cal.close()


@pytest.mark.parametrize("beside", [False, True])
def test_activation_store_spills_to_disk_past_its_limit(tmp_path, beside):
    """Into the system's temp dir, or the folder it is given (a measure's partial folder)."""
    store = ActivationStore(limit_bytes=100, directory=tmp_path if beside else None)
    small, large = [torch.ones(4, 4)], [torch.arange(64.0).reshape(2, 32), torch.ones(3)]
    store.put(0, small)
    store.put(1, large)
    assert 0 in store.memory and 1 not in store.memory
    for got, want in zip(store.get(1), large, strict=True):
        torch.testing.assert_close(got, want)
    folder = Path(store.tmp.name)
    assert (folder.parent == tmp_path) == beside
    store.close()
    assert not folder.exists()


def test_second_moments_are_the_inputs_gram_matrix(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path / "llama")
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(2))
    stream, modules = _stream(model_dir, ids)
    cal = run_calibration_pass(stream, modules, moments_files(tmp_path / "moments"))
    saved = load_file(tmp_path / "moments" / "block_001.safetensors")
    model = load_any(model_dir, dtype="float32")
    stats = InputStatistics(model, modules, second_moments=True)
    with torch.no_grad():
        for row in ids:
            model(row[None])
    stats.remove()
    want = stats.second_moments()["model.layers.1.mlp.down_proj"]
    assert want.shape == (172, 172)
    torch.testing.assert_close(saved["model.layers.1.mlp.down_proj"], want, rtol=1e-4,
                               atol=1e-6)
    cal.close()


@pytest.mark.parametrize(("name", "least"), [("llama-ref", 0.9), ("hybrid-ref", 0.8)])
def test_fisher_ranks_modules_like_the_exact_probe(name, least):
    """On the trained reference models, the streamed estimate of each module's 3-bit KL ranks
    the modules as the exact probe (one forward per module) does, and is of its size. The MoE
    model's bar is lower: a token switching experts under a perturbation adds KL that no
    gradient sees (docs/pipeline.md); its allocations still match (BENCHMARKS.md)."""
    model_dir = ROOT / "models" / name
    ids = calibration_ids(load_tokenizer(model_dir), [ROOT / "data" / "calibration.txt"], 6,
                          192)
    stream, modules = _stream(model_dir, ids, chunk=1)
    cal = run_calibration_pass(stream, modules)

    def probe_weight(spec, w):
        return quantize_tensor(w, 3, 128, importance=cal.stats.get(spec.module))

    estimate = fisher_kl(cal, modules, probe_weight)
    probe = KLProbe(load_any(model_dir, dtype="float32"), ids)
    specs = {s.module: s for s in stream.source.tensor_specs() if s.quantizable}
    exact = {m: probe.kl_with(m, probe_weight(
        specs[m], stream.weights.get(specs[m]).float()).dequantize(torch.float32))
             for m in sorted(modules)}
    cal.close()
    order = sorted(exact)
    rho = spearmanr([estimate[m] for m in order], [exact[m] for m in order]).statistic
    assert rho >= least, rho
    ratio = sum(estimate.values()) / sum(exact.values())
    assert 0.3 < ratio < 1.5, ratio


@pytest.mark.parametrize("name", ["llama-ref", "hybrid-ref"])
def test_a_bf16_fisher_pass_measures_what_the_float32_one_does(name):
    """``--dtype bfloat16``: the Fisher pass (the head's backward, each block's, the
    embedding's, expert banks') runs on the bf16 model, and on the trained reference models
    ranks the modules as the float32 pass does (Spearman 0.99), with about the same total
    (llama-ref 0.90x, hybrid-ref 1.00x): less than the label draws' own noise, which another
    seed shows (Spearman 0.73 / 0.85, totals 1.04x / 0.61x). Single modules move by up to ~30%:
    bf16 logits draw other labels."""
    model_dir = ROOT / "models" / name
    ids = calibration_ids(load_tokenizer(model_dir), [ROOT / "data" / "calibration.txt"], 4,
                          128)
    estimates = []
    for dtype in (torch.float32, torch.bfloat16):
        stream, modules = _stream(model_dir, ids, chunk=1, dtype=dtype)
        cal = run_calibration_pass(stream, modules)
        estimates.append(fisher_kl(cal, modules, lambda _s, w: quantize_tensor(w.float(), 3, 32)))
        cal.close()
    full, low = estimates
    assert full.keys() == low.keys() == modules
    order = sorted(modules)
    rho = spearmanr([low[m] for m in order], [full[m] for m in order]).statistic
    total = sum(low.values()) / sum(full.values())
    assert rho >= 0.95 and math.isclose(total, 1, rel_tol=0.15), (rho, total)


@pytest.mark.parametrize(("family", "target"), [
    ("llama", "model.layers.0.mlp.down_proj"),
    ("llama", "lm_head"),
    ("gemma3", "model.embed_tokens"),  # tied and scaled: the head's and the lookup's shares
])
def test_fisher_is_the_kl_of_a_small_perturbation(family, target, tmp_path):
    """For a small perturbation the second-order formula is the KL: 4-bit weights of one
    module, estimated vs measured, on a tiny model, with enough sequences and label draws
    (24 x 8: the estimate's noise is about sqrt(2 / 192) = 10%) to average the noise."""
    model_dir = save_tiny_model(family, tmp_path / family)
    ids = torch.randint(0, 384, (24, 32), generator=torch.Generator().manual_seed(3))
    stream, _ = _stream(model_dir, ids, chunk=1)
    cal = run_calibration_pass(stream, {target})

    def probe_weight(_spec, w):
        return quantize_tensor(w, 4, 32)

    estimate = fisher_kl(cal, {target}, probe_weight, draws=8)[target]
    cal.close()
    spec = next(s for s in stream.source.tensor_specs() if s.module == target)
    probe = KLProbe(load_any(model_dir, dtype="float32"), ids)
    exact = probe.kl_with(target, probe_weight(spec, stream.weights.get(spec).float())
                          .dequantize(torch.float32))
    assert math.isclose(estimate, exact, rel_tol=0.25), (estimate, exact)


def test_measure_writes_second_moments_when_asked(tmp_path):
    model_dir = save_tiny_model("qwen3", tmp_path / "src")
    save_tiny_tokenizer(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(["the little fox went to the river to drink"] * 60))
    opts = MeasureOptions.of(calib=[str(calib)], calib_seqs=2, calib_len=32, budgets=[3.25],
                          second_moments=True)
    doc = measure(resolve_model(str(model_dir)), opts, tmp_path / "out" / "maps.json",
                  progress=False)
    assert doc["method"] == "fisher"
    blocks = sorted((tmp_path / "out" / "maps.moments").glob("block_*.safetensors"))
    assert [b.name for b in blocks] == ["block_000.safetensors", "block_001.safetensors"]
    assert all(m["sensitivity"] > 0 for m in doc["modules"].values())
    # the moments come from their own pass over moment_seqs (16) windows, not the 2 of the
    # statistics: X^T X / n of the whole model's inputs over those windows
    from dynquant.models.tokenizer import load_tokenizer
    from dynquant.pipeline.calibrate.statistics import InputStatistics
    from dynquant.pipeline.calibrate.text import calibration_ids
    from dynquant.runtime.any_model import load_any

    model = load_any(model_dir, dtype="float32")
    name = "model.layers.1.mlp.down_proj"
    ids = calibration_ids(load_tokenizer(model_dir), [calib], opts.moment_seqs, 32)
    whole = InputStatistics(model, {name}, second_moments=True)
    with torch.no_grad():
        for row in ids:
            model(row[None])
    whole.remove()
    streamed = load_file(blocks[1])[name]
    torch.testing.assert_close(streamed, whole.second_moments()[name], rtol=1e-4, atol=1e-6)


def test_killed_measure_resumes_to_identical_maps(tmp_path, monkeypatch):
    """A measurement stopped part way keeps its calibration and finished modules in
    ``.maps.json.partial/``; the rerun computes only the rest and writes the same bytes."""
    import dynquant.pipeline.measure.candidates as candidates_module
    import dynquant.pipeline.measure.run as measure_module

    model_dir = save_tiny_model("qwen3", tmp_path / "src")
    save_tiny_tokenizer(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(["the little fox went to the river to drink"] * 60))
    opts = MeasureOptions.of(calib=[str(calib)], calib_seqs=2, calib_len=32, budgets=[3.25])
    source = resolve_model(str(model_dir))
    measure(source, opts, tmp_path / "whole" / "maps.json", progress=False)

    original, calls = candidates_module.module_entry, []

    def dies_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(next(iter(args)).module)
        return original(*args, **kwargs)

    out = tmp_path / "resumed" / "maps.json"
    monkeypatch.setattr(candidates_module, "module_entry", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        measure(source, opts, out, progress=False)
    assert not out.exists() and (out.parent / ".maps.json.partial").is_dir()

    def no_second_fisher_pass(*_args, **_kwargs):
        raise AssertionError("the kept Fisher KLs are reused")

    again: list[str] = []
    monkeypatch.setattr(measure_module, "fisher_kl", no_second_fisher_pass)
    monkeypatch.setattr(candidates_module, "module_entry",
                        lambda *a, **k: again.append(a[0].module) or original(*a, **k))
    measure(source, opts, out, progress=False)
    assert not set(again) & set(calls)
    assert out.read_bytes() == (tmp_path / "whole" / "maps.json").read_bytes()
    assert not (out.parent / ".maps.json.partial").exists()


def test_expert_banks_quantize_each_expert_with_its_own_inputs():
    gen = torch.Generator().manual_seed(4)
    bank = torch.randn(3, 20, 96, generator=gen)
    per_expert = torch.rand(3, 96, generator=gen) + 0.1
    qt = quantize_tensor(bank, 3, 32, importance=per_expert)
    for e in range(3):
        alone = quantize_tensor(bank[e], 3, 32, importance=per_expert[e])
        rows = slice(e * 20, (e + 1) * 20)
        assert torch.equal(qt.qweight[rows], alone.qweight)
        assert torch.equal(qt.scales[rows], alone.scales)
    from dynquant.numerics.quantizer import relative_error

    w_hat = qt.dequantize(torch.float32).reshape(bank.shape)
    want = float(((w_hat - bank).square() * per_expert[:, None]).sum()
                 / (bank.square() * per_expert[:, None]).sum())
    assert relative_error(bank, qt, per_expert) == pytest.approx(want, rel=1e-5)


def test_importance_of_a_bank_comes_from_its_routed_tokens():
    from dynquant.pipeline.calibrate.statistics import importance_of

    stats = {"m.experts.down_proj.expert_inputs": torch.tensor([[1.0, 2.0], [0.0, 0.0],
                                                                 [3.0, 4.0]]),
             "m.experts.down_proj.routed_tokens": torch.tensor([1.0, 0.0, 3.0]),
             "m.moe.w1.expert_row_inputs": torch.ones(3, 2),
             "m.moe.w1.routed_tokens": torch.ones(3), "m.q": torch.ones(2)}
    got = importance_of(stats, "m.experts.down_proj", (3, 8, 2))
    # the expert no token reached takes the token-weighted mean of the others
    torch.testing.assert_close(got, torch.tensor([[1.0, 2.0], [2.5, 3.5], [3.0, 4.0]]))
    # a bank used as x @ W[e]: its inputs run along its rows, not the groups' columns
    assert importance_of(stats, "m.moe.w1", (3, 2, 2)) is None
    assert importance_of(stats, "m.experts.gate_up_proj", (3, 8, 2)) is None
    assert importance_of(stats, "m.q", (2, 2)) is stats["m.q"]
    # a stats file from before banks had their own keys: per owner, first projections only
    old = {"m.experts.expert_inputs": stats["m.experts.down_proj.expert_inputs"],
           "m.experts.routed_tokens": stats["m.experts.down_proj.routed_tokens"]}
    torch.testing.assert_close(importance_of(old, "m.experts.gate_up_proj", (3, 8, 2)), got)
    assert importance_of(old, "m.experts.down_proj", (3, 2, 8)) is None


def test_measure_weights_expert_banks_by_their_tokens(tmp_path):
    model_dir = save_tiny_model("qwen3_moe", tmp_path / "src")
    save_tiny_tokenizer(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(["the little fox went to the river to drink"] * 60))
    source = resolve_model(str(model_dir))
    opts = MeasureOptions.of(calib=[str(calib)], calib_seqs=2, calib_len=32, budgets=[3.25])
    calibrated = measure(source, opts, tmp_path / "c" / "maps.json", progress=False)
    plain = measure(source, MeasureOptions(budgets=[3.25], method="weight"), None,
                    progress=False)
    stats = load_file(tmp_path / "c" / "maps.stats.safetensors")
    for leaf in ("gate_up_proj", "down_proj"):  # up and down projections alike
        bank = f"model.layers.0.mlp.experts.{leaf}"
        assert int(stats[f"{bank}.routed_tokens"].sum()) == 2 * 32 * 2
        errors = [[c["error"] for c in doc["modules"][bank]["candidates"]]
                  for doc in (calibrated, plain)]
        assert errors[0] != errors[1], leaf  # weighted by each expert's own inputs


@pytest.mark.parametrize("family", ["qwen3_moe", "dynquant_hybrid"])
def test_every_bank_gets_each_experts_own_statistics(family, tmp_path):
    """Per expert of every bank (down projections too): routed tokens, mean squares and
    X^T X over that expert's own inputs, streamed == whole model; for the hybrid model's first
    projections, equal to the tokens its router sends (computed here from the gate)."""
    model_dir = save_tiny_model(family, tmp_path / family)
    ids = torch.randint(0, 384, (3, 24), generator=torch.Generator().manual_seed(4))
    stream, modules = _stream(model_dir, ids)
    cal = run_calibration_pass(stream, modules, moments_files(tmp_path / "moments"))
    saved = load_file(tmp_path / "moments" / "block_000.safetensors")
    model = load_any(model_dir, dtype="float32")
    k = model.config.num_experts_per_tok
    params = dict(model.named_parameters())
    banks = sorted(m for m in modules if m.startswith(stream.block_prefix(0) + ".")
                   and m in params and params[m].ndim == 3)
    assert len(banks) == (3 if family == "dynquant_hybrid" else 2)
    rows = family == "dynquant_hybrid"
    for bank in banks:
        per = cal.stats[f"{bank}.{'expert_row_inputs' if rows else 'expert_inputs'}"]
        tokens = cal.stats[f"{bank}.routed_tokens"]
        assert int(tokens.sum()) == ids.numel() * k
        h = saved[bank]
        assert h.shape == (len(tokens), per.shape[1], per.shape[1])
        # each expert's diagonal of X^T X / n is its mean squares
        torch.testing.assert_close(torch.diagonal(h, dim1=1, dim2=2), per, rtol=1e-4,
                                   atol=1e-6)
    if rows:  # independent: the MoE block's own router over its inputs
        moe = model.model.layers[0].moe
        seen = []
        handle = moe.register_forward_pre_hook(lambda _m, i: seen.append(i[0].detach()))
        with torch.no_grad():
            model(ids)
        handle.remove()
        x = seen[0].reshape(-1, seen[0].shape[-1]).float()
        top = moe.gate(x).topk(moe.top_k, dim=-1).indices
        for e in range(len(moe.w1)):
            xe = x[(top == e).any(-1)]
            torch.testing.assert_close(saved[f"{stream.block_prefix(0)}.moe.w1"][e],
                                       xe.T @ xe / max(len(xe), 1), rtol=1e-4, atol=1e-5)
    cal.close()


def test_labels_are_drawn_from_the_models_distribution():
    from dynquant.pipeline.calibrate.fisher import _sample

    probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    labels = _sample(probs.log().expand(200_000, 4), torch.Generator().manual_seed(0))
    share = torch.bincount(labels[:, 0], minlength=4) / 200_000
    torch.testing.assert_close(share, probs, atol=5e-3, rtol=0)  # ~5 standard errors


@pytest.mark.parametrize("cap", [None, 3.0])
def test_head_terms_equal_the_vocabulary_wide_products(cap, tmp_path, monkeypatch):
    """The head's share priced from the drawn labels' rows and one expected term per sequence
    equals G . dW taken over the whole vocabulary at every position (the taps), with and
    without soft-capped logits: the same labels, the same estimate to float rounding."""
    import dynquant.pipeline.calibrate.fisher as fisher

    model_dir = save_tiny_model("qwen3", tmp_path / "qwen3")  # tied: head and lookup shares
    ids = torch.randint(0, 384, (3, 40), generator=torch.Generator().manual_seed(5))
    stream, modules = _stream(model_dir, ids, chunk=1)
    cal = run_calibration_pass(stream, modules)
    head = {"model.embed_tokens"}
    if cap is not None:  # logits T(z) = cap * tanh(z / cap), as Gemma 2 computes them
        monkeypatch.setattr(fisher, "_softcap", lambda _config: cap)
        original = stream.head_logits
        monkeypatch.setattr(stream, "head_logits", lambda h, i: cap * torch.tanh(
            original(h, i) / cap))
    monkeypatch.setattr(fisher, "HEAD_LOGITS", 384 * 16)  # several chunks of positions

    def probe_weight(_spec, w):
        return quantize_tensor(w, 3, 32)

    fast = fisher_kl(cal, head, probe_weight, draws=3)
    monkeypatch.setattr(fisher, "HEAD_MATCH", -1.0)  # every model's logits "do not match"
    taps = fisher_kl(cal, head, probe_weight, draws=3)
    cal.close()
    assert fast["model.embed_tokens"] > 0
    assert math.isclose(fast["model.embed_tokens"], taps["model.embed_tokens"], rel_tol=1e-4)


class _OnAWorker(AsAWorker):
    """As a cluster runs the jobs: a block's sequences split into CLUSTER_SHARD_SEQS a job."""

    runs_here = False


@pytest.mark.parametrize(("family", "chunk"), [("llama", 1), ("qwen3_moe", 2)])
def test_the_fisher_pass_in_shards_run_as_workers_is_the_same_bits(family, chunk, tmp_path,
                                                                   monkeypatch):
    """Each block's backward in jobs of CLUSTER_SHARD_SEQS sequences (whole chunks: 12 or 6
    a block), run as workers run them
    (weights from the files, the driver's probe codes shared by the block's jobs; expert banks
    through their gradient hooks), gives the estimate of the one job run here, bit for bit."""
    model_dir = save_tiny_model(family, tmp_path / family)
    ids = torch.randint(0, 384, (12, 24), generator=torch.Generator().manual_seed(5))
    stream, modules = _stream(model_dir, ids, chunk=chunk)
    cal = run_calibration_pass(stream, modules)

    def probe_weight(_spec, w):
        return quantize_tensor(w, 3, 32)

    jobs = []
    original = fisher_module.fisher_block_job

    def counted(job, block):
        jobs.append(job.shard.block)
        return original(job, block)

    monkeypatch.setattr(fisher_module, "fisher_block_job", counted)
    sharded = fisher_kl(cal, modules, probe_weight, executor=_OnAWorker())
    monkeypatch.undo()
    whole = fisher_kl(cal, modules, probe_weight)
    cal.close()
    assert jobs.count(0) == 12 // max(fisher_module.CLUSTER_SHARD_SEQS, chunk)  # whole chunks
    assert sorted(sharded) == sorted(modules)
    assert sharded == whole and all(v > 0 for v in whole.values())


@pytest.mark.parametrize("family", ("llama", "qwen3", "qwen3_moe", "lfm2_moe", "dynquant_hybrid",
                                    "gemma3"))
def test_the_streamed_kl_is_the_whole_models_kl(family, tmp_path):
    """A checkpoint's KL to its source run block by block (one block of each model in memory)
    equals the KL of the two whole float models' forwards (the dequantized checkpoint's), to
    float rounding: untied and tied heads, expert banks, convolution blocks, a scaled embedding
    with sliding attention; zero against itself."""
    from dynquant.checkpoint.reader import open_checkpoint
    from dynquant.cli import main
    from dynquant.pipeline.calibrate.weights import CheckpointWeights
    from dynquant.pipeline.measure.streamed_kl import streamed_kl
    from dynquant.runtime.loader import load_dequantized

    src = save_tiny_model(family, tmp_path / "src")
    out = tmp_path / "q"
    assert main(["quantize", str(src), "-o", str(out), "--uniform", "3", "--group-size", "32",
                 "--quiet"]) == 0
    source = resolve_model(str(src))
    weights = SafetensorsWeights(src, source.conversion_transforms())
    windows = torch.randint(0, 384, (6, 20), generator=torch.Generator().manual_seed(2))
    streamed = streamed_kl(source, weights, out, windows)
    base, quant = load_any(src, dtype="float32"), load_dequantized(out, torch.float32)
    with torch.no_grad():
        whole = sum(float(token_kl(log_probs(base(w[None]).logits[0]),
                                   log_probs(quant(w[None]).logits[0])).double().sum())
                    for w in windows) / windows.numel()
    assert whole > 1e-3
    assert streamed == pytest.approx(whole, rel=1e-4)
    # the checkpoint against itself: the source read as the checkpoint's own weights
    itself = CheckpointWeights(open_checkpoint(out))
    table = next(s for s in source.tensor_specs() if "embed_tokens" in s.name)
    rows = torch.tensor([5, 0, 383, 5])
    assert torch.equal(itself.get_rows(table, rows), itself.get(table, torch.float32)[rows])
    assert streamed_kl(source, itself, out, windows) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tap_multiplies_the_error_as_its_rows_dequantized_would(dtype, monkeypatch):
    """A block Linear's tap: x @ dW^T with dW each chunk of rows dequantized (float32), rounded
    to the pass's dtype: in a bf16 pass from the error rounded to bf16 once (``bf16``, made a
    chunk of rows at a time), the same bits."""
    monkeypatch.setattr(fisher_module, "ROWS_CHUNK", 3 * 40)  # chunks of 3 rows (and a last one)
    monkeypatch.setattr(fisher_module, "TAP_CHUNK", 5 * 40)
    monkeypatch.setattr(fisher_module, "DENSE_ERROR_MAX", 0)
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 23, bias=False)
    weight = linear.weight.detach()
    error = fisher_module.ModuleError(quantize_tensor(weight, 3, 32), weight, "float32")
    assert torch.equal(error.bf16(), error.rows(slice(None)).to(torch.bfloat16))
    tap = fisher_module._LinearTaps(linear.to(dtype))
    linear(torch.randn(2, 7, 40).to(dtype))
    reference = torch.cat([(tap.x @ error.rows(slice(r, min(r + 5, 23))).to(dtype).T).float()
                           for r in range(0, 23, 5)], dim=1)
    assert torch.equal(tap.times_error(error), reference)
    tap.hook.remove()


def test_a_tied_embedding_s_two_uses_are_squared_apart():
    """The lookup use's products are kept apart from the head use's and their KLs added: the
    cross term of the two (small in the KL, noisy in a few sequences' estimate) is left out."""
    from dynquant.pipeline.calibrate.fisher import LOOKUP_USE, _Accumulator

    acc = _Accumulator(2, 2)
    head = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    lookup = torch.tensor([[-1.0, 2.0], [1.5, -3.0]], dtype=torch.float64)
    for s in range(2):
        for d in range(2):
            acc.at = (s, d)
            acc.add("embed", head[s, d])
            acc.add("embed" + LOOKUP_USE, lookup[s, d])
    want = 0.5 * (head.square().mean(1).sum() + lookup.square().mean(1).sum()) / 8
    assert acc.kl("embed", 8) == pytest.approx(float(want), rel=1e-12)
    assert acc.kl("embed", 8) > 0.5 * float((head + lookup).square().mean(1).sum()) / 8
    assert acc.kl("absent", 8) == 0.0
