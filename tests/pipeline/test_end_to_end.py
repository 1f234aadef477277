"""End-to-end tuned scales (``quantize --e2e-steps``): every scale and offset moved against the
float model's next-token distributions, codes frozen; the same format, a lower KL on the windows
it was fitted to, the same bytes on a rerun and after a kill at any point."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from test_sequential_gptq import _calibration, _uniform
from test_tuned_scales import _headers

from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes import end_to_end as e2e
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.evaluate import evaluate
from shipped_models import LLAMA_REF, checkpoint_bytes


def test_binned_kl_is_the_full_kl_with_every_token_and_a_lower_bound_with_fewer():
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(6, 50, generator=gen) * 2
    q_logits = p_logits + torch.randn(6, 50, generator=gen)
    log_p, log_q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    full = (log_p.exp() * (log_p - log_q)).sum(-1).mean()

    def teacher(k: int) -> e2e.Teacher:
        top, tokens = log_p.topk(k, -1)
        return e2e.Teacher(top, tokens, e2e.log_rest(top))

    assert float(e2e.binned_kl(teacher(50), q_logits)) == pytest.approx(float(full), rel=1e-4)
    for k in (1, 5, 20):  # merging tokens into one bin never raises a KL (log-sum inequality)
        assert 0 < float(e2e.binned_kl(teacher(k), q_logits)) <= float(full) + 1e-6


def _e2e(cal, steps: int) -> CodeChooser:
    # (a step that moves bf16 scales within a few steps on the tiny model)
    tuning = e2e.EndToEndTuning(steps, lr=1e-3)
    return CodeChooser("gptq", sequential=replace(cal, end_to_end=tuning))


def test_end_to_end_scales_lower_the_fitted_kl_in_gptq_s_format(tmp_path):
    """2 bits on the trained reference model (tied embedding): KL to the float model on the
    fitted windows below GPTQ's; same tensors, dtypes, shapes and offsets; every qweight GPTQ's,
    the tied embedding's scales (its lookup and head uses both fitted) moved."""
    source = resolve_model(str(LLAMA_REF))
    cal = _calibration(LLAMA_REF, 8, 64)  # 7 fitted, 1 checking the fit
    widths = _uniform(source, 2)
    quantize_model(source, widths, tmp_path / "gptq", progress=False,
                   chooser=CodeChooser("gptq", sequential=cal))
    quantize_model(source, widths, tmp_path / "e2e", progress=False, chooser=_e2e(cal, 24))
    assert _headers(tmp_path / "e2e") == _headers(tmp_path / "gptq")
    with (safe_open(str(tmp_path / "e2e" / "model.safetensors"), "pt") as tuned,
          safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as gptq):
        for name in gptq.keys():  # noqa: SIM118
            same = torch.equal(tuned.get_tensor(name), gptq.get_tensor(name))
            assert same == (not name.endswith((".scales", ".offsets"))), name
    text = tmp_path / "fitted.txt"  # the windows' own text: what the tuning minimised
    text.write_text(_calibration_text(cal))
    kl = {run: evaluate(tmp_path / run, LLAMA_REF, text, 64, progress=False).kl_mean
          for run in ("gptq", "e2e")}
    assert kl["e2e"] < 0.9 * kl["gptq"], kl


def _calibration_text(cal) -> str:
    from dynquant.models.tokenizer import load_tokenizer

    tok = load_tokenizer(LLAMA_REF)
    return "".join(tok.decode(row) for row in cal.ids)


def test_end_to_end_reruns_and_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """Blocks checkpointed (large models) or not, the same bytes; a run killed while tuning
    tunes again from the same codes, to the bytes of a run never killed; one killed once its
    tuned scales are saved only puts them in place."""
    source = resolve_model(str(LLAMA_REF))
    widths = _uniform(source, 3)
    cal = _calibration(LLAMA_REF, 2, 64)
    # every window tuned, the tuned scales always kept: the bytes below are the tuning's
    monkeypatch.setattr(e2e, "validation_windows", lambda _count: 0)
    with monkeypatch.context() as m:  # "a" checkpointed, every later run not
        m.setattr(e2e, "HELD_WEIGHTS_BYTES", 0)
        quantize_model(source, widths, tmp_path / "a", progress=False, chooser=_e2e(cal, 6))
    quantize_model(source, widths, tmp_path / "gptq", progress=False,
                   chooser=CodeChooser("gptq", sequential=cal))
    assert checkpoint_bytes(tmp_path / "a") != checkpoint_bytes(tmp_path / "gptq")

    real_tune, real_write = e2e.tune_end_to_end, e2e.ResumeStore.write_tensors
    tuned: list[int] = []

    def dies_while_tuning(*args, **kwargs):
        tuned.append(1)
        if len(tuned) == 1:
            raise KeyboardInterrupt
        return real_tune(*args, **kwargs)

    monkeypatch.setattr(e2e, "tune_end_to_end", dies_while_tuning)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(source, widths, tmp_path / "c", progress=False, chooser=_e2e(cal, 6))
    quantize_model(source, widths, tmp_path / "c", progress=False, chooser=_e2e(cal, 6))
    assert len(tuned) == 2
    assert checkpoint_bytes(tmp_path / "c") == checkpoint_bytes(tmp_path / "a")

    def dies_after_saving(self, name, tensors):
        real_write(self, name, tensors)
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e.ResumeStore, "write_tensors", dies_after_saving)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(source, widths, tmp_path / "d", progress=False, chooser=_e2e(cal, 6))
    monkeypatch.setattr(e2e.ResumeStore, "write_tensors", real_write)
    quantize_model(source, widths, tmp_path / "d", progress=False, chooser=_e2e(cal, 6))
    assert len(tuned) == 3  # the second run of "d" tuned nothing
    assert checkpoint_bytes(tmp_path / "d") == checkpoint_bytes(tmp_path / "a")


@pytest.mark.parametrize("over", [False, True])
def test_blocks_are_checkpointed_past_the_bound_on_their_own_weights(tmp_path, monkeypatch, over):
    """``HELD_WEIGHTS_BYTES`` bounds the blocks' dequantized float32 weights alone: the tied
    embedding's (held for its head use either way) do not make a model's blocks checkpointed."""
    source = resolve_model(str(LLAMA_REF))
    specs = [s for s in source.tensor_specs() if s.quantizable]
    in_blocks = sum(math.prod(s.shape) for s in specs if ".layers." in s.module) * 4
    assert sum(math.prod(s.shape) for s in specs) * 4 > in_blocks  # the embedding's too
    monkeypatch.setattr(e2e, "HELD_WEIGHTS_BYTES", in_blocks - 1 if over else in_blocks)
    monkeypatch.setattr(e2e, "validation_windows", lambda _count: 0)
    calls: list[int] = []
    real = e2e.checkpoint
    monkeypatch.setattr(e2e, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    cal = _calibration(LLAMA_REF, 2, 64)
    quantize_model(source, _uniform(source, 3), tmp_path / "q", progress=False,
                   chooser=_e2e(cal, 1))
    assert bool(calls) == over


def test_the_default_tunes_tuned_codes_end_to_end_up_to_its_bound():
    """Unless steps are given: ``AUTO_STEPS`` for tuned codes of at most ``AUTO_MAX_WEIGHTS``
    quantized weights, none past it or for gptq's codes; steps given are kept as given, and
    a pass is never handed settings whose steps are undecided."""
    auto = e2e.EndToEndTuning()
    assert auto.resolved("tuned", e2e.AUTO_MAX_WEIGHTS) == e2e.EndToEndTuning(e2e.AUTO_STEPS)
    assert auto.resolved("tuned", e2e.AUTO_MAX_WEIGHTS + 1).steps == 0
    assert auto.resolved("gptq", 1).steps == 0
    assert e2e.EndToEndTuning(steps=7).resolved("gptq", 10**12).steps == 7
    assert e2e.EndToEndTuning(steps=0).resolved("tuned", 1).steps == 0
    with pytest.raises(ValueError, match="resolved"):
        replace(_calibration(LLAMA_REF, 1, 16), end_to_end=auto)


@pytest.mark.parametrize("fits", [True, False])
def test_a_default_quantize_tunes_end_to_end_by_the_model_s_quantized_weights(
        tmp_path, monkeypatch, capsys, fits):
    """``api.quantize`` with its defaults (tuned codes on text) decides the end-to-end steps
    from the count of weights it quantizes (every quantizable tensor's here): within the bound
    it runs the pass with ``AUTO_STEPS``; past it, none, and it says so in one line."""
    from dynquant import api
    from dynquant.pipeline import workflow
    from dynquant.pipeline.codes import write

    source = resolve_model(str(LLAMA_REF))
    weights = workflow.quantized_weights(source, _uniform(source, 4))
    assert weights == sum(math.prod(s.shape) for s in source.tensor_specs() if s.quantizable)
    monkeypatch.setattr(e2e, "AUTO_MAX_WEIGHTS", weights if fits else weights - 1)
    decided: list[tuple[str, int]] = []
    real = e2e.EndToEndTuning.resolved

    def resolved(self, quantizer, count):
        decided.append((quantizer, count))
        return real(self, quantizer, count)

    monkeypatch.setattr(e2e.EndToEndTuning, "resolved", resolved)
    ran: list[e2e.EndToEndTuning] = []
    monkeypatch.setattr(write, "end_to_end_codes", lambda *a, **_: ran.append(a[4]))
    api.quantize(LLAMA_REF, tmp_path / "q", uniform=4, calib_seqs=2, gptq_seqs=2, calib_len=32,
                 tuning=api.ScaleTuning(steps=2), progress=not fits)
    assert decided == [("tuned", weights)]
    assert ran == ([e2e.EndToEndTuning(e2e.AUTO_STEPS)] if fits else [])
    said = [line for line in capsys.readouterr().err.splitlines() if "end-to-end" in line]
    assert said == ([] if fits else [
        f"dynquant: no end-to-end scales: {weights / 1e9:.1f} G quantized weights, past "
        f"{(weights - 1) / 1e9:.1f} G (--e2e-steps N runs them)"])


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_the_pass_reads_codes_where_used_and_never_makes_the_head_or_embedding_whole(
        tmp_path, monkeypatch, family):
    """An untied head and quantized input embedding (llama), a scaled tied embedding (gemma3),
    expert banks (qwen3_moe): every tunable's codes are read from the resume folder (none held),
    the head and the embedding are used a chunk or a window's rows at a time (never
    dequantized whole), and every kind of tensor gets its tuned scales, in a checkpoint the
    validator accepts."""
    from dynquant.format.validate import validate_checkpoint
    from dynquant.numerics.tuned_scales import TunableScales
    from model_zoo import save_tiny_model, save_tiny_tokenizer

    src = save_tiny_model(family, tmp_path / "src")
    save_tiny_tokenizer(src)
    source = resolve_model(str(src))
    widths = _uniform(source, 3)
    cal = _calibration(src, 2, 32)
    monkeypatch.setattr(e2e, "validation_windows", lambda _count: 0)
    seen: dict[str, TunableScales] = {}
    whole: list[tuple[int, ...]] = []
    real_tune, real_forward = e2e.tune_end_to_end, TunableScales.forward

    def tune(stream, tunables, *args):
        seen.update(tunables)
        return real_tune(stream, tunables, *args)

    def forward(self, *args):
        whole.append(tuple(self.start.logical_shape))
        return real_forward(self, *args)

    monkeypatch.setattr(e2e, "tune_end_to_end", tune)
    monkeypatch.setattr(TunableScales, "forward", forward)
    steps = e2e.EndToEndTuning(steps=3, lr=1e-2)  # (steps large enough to move bf16 scales)
    quantize_model(source, widths, tmp_path / "e2e", progress=False, chooser=CodeChooser(
        "gptq", sequential=replace(cal, end_to_end=steps)))
    quantize_model(source, widths, tmp_path / "gptq", progress=False,
                   chooser=CodeChooser("gptq", sequential=cal))
    assert seen and all(t.start.qweight.is_meta for t in seen.values())
    vocab = source.config.vocab_size
    assert whole and not any(shape[0] == vocab for shape in whole)  # no head, no embedding
    assert validate_checkpoint(str(tmp_path / "e2e")) == []
    with (safe_open(str(tmp_path / "e2e" / "model.safetensors"), "pt") as tuned,
          safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as gptq):
        kinds = {"embed_tokens", "lm_head", "experts", "q_proj"} & {
            part for name in gptq.keys() for part in name.split(".")}  # noqa: SIM118
        for kind in kinds:
            name = next(n for n in gptq.keys() if f".{kind}." in f".{n}"  # noqa: SIM118
                        and n.endswith(".scales"))
            assert not torch.equal(tuned.get_tensor(name), gptq.get_tensor(name)), name
    assert {"embed_tokens", "q_proj"} <= kinds and (family != "qwen3_moe" or "experts" in kinds)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_teacher_from_the_sequential_pass_s_float_outputs_is_the_same_bits(
        tmp_path, monkeypatch, family):
    """With tuned codes the sequential pass runs the float model block by block (the tuning's
    targets); the end-to-end pass's teacher starts from its last block's outputs instead of
    running every block again: the same checkpoint, bit for bit, as a teacher of its own."""
    from dynquant.pipeline.codes import write
    from dynquant.pipeline.codes.tuned_scales import ScaleTuning
    from model_zoo import save_tiny_model, save_tiny_tokenizer

    src = save_tiny_model(family, tmp_path / "src")
    save_tiny_tokenizer(src)
    source = resolve_model(str(src))
    widths = _uniform(source, 3)
    cal = replace(_calibration(src, 3, 32), tuning=ScaleTuning(steps=2),
                  end_to_end=e2e.EndToEndTuning(steps=2, lr=1e-2))
    monkeypatch.setattr(e2e, "validation_windows", lambda _count: 0)  # tuned scales kept
    given: list[bool] = []
    real_teacher = e2e.teacher_of

    def teacher_of(stream, first, top_k, say, finals=None):
        given.append(finals is not None)
        return real_teacher(stream, first, top_k, say, finals)

    monkeypatch.setattr(e2e, "teacher_of", teacher_of)
    quantize_model(source, widths, tmp_path / "given", progress=False,
                   chooser=CodeChooser("tuned", sequential=cal))
    real_sequential = write._sequential
    monkeypatch.setattr(write, "_sequential", lambda *a: real_sequential(*a) and None)
    quantize_model(source, widths, tmp_path / "own", progress=False,
                   chooser=CodeChooser("tuned", sequential=cal))
    assert given == [True, False]
    assert checkpoint_bytes(tmp_path / "given") == checkpoint_bytes(tmp_path / "own")
