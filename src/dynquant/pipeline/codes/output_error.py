"""A tuned block's output error, each channel weighted by the gain of the norm that reads it.

A decoder block's output is the residual stream, and what reads it first is a normalisation:
the next block's input norm, or after the last block the model's final norm, ``y = g * x /
r(x)``. The plain squared error weighs a channel by its magnitude: in Gemma-3-270M's residual
stream one channel holds 55-96% of the squared values of every block's output, and the norms
that read it give that channel a gain far below the others' (the sixth block's input norm: 0.31
against ~14), so fitting the plain error spends the tuning on a channel the model hardly reads.
``output_error`` weighs channel ``c`` of the error by ``g_c^2`` (the gains scaled to a mean
square of one): Gemma-3-270M's tuned codes then measure less KL, SmolLM2's (whose norms give
its largest channel about the others' gain) about the same (BENCHMARKS.md "Tuned scales").

Tokens are not normalised, although the norm divides each by its RMS: a sequence's first token
is the attention sink (in SmolLM2's later blocks its RMS is 40-140x the median token's), and
every later position reads it. The norm's whole first-order change (each token relative to its
size, less its component along itself) gave both models far more KL than the plain error.

``NormGains.of`` measures a norm's gains on a probe (any RMSNorm or LayerNorm form: Llama's
``w``, Gemma's ``1 + w``); ``reading_norm`` finds the norm by the usual names in transformers'
models, and a block where none is found is tuned on the plain error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynquant.pipeline.calibrate.block_stream import BlockStream

# attribute names of a decoder block's first norm (the one that reads the residual stream):
# Llama, Qwen, Mistral, Gemma, Phi-3, their MoE variants (input_layernorm); LFM2 and dynquant's
# hybrid (operator_norm); GPT-2 style (ln_1)
READER_NORMS = ("input_layernorm", "operator_norm", "ln_1")


@dataclass(frozen=True)
class NormGains:
    """A norm's gain per channel, scaled to a mean square of one (so that the error's size
    does not depend on the model's gains)."""

    gains: torch.Tensor  # [width] float32

    @staticmethod
    def of(norm: nn.Module, width: int) -> NormGains:
        """The gains of ``norm`` (a module mapping [..., width] to [..., width], its weights in
        place), measured on a probe: a vector of +-1 (mean 0, RMS 1) and its negative, whose
        outputs differ by twice the gains times the probe (a bias, if any, cancels)."""
        probe = torch.ones(1, width)
        probe[:, 1::2] = -1.0
        first = next(norm.parameters(), None)
        dtype = torch.float32 if first is None else first.dtype
        with torch.no_grad():
            moved = norm(probe.to(dtype)).float() - norm(-probe.to(dtype)).float()
        gains = (moved / (2 * probe))[0].abs()
        mean_square = gains.pow(2).mean()
        if not torch.isfinite(mean_square) or mean_square <= 0:
            return NormGains(torch.ones(width))
        return NormGains((gains / mean_square.sqrt()).contiguous())


def reading_norm(stream: BlockStream, index: int) -> NormGains | None:
    """The gains of the norm that reads block ``index``'s output (its weights read from the
    model's files where not held), or None where no such norm is found."""
    found = _reader(stream, index)
    if found is None:
        return None
    name, norm = found
    held = all(p.device.type != "meta" for p in norm.parameters())
    if not held:
        stream.materialize(norm, name)
    try:
        return NormGains.of(norm, stream.model.config.hidden_size)
    finally:
        if not held:
            stream.release(norm)


def _reader(stream: BlockStream, index: int) -> tuple[str, nn.Module] | None:
    """(full name, module) of the norm that reads block ``index``'s output: the next block's
    input norm, or the final norm (the first norm among the modules after the blocks)."""
    width = stream.model.config.hidden_size
    if index + 1 < len(stream.blocks):
        block = stream.blocks[index + 1]
        for attr in READER_NORMS:
            norm = getattr(block, attr, None)
            if isinstance(norm, nn.Module):
                return f"{stream.block_prefix(index + 1)}.{attr}", norm
        return None
    for name, module in stream.head_modules():
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and weight is not None and \
                tuple(weight.shape) == (width,):
            return name, module
    return None


def _weighted_error(gains: NormGains | None, outputs: torch.Tensor, targets: torch.Tensor
                    ) -> torch.Tensor:
    """``outputs - targets`` [..., width], each channel times its gain (None: as it is)."""
    error = outputs - targets
    return error if gains is None else error * gains.gains


def output_error(gains: NormGains | None, outputs: torch.Tensor, targets: torch.Tensor
                 ) -> torch.Tensor:
    """The mean squared error of ``outputs`` against ``targets`` [..., width], each channel
    times its gain (None: plainly), differentiable in ``outputs``."""
    return _weighted_error(gains, outputs, targets).pow(2).mean()


def block_error(outputs: list[torch.Tensor], targets: list[torch.Tensor],
                gains: NormGains | None = None) -> float:
    """``output_error`` over every window (a float64 sum: any order, same value)."""
    total = sum(float(_weighted_error(gains, o, t).double().pow(2).sum())
                for o, t in zip(outputs, targets, strict=True))
    return total / sum(t.numel() for t in targets)
