"""KL(base || model) of next-token distributions: the one measure of damage that the
evaluation, the measure's probes and its forecast check share."""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in float32 (bf16 logits lose the small ones' differences)."""
    return torch.log_softmax(logits.float(), -1)


def token_kl(base: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """KL(base || model) per position from ``log_probs`` of each, in nats."""
    return (base.exp() * (base - model)).sum(-1)
