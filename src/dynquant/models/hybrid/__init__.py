"""The reference hybrid short-conv / attention MoE architecture (model_type ``dynquant_hybrid``)."""

from dynquant.models.hybrid.configuration import DynquantHybridConfig

__all__ = ["DynquantHybridConfig"]
