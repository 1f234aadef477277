"""A tuned block's output error, each channel weighted by the gain of the norm that reads the
block's output: the gains of every norm form, the norm found for every block, the plain error
where none is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dynquant.errors import DynquantError
from dynquant.models.sources import resolve_model
from dynquant.pipeline.calibrate.block_stream import BlockStream
from dynquant.pipeline.calibrate.weights import weight_source
from dynquant.pipeline.codes import output_error as output_error_module
from dynquant.pipeline.codes.output_error import (
    NormGains,
    block_error,
    output_error,
    reading_norm,
)
from dynquant.pipeline.codes.tuned_scales import ScaleTuning
from model_zoo import family_configs

WIDTH = 64


def _norms() -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(norm with random weights, its gain per channel): Llama's (w), Gemma's (1 + w), and a
    LayerNorm with a bias (w; centring)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for norm in (LlamaRMSNorm(WIDTH, eps=1e-6), Gemma3RMSNorm(WIDTH, eps=1e-6),
                 torch.nn.LayerNorm(WIDTH, eps=1e-6)):
        with torch.no_grad():
            norm.weight.copy_(torch.randn(WIDTH, generator=gen))
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.randn(WIDTH, generator=gen))
        gain = 1 + norm.weight if isinstance(norm, Gemma3RMSNorm) else norm.weight
        out.append((norm, gain.detach().abs()))
    return out


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_norm_s_gains_are_measured_whatever_its_form(which):
    """``NormGains.of`` gives each channel's gain of Llama's RMSNorm (w), Gemma's (1 + w) and a
    LayerNorm with a bias (w), scaled to a mean square of one."""
    norm, gain = _norms()[which]
    got = NormGains.of(norm, WIDTH).gains
    assert torch.allclose(got, gain / gain.pow(2).mean().sqrt(), rtol=1e-5)


def test_the_errors_weigh_each_channel_by_its_gain_squared():
    """``output_error`` weighs channel c of the squared error by its gain squared (None: the
    plain mean), and ``block_error`` over windows is its mean over all their values."""
    norm, _ = _norms()[1]
    gains = NormGains.of(norm, WIDTH)
    gen = torch.Generator().manual_seed(2)
    targets = [torch.randn(1, n, WIDTH, generator=gen) for n in (3, 5)]
    outputs = [t + 0.1 * torch.randn(t.shape, generator=gen) for t in targets]
    o, t = outputs[0], targets[0]
    assert float(output_error(None, o, t)) == pytest.approx(float((o - t).pow(2).mean()))
    assert float(output_error(gains, o, t)) == pytest.approx(
        float(((o - t).pow(2) * gains.gains.pow(2)).mean()), rel=1e-6)
    for g in (None, gains):
        want = sum(float(output_error(g, o, t)) * t.numel()
                   for o, t in zip(outputs, targets, strict=True)) / 8 / WIDTH
        assert block_error(outputs, targets, g) == pytest.approx(want, rel=1e-6)


def _model_with_gains(family: str, out: Path) -> Path:
    """A tiny ``family`` model whose norms have random weights (saved as the zoo saves)."""
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(family_configs()[family]).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 1.0)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize(("family", "reader", "final"), [
    ("llama", "input_layernorm", "model.norm"),
    ("gemma3", "input_layernorm", "model.norm"),
    ("lfm2", "operator_norm", "model.embedding_norm"),
])
def test_each_block_is_weighted_by_the_norm_that_reads_its_output(tmp_path, family, reader,
                                                                   final):
    """Block 0's output error is weighted by block 1's input norm's gains, the last block's by
    the model's final norm's, read from the model's files (Gemma's norms scale by 1 + w) and released
    after; the gains are the ones ``NormGains.of`` takes of that norm."""
    source = resolve_model(str(_model_with_gains(family, tmp_path / family)))
    stream = BlockStream(source, weight_source(source, False), torch.zeros(1, 4, dtype=torch.long))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32)
    last = len(stream.blocks) - 1
    for index, name in ((0, f"model.layers.1.{reader}"), (last, final)):
        gains = reading_norm(stream, index)
        assert gains is not None
        assert torch.equal(gains.gains, NormGains.of(model.get_submodule(name), WIDTH).gains)
        weight = model.get_submodule(name).weight.detach()
        gain = (1 + weight if family == "gemma3" else weight).abs()
        assert torch.allclose(gains.gains, gain / gain.pow(2).mean().sqrt(), rtol=1e-5)
    assert all(p.device.type == "meta" for p in stream.model.parameters())


def test_a_model_with_no_known_norm_is_tuned_on_the_plain_error(tmp_path, monkeypatch):
    """Where no block has a norm of the known names, every block's error but the last's is
    plain (None); the last is weighted by the final norm's gains."""
    source = resolve_model(str(_model_with_gains("llama", tmp_path / "llama")))
    stream = BlockStream(source, weight_source(source, False), torch.zeros(1, 4, dtype=torch.long))
    monkeypatch.setattr(output_error_module, "READER_NORMS", ("no_such_norm",))
    assert reading_norm(stream, 0) is None
    assert reading_norm(stream, len(stream.blocks) - 1) is not None  # the final norm


def test_a_tuning_error_other_than_gains_or_plain_is_a_typed_error():
    with pytest.raises(DynquantError, match="gains, plain"):
        ScaleTuning(error="absolute")
