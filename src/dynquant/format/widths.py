"""One registry row per supported code width and group size (cf. ggml's type_traits)."""

from __future__ import annotations

from dataclasses import dataclass

from dynquant.errors import QuantizationError

SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128
WORD_BITS = 32
# Each group stores one bfloat16 scale and one bfloat16 offset: 2 + 2 bytes.
GROUP_OVERHEAD_BYTES = 4
# The activations each width's one-token products take (numerics/native: packed_matvec.c float32,
# packed_matvec_q8.c int8, packed_matvec_q16.c int16: its exact integer group sums hold codes of
# at most 6 bits); runtime/product_paths.py picks a module's kernels from this.
ACTIVATION_WIDTHS: dict[str, tuple[int, ...]] = {
    "float32": SUPPORTED_BITS,
    "int8": SUPPORTED_BITS,
    "int16": (2, 3, 4, 5, 6),
}


@dataclass(frozen=True)
class Width:
    """How one code width is stored for one group size."""

    bits: int
    group_size: int

    @property
    def words_per_group(self) -> int:
        # bits * group_size is a multiple of 32 for every supported pair: no bit is wasted.
        return self.bits * self.group_size // WORD_BITS

    @property
    def group_nbytes(self) -> int:
        return 4 * self.words_per_group + GROUP_OVERHEAD_BYTES

    @property
    def bits_per_weight(self) -> float:
        return self.bits + 8 * GROUP_OVERHEAD_BYTES / self.group_size

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    @property
    def activations(self) -> tuple[str, ...]:
        """The activations this width's one-token products take."""
        return activation_kinds(self.bits)


def activation_kinds(bits: int) -> tuple[str, ...]:
    """The activations (float32, int8, int16) whose one-token kernels serve ``bits``."""
    return tuple(kind for kind, widths in ACTIVATION_WIDTHS.items() if bits in widths)


def width(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> Width:
    """The registry row for ``bits`` at ``group_size``; unsupported values are an error."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise QuantizationError(
            f"unsupported width {bits!r}; supported: {', '.join(map(str, SUPPORTED_BITS))}",
            field="bits",
        )
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size not in SUPPORTED_GROUP_SIZES
    ):
        raise QuantizationError(
            f"unsupported group size {group_size!r}; supported: "
            f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}",
            field="group_size",
        )
    return Width(bits, group_size)
