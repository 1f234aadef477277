"""``StoredLinear``: a dense Linear kept in bfloat16, its file dtype, in a model that computes
in float32 (CPUs without native bf16 dot products).

Converting a checkpoint's dense bf16 matrices to float32 at load time doubles their memory: an
untied head alone can be a third of a small model's file. Here the matrix stays as stored; a few
tokens (decode) multiply it in ``native/dense_matvec.c``, which converts each bf16 weight as it
reads it (a shift); more tokens (prefill) convert a block of rows at a time into a reused
float32 buffer for the BLAS, as the packed modules do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynquant.numerics import native
from dynquant.numerics.packed_matvec import MAX_TOKENS, PARALLEL_MIN_ELEMENTS
from dynquant.runtime.packed_modules import DEQUANT_BLOCK_ELEMENTS, needs_grad, thread_scratch


class StoredLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with ``weight`` held in bfloat16 whatever x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16,
                                               device="meta"), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype or needs_grad(x):
            y = F.linear(x, w.to(x.dtype))
        else:
            y = self._float_product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _float_product(self, x: torch.Tensor) -> torch.Tensor:
        lib = native.library()
        w = self.weight
        if lib is not None and x.shape[0] <= MAX_TOKENS and w.is_contiguous():
            xf = x.float().contiguous()
            y = torch.empty(xf.shape[0], self.out_features)
            threads = native.threads_for(w.numel(), PARALLEL_MIN_ELEMENTS)
            if lib.dq_dense_matvec_bf16_mt(w.data_ptr(), self.out_features, self.in_features,
                                           xf.data_ptr(), xf.shape[0], y.data_ptr(),
                                           self.out_features, threads):
                raise RuntimeError("dq_dense_matvec_bf16 failed")
            return y.to(x.dtype)
        step = max(1, DEQUANT_BLOCK_ELEMENTS // self.in_features)
        parts = []
        for r in range(0, self.out_features, step):
            block = thread_scratch((min(step, self.out_features - r), self.in_features), x.dtype)
            block.copy_(w[r:r + step])
            parts.append(F.linear(x, block))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, stored=bfloat16")


__all__ = ["StoredLinear"]
