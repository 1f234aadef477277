"""Registering the reference architecture with transformers' Auto classes (idempotent)."""

from __future__ import annotations

from transformers import AutoConfig

from dynquant.models.hybrid.configuration import DynquantHybridConfig

_done = False


def register() -> None:
    global _done
    if _done:
        return
    AutoConfig.register(DynquantHybridConfig.model_type, DynquantHybridConfig, exist_ok=True)
    _done = True
