"""The storage layout of one quantized module: the `layers` entry of dynquant.json.

A weight of logical shape ``[..., in_features]`` is ``num_rows = prod(shape[:-1])`` rows of
``in_features`` values; each row is cut into ``num_groups = ceil(in_features / group_size)``
groups of ``group_size`` consecutive values (a short last group is padded with code 0).
Per group: ``words_per_group`` uint32 words of codes + one bf16 scale + one bf16 offset, so
``nbytes = num_rows * num_groups * (4 * words_per_group + 2 + 2)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dynquant.errors import CheckpointError
from dynquant.format.widths import width

# Anything larger than this many weights in one module is not a real model (and would make us
# allocate absurd buffers before failing): 2^40 ~ 1.1e12 weights.
MAX_MODULE_ELEMENTS = 1 << 40
COMPUTE_DTYPE = "bfloat16"
LAYOUT = "linear"


@dataclass(frozen=True)
class LayerLayout:
    """Everything about one quantized module that follows from its shape, width and group size."""

    logical_shape: tuple[int, ...]
    bits: int
    group_size: int

    @classmethod
    def create(
        cls, logical_shape: Sequence[int], bits: int, group_size: int, *, module: str | None = None
    ) -> LayerLayout:
        shape = tuple(logical_shape)
        if len(shape) < 2 or any(
            isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape
        ):
            raise CheckpointError(
                f"logical_shape must be 2 or more positive integers, got {list(shape)}",
                module=module,
                field="logical_shape",
            )
        if math.prod(shape) > MAX_MODULE_ELEMENTS:
            raise CheckpointError(
                f"logical_shape {list(shape)} holds more than 2^40 weights",
                module=module,
                field="logical_shape",
            )
        width(bits, group_size)  # raises on an unsupported pair
        return cls(shape, bits, group_size)

    @property
    def in_features(self) -> int:
        return self.logical_shape[-1]

    @property
    def num_rows(self) -> int:
        return math.prod(self.logical_shape[:-1])

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    @property
    def words_per_group(self) -> int:
        return width(self.bits, self.group_size).words_per_group

    @property
    def padded_in_features(self) -> int:
        return self.num_groups * self.group_size

    @property
    def elements(self) -> int:
        return math.prod(self.logical_shape)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.num_groups * width(self.bits, self.group_size).group_nbytes

    @property
    def bits_per_weight(self) -> float:
        return width(self.bits, self.group_size).bits_per_weight

    @property
    def qweight_shape(self) -> tuple[int, int]:
        return (self.num_rows, self.num_groups * self.words_per_group)

    @property
    def scales_shape(self) -> tuple[int, int]:
        return (self.num_rows, self.num_groups)

    @property
    def is_expert_bank(self) -> bool:
        return len(self.logical_shape) == 3

    def entry(
        self, clipped_fraction: float | None = None, clip_improvement: float | None = None
    ) -> dict:
        """The `layers` entry, in the seed's field order."""
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "in_features": self.in_features,
            "logical_shape": list(self.logical_shape),
            "num_rows": self.num_rows,
            "num_groups": self.num_groups,
            "words_per_group": self.words_per_group,
            "row_offset": 0,
            "layout": LAYOUT,
            "symmetric": False,
            "has_offsets": True,
            "compute_dtype": COMPUTE_DTYPE,
            "nbytes": self.nbytes,
            "bits_per_weight": self.bits_per_weight,
            "clipped_fraction": clipped_fraction,
            "clip_improvement": clip_improvement,
        }


def tensor_names(module: str) -> tuple[str, str, str]:
    """The three stored tensors of a quantized module."""
    return (f"{module}.qweight", f"{module}.scales", f"{module}.offsets")
