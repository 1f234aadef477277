"""Second moments X^T X as symmetric rank-k updates: half the products of a plain X^T X.

GPTQ and its ratios need X^T X of every Linear's input over many calibration tokens; at a 7B
model's MLP down projection (18,944 inputs) that is the largest product of the calibration
passes. ``GramAccumulator`` sums it in place a block of columns at a time, only the blocks on and
above the diagonal (BLAS's syrk, written with the compute library's GEMM so that it runs on
torch's threads and kernels: BENCHMARKS.md "Scale"), and fills the lower blocks from the upper
ones once, when the sum is read; bf16 inputs are multiplied as bf16 and summed in float32
(``add_product``). ``gram_ref`` is the plain product it is held to.
"""

from __future__ import annotations

import torch

from dynquant.numerics.float32_sums import add_product, product_input

# Columns per block: at 1,024 the diagonal blocks (computed whole) add 1,024 / n of the full
# product's work, and each product is still large enough for the GEMM to run at its peak.
GRAM_BLOCK = 1024


def gram_ref(x: torch.Tensor) -> torch.Tensor:
    """X^T X of ``x`` [tokens, width] in float32, plainly."""
    x = x.float()
    return x.T @ x


class GramAccumulator:
    """X^T X summed over the rows of every ``add``, in float32, in place. The sum is kept as
    its column strips above the diagonal (strip j: rows ``[0, end_j)`` of columns
    ``[start_j, end_j)``), about half a full matrix: at an 18,944-wide input a shard's sum and
    the block's it folds into are 0.8 GB each, not 1.4."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.strips = [torch.zeros(end, end - start) for start, end in _strips(width)]
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add ``x`` [..., width]'s X^T X (its rows flattened; bf16 stays bf16)."""
        x = product_input(x.detach().reshape(-1, self.width))
        for strip, (start, end) in zip(self.strips, _strips(self.width), strict=True):
            add_product(strip, x[:, :end].T, x[:, start:end])
        self.rows += x.shape[0]

    def add_sum(self, other: GramAccumulator) -> None:
        """Fold in another accumulator's sum (a shard of the same inputs)."""
        for strip, theirs in zip(self.strips, other.strips, strict=True):
            strip.add_(theirs)
        self.rows += other.rows

    def mean(self, rows: int | None = None, consume: bool = False) -> torch.Tensor:
        """X^T X / ``rows`` (default: the rows added), whole: the lower blocks copied from the
        upper ones. With ``consume`` the strips are freed as they are copied (the accumulator
        is done with)."""
        divisor = max(self.rows if rows is None else rows, 1)
        full = torch.empty(self.width, self.width)
        for j, (start, end) in reversed(list(enumerate(_strips(self.width)))):
            strip = self.strips[j]
            torch.div(strip, divisor, out=full[:end, start:end])
            full[start:end, :start] = full[:start, start:end].T
            if consume:
                self.strips[j] = torch.empty(0)
        return full


def _strips(width: int) -> list[tuple[int, int]]:
    """Each strip's columns [start, end)."""
    return [(start, min(start + GRAM_BLOCK, width)) for start in range(0, width, GRAM_BLOCK)]
