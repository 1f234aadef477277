"""Group scales and offsets tuned by gradient descent on an output error (EfficientQAT's E2E-QP
and OmniQuant's learnable clipping, in the format's own terms), and the codes' rounding with
them where their rounding residual is known.

Codes ``q`` with bf16 scale ``s0`` and offset ``o0`` per group (GPTQ's, say) stay as they are;
per group two factors ``a``, ``b`` (zero at the start) give

    s = bf16(s0 * (1 + a)),  o = bf16(o0 + s0 * b),  w_hat = q * s + o

The bf16 rounding passes its gradient straight through, so ``w_hat`` is differentiable in ``a``
and ``b`` and is exactly what the tuned codes dequantize to: :meth:`TunableScales.codes` writes
the same ``q`` beside the new ``s`` and ``o`` as an ordinary :class:`QuantizedTensor`, which no
reader can tell from any other. The caller chooses the error (``pipeline/codes/tuned_scales.py``:
a decoder block's output against the float block's).

Given the rounding residual each code was rounded from (``gptq_residual``: GPTQ rounded
``q + r`` to ``q``), the codes are tuned too (SignRound / AutoRound, from GPTQ's codes): per
weight a ``u`` starting at ``r`` and kept within [-1, 1] gives

    q' = clamp(round(q + u), 0, max_code),  w_hat = q' * s + o

so a code moves by one at most; the rounding passes its gradient straight through to ``u``,
which Adam steps inside the backward pass (:class:`RoundingOffsets`): a weight whose rounding
was a near tie flips where the caller's error says so (BENCHMARKS.md "Tuned scales").
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from dynquant.format.packing import pack_codes, unpack_codes
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


class RoundingOffsets:
    """Each weight's rounding, tuned: codes ``clamp(round(q + u))`` with ``u`` starting at the
    residual GPTQ rounded away (so at GPTQ's codes) and kept within [-1, 1] (a code moves by at
    most one), stepped by Adam on the gradient that passes straight through the rounding.

    The step is taken inside the backward pass, a chunk of rows at a time as each chunk's
    gradient is made (``_RoundedGroupDequantize``): a whole block's gradient would be 4 more
    bytes a weight (a 7B block: 0.9 GB), and Adam's moments are kept in bf16 for the same
    reason (u itself in float32: late steps are smaller than a float16 ulp)."""

    BETAS = (0.9, 0.999)
    EPS = 1e-8

    def __init__(self, q: torch.Tensor, residual: torch.Tensor, max_code: int) -> None:
        self.q, self.max_code = q, max_code  # q: uint8 [rows, groups, group_size]
        self.u = residual.float()
        self.m = torch.zeros_like(q, dtype=torch.bfloat16)
        self.s2 = torch.zeros_like(q, dtype=torch.bfloat16)
        self.t, self.lr = 0, 0.0

    def next_step(self, lr: float) -> None:
        """The step the next backward pass takes (0: none)."""
        self.lr = lr
        self.t += lr > 0

    def codes(self, rs: slice) -> torch.Tensor:
        """Rows ``rs``'s codes as float32 (torch rounds half to even)."""
        return torch.round(self.q[rs].float() + self.u[rs]).clamp_(0, self.max_code)

    def step(self, rs: slice, grad: torch.Tensor) -> None:
        """Adam's step on rows ``rs`` given their gradient in ``u``."""
        if self.lr <= 0:
            return
        (b1, b2), t = self.BETAS, self.t
        m = self.m[rs].float().mul_(b1).add_(grad, alpha=1 - b1)
        s2 = self.s2[rs].float().mul_(b2).addcmul_(grad, grad, value=1 - b2)
        self.m[rs], self.s2[rs] = m, s2
        denominator = s2.sqrt_().div_((1 - b2 ** t) ** 0.5).add_(self.EPS)
        self.u[rs].addcdiv_(m, denominator, value=-self.lr / (1 - b1 ** t)).clamp_(-1, 1)


class _RoundedGroupDequantize(torch.autograd.Function):
    """``rounding``'s codes with scales ``s`` and offsets ``o`` [rows, groups] dequantized
    (float32 [rows, groups * group_size]) a chunk of rows at a time; in the backward the
    gradients in ``s`` and ``o`` as in ``_GroupDequantize`` (with the codes as they were in the
    forward), then the rounding's step on each chunk's gradient in ``u`` (``grad * s``: straight
    through the rounding)."""

    @staticmethod
    def forward(ctx, rounding: RoundingOffsets, s: torch.Tensor, o: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(s)
        ctx.rounding = rounding
        rows, groups, size = rounding.q.shape
        out = torch.empty(rows, groups, size, dtype=torch.float32)
        for rs in _row_chunks(rounding.q):
            torch.addcmul(o[rs, :, None], rounding.codes(rs), s[rs, :, None], out=out[rs])
        return out.view(rows, groups * size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        (s,) = ctx.saved_tensors
        rounding: RoundingOffsets = ctx.rounding
        rows, groups, size = rounding.q.shape
        grad = grad.float().reshape(rows, groups, size)
        grad_s = torch.empty(rows, groups, dtype=torch.float32)
        grad_o = torch.empty(rows, groups, dtype=torch.float32)
        for rs in _row_chunks(rounding.q):
            g = grad[rs]
            torch.sum(g, dim=-1, out=grad_o[rs])
            torch.sum(g * rounding.codes(rs), dim=-1, out=grad_s[rs])
            rounding.step(rs, g * s[rs, :, None])
        return None, grad_s, grad_o


def _row_chunks(q: torch.Tensor) -> list[slice]:
    rows, groups, size = q.shape
    step = max(1, CHUNK_ELEMENTS // (groups * size))
    return [slice(i, i + step) for i in range(0, rows, step)]


class TunableScales(nn.Module):
    """One tensor's codes with learnable group scales and offsets, and with learnable rounding
    where ``residual`` (float16 [rows, in_features]: ``gptq_residual``'s) is given."""

    def __init__(self, start: QuantizedTensor, residual: torch.Tensor | None = None) -> None:
        super().__init__()
        lay = start.layout
        self.start, self.in_features = start, lay.in_features
        self.max_code = (1 << lay.bits) - 1
        shape = (lay.num_rows, lay.num_groups, lay.group_size)
        # the codes as bytes (a float copy would be 4 bytes a weight for the whole model)
        self.q = unpack_codes(start.qweight, lay.bits).view(shape)
        self.s0, self.o0 = start.scales.float(), start.offsets.float()
        self.a = nn.Parameter(torch.zeros_like(self.s0))
        self.b = nn.Parameter(torch.zeros_like(self.s0))
        self.rounding: RoundingOffsets | None = None
        if residual is not None:  # a padded group's pad: code 0, residual 0, no gradient: 0
            pad = lay.num_groups * lay.group_size - lay.in_features
            r = F.pad(residual.reshape(lay.num_rows, -1), (0, pad)).view(shape)
            self.rounding = RoundingOffsets(self.q, r, self.max_code)

    def scale_parameters(self) -> list[nn.Parameter]:
        return [self.a, self.b]

    def _scale_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _bf16(self.s0 * (1 + self.a)), _bf16(self.o0 + self.s0 * self.b)

    def forward(self) -> torch.Tensor:
        """The dequantized weight in its logical shape (float32; the format's arithmetic:
        multiply, then add)."""
        s, o = self._scale_offset()
        if self.rounding is None:
            w = _GroupDequantize.apply(self.start, self.q, s, o)
        else:
            w = _RoundedGroupDequantize.apply(self.rounding, s, o)[:, : self.in_features]
        return w.reshape(self.start.logical_shape)

    def next_rounding_step(self, lr: float) -> None:
        """Adam's step size on the rounding in the next backward pass (none without it)."""
        if self.rounding is not None:
            self.rounding.next_step(lr)

    @torch.no_grad()
    def codes(self) -> QuantizedTensor:
        """The codes with the current scales and offsets (dequantizing to ``forward()``)."""
        s, o = self._scale_offset()
        tuned = replace(self.start, scales=s.to(torch.bfloat16), offsets=o.to(torch.bfloat16))
        if self.rounding is None:
            return tuned
        q = torch.cat([self.rounding.codes(rs) for rs in _row_chunks(self.q)]).to(torch.uint8)
        return replace(tuned, qweight=pack_codes(q.reshape(q.shape[0], -1), self.start.bits))
