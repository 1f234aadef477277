"""The constant factor some families multiply their input embedding's rows by (Gemma's
``sqrt(hidden_size)``): a packed embedding applies it as the module it replaces did, and the
Fisher pass scales the lookup's gradient by it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class EmbeddingScale:
    value: float
    # the factor rounded to the rows' dtype before the multiply (Gemma 3's
    # ``* self.embed_scale.to(self.weight.dtype)``), not applied in float32
    in_row_dtype: bool


def embedding_scale(module: nn.Module) -> EmbeddingScale | None:
    """The scale of transformers' ``*ScaledWordEmbedding`` modules (``scalar_embed_scale``, a
    plain float even on a model built on the meta device), None for a plain lookup."""
    value = getattr(module, "scalar_embed_scale", None)
    if value is None or not isinstance(module, nn.Embedding):
        return None
    source = inspect.getsource(type(module).forward)
    return EmbeddingScale(float(value), ".to(self.weight.dtype)" in source)
