"""Which activations a loaded model's one-token products use: float32, or int8 (integer dot
products on the packed codes, ``numerics/packed_matvec.py``, ``packed_matvec_q8``).

``activations="auto"`` (the default of ``dynquant.load``, ``generate`` and ``eval``) reads
``$DYNQUANT_ACTIVATIONS`` (``auto``, ``int8``, ``float``), else :data:`AUTO_ACTIVATIONS`; an
explicit ``int8`` or ``float`` is used as given. The checkpoint's bytes do not change: only how a
decode step multiplies them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads CHOICES without importing torch
    from torch import nn

CHOICES = ("auto", "int8", "float")
# What "auto" picks: float32 until the int8 path is measured faster on the CPUs people own
# (BENCHMARKS.md, "Int8 activations").
AUTO_ACTIVATIONS = "float"


def resolve_activations(mode: str | None = None) -> str:
    """``int8`` or ``float`` for a request (``None``/``"auto"``: ``$DYNQUANT_ACTIVATIONS``, else
    :data:`AUTO_ACTIVATIONS`)."""
    if mode in (None, "auto"):
        mode = os.environ.get("DYNQUANT_ACTIVATIONS", "auto")
        if mode == "auto":
            return AUTO_ACTIVATIONS
        what = "DYNQUANT_ACTIVATIONS"
    else:
        what = "activations"
    if mode not in CHOICES[1:]:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {mode!r}")
    return mode


def use_activations(model: nn.Module, mode: str | None = None, every_token: bool = False
                    ) -> str:
    """Set every packed module of ``model`` to the resolved activations; returns them. With int8,
    products of a few tokens (decode) use them, and prefills keep the float32 GEMM unless
    ``every_token`` (then every product is the one decode computes, token by token: what
    ``dynquant eval --activations int8`` scores)."""
    from dynquant.runtime.packed_modules import PackedWeight

    resolved = resolve_activations(mode)
    for module in model.modules():
        if isinstance(module, PackedWeight):
            module.int8_activations = resolved == "int8"
            module.int8_every_token = every_token and resolved == "int8"
    return resolved


__all__ = ["AUTO_ACTIVATIONS", "CHOICES", "resolve_activations", "use_activations"]
