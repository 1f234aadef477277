"""Decode steps of a packed model run torch's own ops on one thread.

In a decode step of a packed model the products run in dynquant's kernel pool
(``numerics/native/pool.c``); what is left to torch is small: norms, rotary, attention over the
cache, routing, and ``generate``'s own per-step work. Each parallel torch op wakes torch's OpenMP
workers, asleep after the short spin dynquant sets for machines under load (``openmp.py``), and
the wake-up costs more than the op (tens of µs: an attention call in a decode step takes ~10x its
time back to back). So, while a model loaded by dynquant generates, its
decode steps (one new token per sequence, a short cache) lower torch's thread count to one
until the next prefill or the end of ``generate``; the kernel pool keeps its threads
(``native.pool_threads``). Outside ``generate`` a one-token forward restores the count when it
returns. Caches past ``MAX_CACHE_BYTES`` keep torch's threads: attention over them is real work
that one thread does more slowly.

``DYNQUANT_DECODE_THREADS=0`` switches this off (torch's thread count is then never touched).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dynquant.numerics import native

MAX_CACHE_BYTES = 64 << 20


def _tokens(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """Query tokens of a causal LM forward: ``input_ids`` [B, T] or ``inputs_embeds`` [B, T, H]."""
    ids = kwargs.get("input_ids", next(iter(args), None))
    if isinstance(ids, torch.Tensor):
        return ids.shape[-1]
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[-2] if isinstance(embeds, torch.Tensor) else None


def _cached_tokens(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 0


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one cached token holds across the attention layers (keys and values)."""
    heads = getattr(config, "num_key_value_heads", None) or getattr(
        config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // max(getattr(config, "num_attention_heads", 1), 1))
    types = getattr(config, "layer_types", None)
    layers = (sum("attention" in str(t) for t in types) if types
              else getattr(config, "num_hidden_layers", 1))
    return 2 * layers * heads * head_dim * dtype.itemsize


class DecodeThreads:
    """The hooks and the ``generate`` wrapper of one model (see the module's docstring)."""

    def __init__(self, max_cached_tokens: int) -> None:
        self.max_cached_tokens = max_cached_tokens
        self.base: int | None = None  # torch's thread count while lowered, else None
        self.generating = 0

    def lower(self) -> None:
        if self.base is None and torch.get_num_threads() > 1:
            self.base = torch.get_num_threads()
            native.pool_threads = self.base
            torch.set_num_threads(1)

    def restore(self) -> None:
        if self.base is not None:
            torch.set_num_threads(self.base)
            native.pool_threads = None
            self.base = None

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if _tokens(args, kwargs) == 1 and _cached_tokens(kwargs) <= self.max_cached_tokens:
            self.lower()
        else:
            self.restore()

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                      output: Any) -> None:
        if not self.generating:  # inside generate the count stays low for its own ops
            self.restore()


class _Generate:
    """``model.generate`` that gives torch its threads back when it ends. An object holding the
    model, not a closure: a deep copy of the model gets its own (functions are not copied)."""

    def __init__(self, model: nn.Module, hooks: DecodeThreads) -> None:
        self.model, self.hooks = model, hooks
        self.__doc__ = type(model).generate.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.hooks
        hooks.generating += 1
        try:
            return type(self.model).generate(self.model, *args, **kwargs)
        finally:
            hooks.generating -= 1
            if not hooks.generating:
                hooks.restore()


def one_thread_decode(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Install :class:`DecodeThreads` on a packed causal LM (unless ``DYNQUANT_DECODE_THREADS=0``
    or it has no ``generate``); returns the model."""
    if os.environ.get("DYNQUANT_DECODE_THREADS", "1") == "0" or not hasattr(model, "generate"):
        return model
    per_token = kv_bytes_per_token(model.config, dtype)
    hooks = DecodeThreads(MAX_CACHE_BYTES // max(per_token, 1))
    model.register_forward_pre_hook(hooks.before_forward, with_kwargs=True)
    model.register_forward_hook(hooks.after_forward, with_kwargs=True, always_call=True)
    model.generate = _Generate(model, hooks)
    return model
