"""Registering the reference architecture with transformers' Auto classes (idempotent)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from dynquant.models.hybrid.configuration import DynquantHybridConfig

_done = False


def register() -> None:
    global _done
    if _done:
        return
    from dynquant.models.hybrid.modeling import DynquantHybridForCausalLM

    AutoConfig.register(DynquantHybridConfig.model_type, DynquantHybridConfig, exist_ok=True)
    AutoModelForCausalLM.register(DynquantHybridConfig, DynquantHybridForCausalLM, exist_ok=True)
    _done = True
