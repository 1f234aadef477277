"""Which activations a loaded model's decode products use: float32, or int8 / int16 (integer
dot products on the packed codes, ``numerics/packed_matvec.py``, ``packed_matvec_q8`` /
``packed_matvec_q16``).

``activations="auto"`` (the default of ``dynquant.load``, ``from_pretrained``, ``generate`` and
``eval``) reads ``$DYNQUANT_ACTIVATIONS`` (``auto``, ``int8``, ``float``), else picks
:func:`auto_activations`: where the kernels multiply bytes with SIMD integer dot products (VNNI
or AVX2: faster than float32 activations at every width and shape measured), int8 for modules
of at least ``AUTO_INT8_MIN_BITS`` bits and int16 for narrower ones; float32 everywhere on
other CPUs. The width rule is measured: on SmolLM2-135M the int8 products cost a mean KL
against float32 activations of ~0.003 nats a token at 4.25 bits but ~0.009 at 3.25, most of it
in the 2- and 3-bit modules (float32 for those: ~0.004; BENCHMARKS.md, "Against llama.cpp");
int16 activations keep that accuracy at about int8's speed.
An explicit ``int8`` or ``float`` applies to every module. The checkpoint's bytes do not
change: only how a decode step multiplies them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads CHOICES without importing torch
    from torch import nn

CHOICES = ("auto", "int8", "float")
# The int8 kernels' paths where "auto" uses them (numerics/packed_matvec.py, q8_path), and the
# narrowest module width it uses them for.
INT8_PATHS = ("vnni", "avx2")
AUTO_INT8_MIN_BITS = 4


def auto_activations() -> str:
    """``auto`` (int8 for modules of AUTO_INT8_MIN_BITS bits and more) where the int8 kernels run
    on SIMD dot products, else ``float``."""
    from dynquant.numerics.packed_matvec import q8_path

    return "auto" if q8_path() in INT8_PATHS else "float"


def resolve_activations(mode: str | None = None) -> str:
    """``int8``, ``float`` or ``auto`` (int8 by module width, :func:`auto_activations`) for a
    request (``None``/``"auto"``: ``$DYNQUANT_ACTIVATIONS``, else :func:`auto_activations`)."""
    if mode in (None, "auto"):
        mode = os.environ.get("DYNQUANT_ACTIVATIONS", "auto")
        if mode == "auto":
            return auto_activations()
        what = "DYNQUANT_ACTIVATIONS"
    else:
        what = "activations"
    if mode not in CHOICES[1:]:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {mode!r}")
    return mode


def describe_activations(mode: str | None = None) -> str:
    """One line for ``generate``: which activations the decode products use."""
    resolved = resolve_activations(mode)
    if resolved == "auto":
        return (f"int8 activations for modules of {AUTO_INT8_MIN_BITS}+ bits, int16 for "
                "narrower")
    return "int8 activations" if resolved == "int8" else "float32 activations"


def use_activations(model: nn.Module, mode: str | None = None, every_token: bool = False
                    ) -> str:
    """Set every packed module of ``model`` to the resolved activations (``auto``: by module
    width); returns them. Integer activations serve products of a few tokens (decode), and
    prefills keep the float32 GEMM unless
    ``every_token`` (then every product is the one decode computes, token by token: what
    ``dynquant eval --activations int8`` scores)."""
    from dynquant.runtime.packed_modules import PackedWeight
    from dynquant.runtime.product_paths import Activations

    resolved = resolve_activations(mode)
    for module in model.modules():
        if isinstance(module, PackedWeight):
            wide = module.layout.bits >= AUTO_INT8_MIN_BITS
            kind = {"float": "float32", "int8": "int8"}.get(resolved, "int8" if wide else "int16")
            module.activations = Activations(kind, every_token and kind != "float32")
    return resolved


__all__ = ["AUTO_INT8_MIN_BITS", "CHOICES", "auto_activations", "describe_activations",
           "resolve_activations", "use_activations"]
