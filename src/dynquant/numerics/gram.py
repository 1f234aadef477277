"""Second moments X^T X as symmetric rank-k updates: half the products of a plain X^T X.

GPTQ and its ratios need X^T X of every Linear's input over many calibration tokens; at a 7B
model's MLP down projection (18,944 inputs) that is the largest product of the calibration
passes. ``GramAccumulator`` sums it in place a block of columns at a time, only the blocks on and
above the diagonal (BLAS's syrk, written with the compute library's GEMM so that it runs on
torch's threads and kernels: BENCHMARKS.md "Scale"), and fills the lower blocks from the upper
ones once, when the sum is read. ``gram_ref`` is the plain product it is held to.
"""

from __future__ import annotations

import torch

# Columns per block: at 1,024 the diagonal blocks (computed whole) add 1,024 / n of the full
# product's work, and each product is still large enough for the GEMM to run at its peak.
GRAM_BLOCK = 1024


def gram_ref(x: torch.Tensor) -> torch.Tensor:
    """X^T X of ``x`` [tokens, width] in float32, plainly."""
    x = x.float()
    return x.T @ x


class GramAccumulator:
    """X^T X summed over the rows of every ``add``, in float32, in place."""

    def __init__(self, width: int) -> None:
        self.upper = torch.zeros(width, width)  # the blocks on and above the diagonal
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add ``x`` [..., width]'s X^T X (its rows flattened)."""
        n = self.upper.shape[0]
        x = x.detach().reshape(-1, n).float()
        for start in range(0, n, GRAM_BLOCK):
            end = min(start + GRAM_BLOCK, n)
            self.upper[:end, start:end].addmm_(x[:, :end].T, x[:, start:end])
        self.rows += x.shape[0]

    def add_sum(self, other: GramAccumulator) -> None:
        """Fold in another accumulator's sum (a shard of the same inputs)."""
        self.upper.add_(other.upper)
        self.rows += other.rows

    def mean(self, rows: int | None = None, consume: bool = False) -> torch.Tensor:
        """X^T X / ``rows`` (default: the rows added), whole: the lower blocks copied from the
        upper ones. A new tensor, or with ``consume`` the accumulator's own memory (it is
        done with: at an 18,944-wide input a copy is 1.4 GB more at the peak)."""
        divisor = max(self.rows if rows is None else rows, 1)
        full = self.upper.div_(divisor) if consume else self.upper / divisor
        n = full.shape[0]
        for start in range(GRAM_BLOCK, n, GRAM_BLOCK):
            end = min(start + GRAM_BLOCK, n)
            full[start:end, :start] = full[:start, start:end].T
        return full
