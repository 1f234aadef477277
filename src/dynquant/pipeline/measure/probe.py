"""The exact probe: a module's KL measured by running the dense model with it replaced (the
reference the Fisher estimate is checked against)."""

from __future__ import annotations

import torch
from torch import nn

from dynquant.errors import DynquantError
from dynquant.models.sources import ModelSource
from dynquant.numerics.divergence import log_probs, token_kl
from dynquant.runtime.any_model import load_any


class KLProbe:
    """Mean KL(base || model with one module replaced) on calibration tokens."""

    def __init__(self, model: nn.Module, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        with torch.no_grad():
            self.base = [log_probs(model(row[None]).logits[0]) for row in ids]

    def kl_with(self, name: str, weight: torch.Tensor) -> float:
        param = _parameter(self.model, name)
        saved = param.data
        param.data = weight.to(saved.dtype).reshape(saved.shape)
        try:
            with torch.no_grad():
                kls = [token_kl(b, log_probs(self.model(row[None]).logits[0])).mean()
                       for row, b in zip(self.ids, self.base, strict=True)]
        finally:
            param.data = saved
        return float(torch.stack(kls).mean())


def _parameter(model: nn.Module, module: str) -> nn.Parameter:
    try:
        return model.get_parameter(module)
    except AttributeError:
        return model.get_parameter(f"{module}.weight")


def dense_model(source: ModelSource, dtype: str) -> nn.Module:
    if source.directory is None:
        raise DynquantError("the kl method needs model weights (a model directory)",
                            file=source.name)
    return load_any(source.directory, dtype=dtype)
