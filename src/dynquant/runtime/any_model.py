"""One loader for both kinds of model folder a comparison reads: a dynquant checkpoint or a
transformers model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dynquant.errors import ModelError
from dynquant.format.metadata import METADATA_FILE


def load_any(path: str | Path, dtype: str | torch.dtype | None = None,
             activations: str | None = None) -> nn.Module:
    """A dynquant checkpoint (packed) or a transformers model folder (dense), in eval mode, in the
    compute dtype ``dtype`` (None/"auto": the CPU's, ``numerics/compute_dtype.py``). A checkpoint
    with int8 ``activations`` computes every product as decode does, token by token
    (``runtime/activations.py``)."""
    from transformers import AutoModelForCausalLM

    from dynquant.models.registration import register
    from dynquant.numerics.compute_dtype import resolve_dtype
    from dynquant.runtime.loader import load

    dtype = resolve_dtype(dtype)

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError("not a model folder (no config.json)", file=str(path))
    if (path / METADATA_FILE).is_file():
        from dynquant.runtime.activations import use_activations

        model = load(path, dtype=dtype, activations="float")
        use_activations(model, activations, every_token=True)
        return model
    register()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")
    return model.eval()
