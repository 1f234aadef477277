"""Which kernels multiply a packed module: the one place that reads the widths registry's
activation kernels (``format/widths.py``) against what a model was asked to use
(``runtime/activations.py``).

A module asks for float32, int8 or int16 activations; a width whose kernels do not take the
asked kind (int16 past 6 bits) multiplies float32 ones. A few tokens (decode) take the asked
kind's product; many (prefill) take the float32 packed GEMM unless every token is asked to go
through the few-token product (``dynquant eval --activations int8`` scoring what decode
computes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from dynquant.format.widths import activation_kinds
from dynquant.numerics.packed_matvec import (
    packed_gemm,
    packed_matvec,
    packed_matvec_q8,
    packed_matvec_q16,
)

FEW_TOKEN_PRODUCTS: dict[str, Callable] = {"float32": packed_matvec, "int8": packed_matvec_q8,
                                           "int16": packed_matvec_q16}


@dataclass(frozen=True)
class Activations:
    """What a packed module's products are asked to take: ``kind`` float32, int8 or int16;
    ``every_token``: prefills too, token by token."""

    kind: str = "float32"
    every_token: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FEW_TOKEN_PRODUCTS:
            raise ValueError(f"activations must be one of {sorted(FEW_TOKEN_PRODUCTS)}, got "
                             f"{self.kind!r}")


@dataclass(frozen=True)
class ProductPath:
    """The kernels a module runs: the activations they take, the product of a few tokens and
    the product of many."""

    activations: str
    few_tokens: Callable
    many_tokens: Callable


@cache
def product_path(bits: int, asked: Activations) -> ProductPath:
    """The product path of a ``bits``-wide module asked for ``asked`` (kept: every product a
    module makes asks, on decode's per-token path)."""
    kind = asked.kind if asked.kind in activation_kinds(bits) else "float32"
    few = FEW_TOKEN_PRODUCTS[kind]
    many = few if asked.every_token and kind != "float32" else packed_gemm
    return ProductPath(kind, few, many)


__all__ = ["Activations", "ProductPath", "product_path"]
