"""A :class:`TunableScales` tensor used a part of its rows at a time, so that a vocabulary-wide
matrix is never dequantized whole: the head's product in chunks of rows (``tunable_product``)
and an embedding's lookup of the rows a window uses (``tunable_rows``). Both are differentiable
in the input and in the tunable's scales and offsets, with the gradients of the plain path
(``TunableScales.forward`` then ``x @ w.T`` or ``w[rows]``) to float rounding: the same group
sums (``group_gradients``) over each chunk's own rows.

A 262,144 x 640 tied embedding dequantized whole is 671 MB of float32 and as much again for its
gradient; a chunk here is ``CHUNK_ELEMENTS`` weights (16 MB), made again in the backward."""

from __future__ import annotations

import torch

from dynquant.numerics.tuned_scales import TunableScales, row_chunks

CHUNK_ELEMENTS = 1 << 22


class _Product(torch.autograd.Function):
    """``x @ w.T`` for ``tunable``'s weight ``w`` [rows, in] with scales ``s`` and offsets ``o``,
    a chunk of rows at a time, forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: torch.Tensor, o: torch.Tensor,
                tunable: TunableScales) -> torch.Tensor:
        ctx.save_for_backward(x, s, o)
        ctx.tunable = tunable
        flat = x.reshape(-1, x.shape[-1])
        packed = tunable.packed()
        out = flat.new_empty(len(flat), len(packed))
        for rs in row_chunks(tunable.shape, CHUNK_ELEMENTS):
            out[:, rs] = flat @ tunable.dequantize(packed[rs], s[rs], o[rs]).T
        return out.view(*x.shape[:-1], len(packed))

    @staticmethod
    def backward(ctx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, None]:
        x, s, o = ctx.saved_tensors
        tunable: TunableScales = ctx.tunable
        flat = x.reshape(-1, x.shape[-1])
        grad = grad.reshape(len(flat), -1)
        packed = tunable.packed()
        grad_x = torch.zeros_like(flat) if ctx.needs_input_grad[0] else None
        grad_s, grad_o = torch.empty_like(s), torch.empty_like(o)
        for rs in row_chunks(tunable.shape, CHUNK_ELEMENTS):
            g = grad[:, rs].contiguous()
            if grad_x is not None:
                grad_x.addmm_(g, tunable.dequantize(packed[rs], s[rs], o[rs]))
            grad_s[rs], grad_o[rs] = tunable.group_gradients(g.T @ flat, packed[rs])
        return (None if grad_x is None else grad_x.view(x.shape)), grad_s, grad_o, None


class _Rows(torch.autograd.Function):
    """Rows ``rows`` (distinct, int64) of ``tunable``'s weight with scales ``s`` and offsets
    ``o``: float32 [len(rows), in]; the gradients land on those rows' groups alone."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, s: torch.Tensor, o: torch.Tensor,
                tunable: TunableScales) -> torch.Tensor:
        packed = tunable.packed()[rows]
        ctx.save_for_backward(rows, packed)
        ctx.tunable, ctx.groups = tunable, s.shape
        return tunable.dequantize(packed, s[rows], o[rows])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor, None]:
        rows, packed = ctx.saved_tensors
        part_s, part_o = ctx.tunable.group_gradients(grad, packed)
        grad_s = torch.zeros(ctx.groups).index_copy_(0, rows, part_s)
        grad_o = torch.zeros(ctx.groups).index_copy_(0, rows, part_o)
        return None, grad_s, grad_o, None


def tunable_product(x: torch.Tensor, tunable: TunableScales) -> torch.Tensor:
    """``x @ w.T`` (float32) for ``tunable``'s current weight ``w``, never made whole."""
    return _Product.apply(x.float(), *tunable.scale_offset(), tunable)


def tunable_rows(rows: torch.Tensor, tunable: TunableScales) -> torch.Tensor:
    """Rows ``rows`` (distinct indices) of ``tunable``'s current weight (float32)."""
    return _Rows.apply(rows, *tunable.scale_offset(), tunable)
