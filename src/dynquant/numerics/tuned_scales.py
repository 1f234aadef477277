"""Group scales and offsets tuned by gradient descent on an output error, the codes frozen
(EfficientQAT's E2E-QP and OmniQuant's learnable clipping, in the format's own terms).

Codes ``q`` with bf16 scale ``s0`` and offset ``o0`` per group (GPTQ's, say) stay as they are;
per group two factors ``a``, ``b`` (zero at the start) give

    s = bf16(s0 * (1 + a)),  o = bf16(o0 + s0 * b),  w_hat = q * s + o

The bf16 rounding passes its gradient straight through, so ``w_hat`` is differentiable in ``a``
and ``b`` and is exactly what the tuned codes dequantize to: :meth:`TunableScales.codes` writes
the same ``q`` beside the new ``s`` and ``o`` as an ordinary :class:`QuantizedTensor`, which no
reader can tell from any other. The caller chooses the error (``pipeline/codes/tuned_scales.py``:
a decoder block's output against the float block's).

Freezing the codes is a measured choice: learning per-weight rounding offsets as well (SignRound
/ AutoRound, signed gradient steps through a straight-through rounding) made a SmolLM2 block's
output error larger than GPTQ's codes it started from, at 1e-3 and 5e-3 step sizes, while the
scales alone lower it (BENCHMARKS.md "Tuned scales").
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from dynquant.format.packing import unpack_codes
from dynquant.numerics.quantizer import QuantizedTensor, dequantize_rows


def _straight(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` in the forward pass (exactly: x - x is 0), the identity's gradient in the
    backward."""
    return rounded.detach() + (x - x.detach())


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return _straight(x, x.detach().to(torch.bfloat16).float())


CHUNK_ELEMENTS = 1 << 20  # codes a chunk of rows holds: its float temporaries stay in cache


class _GroupDequantize(torch.autograd.Function):
    """``start``'s codes q with scales ``s`` and offsets ``o`` (bf16 values in float32) as the
    format dequantizes them (``dequantize_rows``: [rows, in_features] float32, the native kernel
    where it runs), and the gradients in ``s`` and ``o`` (the group sums of the output's gradient
    times the codes q [rows, groups, group_size], and of the gradient) a chunk of rows at a time:
    the same values as autograd's broadcast product and sum, without their whole-tensor
    temporaries, which at a 7B block's shapes (a float copy of the codes, the product, the
    gradient times the codes) cost twice the block's matrix products per tuning step."""

    @staticmethod
    def forward(ctx, start: QuantizedTensor, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor
                ) -> torch.Tensor:
        lay = start.layout
        ctx.save_for_backward(q)
        return dequantize_rows(start.qweight, s.to(torch.bfloat16), o.to(torch.bfloat16),
                               lay.bits, lay.group_size, lay.in_features, torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor, torch.Tensor]:
        (q,) = ctx.saved_tensors
        rows, groups, size = q.shape
        if grad.shape[1] != groups * size:  # a padded last group: its pad had no gradient
            grad = F.pad(grad, (0, groups * size - grad.shape[1]))
        grad = grad.float().reshape(rows, groups, size)
        grad_s = torch.empty(rows, groups, dtype=torch.float32)
        grad_o = torch.empty(rows, groups, dtype=torch.float32)
        step = max(1, CHUNK_ELEMENTS // (groups * size))
        times = torch.empty(min(step, rows), groups, size, dtype=torch.float32)
        for r in range(0, rows, step):
            g = grad[r : r + step]
            torch.mul(g, q[r : r + step], out=times[: g.shape[0]])
            torch.sum(g, dim=-1, out=grad_o[r : r + step])
            torch.sum(times[: g.shape[0]], dim=-1, out=grad_s[r : r + step])
        return None, None, grad_s, grad_o


class TunableScales(nn.Module):
    """One tensor's frozen codes with learnable group scales and offsets."""

    def __init__(self, start: QuantizedTensor) -> None:
        super().__init__()
        lay = start.layout
        self.start, self.in_features = start, lay.in_features
        self.max_code = (1 << lay.bits) - 1
        # the codes as bytes (a float copy would be 4 bytes a weight for the whole model)
        self.q = unpack_codes(start.qweight, lay.bits).view(
            lay.num_rows, lay.num_groups, lay.group_size)
        self.s0, self.o0 = start.scales.float(), start.offsets.float()
        self.a = nn.Parameter(torch.zeros_like(self.s0))
        self.b = nn.Parameter(torch.zeros_like(self.s0))

    def _scale_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _bf16(self.s0 * (1 + self.a)), _bf16(self.o0 + self.s0 * self.b)

    def forward(self) -> torch.Tensor:
        """The dequantized weight in its logical shape (float32; the format's arithmetic:
        multiply, then add)."""
        s, o = self._scale_offset()
        return _GroupDequantize.apply(self.start, self.q, s, o).reshape(self.start.logical_shape)

    @torch.no_grad()
    def codes(self) -> QuantizedTensor:
        """The codes with the current scales and offsets (dequantizing to ``forward()``)."""
        s, o = self._scale_offset()
        return replace(self.start, scales=s.to(torch.bfloat16), offsets=o.to(torch.bfloat16))
