"""Exact size before any work: the `layers` table and `accounting` a quantization will produce.

From an architecture (the names, shapes and dtypes of its tensors) and a widths map, compute the
dynquant.json document a quantization would write, touching no weight. Clip statistics are unknown
before quantizing and are left null. This is where ``predicted_nbytes`` comes from.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynquant.errors import ModelError
from dynquant.format import metadata as md
from dynquant.format.layout import LayerLayout

# Bytes per element as stored: floats wider than 16 bits are stored as bf16 (see the writer).
_STORED_ITEMSIZE = {
    "float64": 2, "float32": 2, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an architecture: its name, shape, source dtype, and whether it is quantizable.

    ``module`` is the quantization unit's name: the tensor name without a trailing ``.weight``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    quantizable: bool = False

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def stored_nbytes(self) -> int:
        if self.dtype not in _STORED_ITEMSIZE:
            raise ModelError(f"unsupported dtype {self.dtype}", module=self.name, field="dtype")
        return math.prod(self.shape) * _STORED_ITEMSIZE[self.dtype]


# A widths map gives each module a width, or a (width, group size) pair.
WidthChoice = int | tuple[int, int]


def split_choice(choice: WidthChoice, default_group_size: int) -> tuple[int, int]:
    if isinstance(choice, tuple):
        return choice
    return choice, default_group_size


def excluded_modules(specs: Sequence[TensorSpec], patterns: Sequence[str]) -> list[str]:
    """The quantizable modules that ``patterns`` (names or globs) keep dense."""
    return sorted(s.module for s in specs if s.quantizable
                  and any(fnmatch.fnmatchcase(s.module, p) for p in patterns))


def plan_layers(specs: Sequence[TensorSpec], widths: Mapping[str, WidthChoice],
                group_size: int, not_convert: Sequence[str] = ()) -> tuple[dict, int]:
    """The `layers` entries of the quantized modules and the bytes of all dense tensors."""
    dense_modules = set(excluded_modules(specs, not_convert))
    quantizable = {s.module: s for s in specs if s.quantizable and s.module not in dense_modules}
    widths = {m: w for m, w in widths.items() if m not in dense_modules}
    unknown = sorted(set(widths) - set(quantizable))
    if unknown:
        raise ModelError(f"widths name modules the model does not quantize: {unknown[:5]}",
                         field="widths")
    missing = sorted(set(quantizable) - set(widths))
    if missing:
        raise ModelError(f"no width for {len(missing)} modules, e.g. {missing[:5]}",
                         field="widths")
    layers = {}
    dense = 0
    for spec in specs:
        if spec.module in quantizable:
            bits, gs = split_choice(widths[spec.module], group_size)
            layers[spec.module] = LayerLayout.create(spec.shape, bits, gs,
                                                     module=spec.module).entry()
        else:
            dense += spec.stored_nbytes
    return layers, dense


def plan_document(specs: Sequence[TensorSpec], widths: Mapping[str, WidthChoice], *,
                  model: str, group_size: int = 128, tied: Mapping[str, str] | None = None,
                  modules_to_not_convert: Sequence[str] = (),
                  allocator: str = "manual", widths_from: str | None = None) -> dict:
    """The dynquant.json document a quantization with these widths will write (no clip stats).
    ``lm_head_quantized`` says whether an untied ``lm_head`` is among the packed layers (a tied
    one is the embedding's and is not stored)."""
    layers, dense = plan_layers(specs, widths, group_size, modules_to_not_convert)
    excluded = excluded_modules(specs, modules_to_not_convert)
    options = md.QuantizationOptions(group_size, "lm_head" in layers, excluded)
    doc = md.build_document(layers, dense_nbytes=dense, options=options, tied=tied,
                            provenance=md.Provenance(model=model, allocator=allocator,
                                                     widths_from=widths_from))
    doc["provenance"]["predicted_nbytes"] = doc["accounting"]["total_nbytes"]
    return doc
