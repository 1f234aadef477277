"""Group-wise asymmetric quantization with a per-group clip search.

Per group of ``group_size`` consecutive values along the last axis:
``scale = (hi - lo) / (2^bits - 1)`` and ``offset = lo``, both rounded to bfloat16 *before* the
codes are computed, ``q = clamp(round((w - offset) / scale), 0, 2^bits - 1)`` and
``w_hat = q * scale + offset`` (float32). The clip search tries ``[lo, hi] = alpha * [min, max]`` for
alpha = 1.00, 0.98, ..., 0.80 and keeps, per group, the alpha with the least (optionally
importance-weighted) squared error measured with the stored bf16 scale/offset.

Two implementations compute exactly this: the native kernel (``native/quantize_rows.c`` through
``row_kernels.py``, used when a C compiler is available) and the torch path below, which is the
fallback and the readable statement of the arithmetic. Both are held to the numpy reference
(``reference.py``) and to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from dynquant.errors import QuantizationError
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import pack_codes, unpack_codes
from dynquant.format.widths import DEFAULT_GROUP_SIZE, width
from dynquant.numerics import native, row_kernels

CLIP_ALPHAS: tuple[float, ...] = tuple(round(1.0 - 0.02 * k, 2) for k in range(11))
# Rows are processed in chunks of about this many values: scratch memory stays bounded whatever
# the tensor's size, and the clip search's passes over a chunk run from cache (2 MB a buffer).
CHUNK_ELEMENTS = 1 << 19


@dataclass
class QuantizedTensor:
    """A packed weight: codes, bf16 scales and offsets, and the statistics of its clip search."""

    qweight: torch.Tensor  # int32 [num_rows, num_groups * words_per_group]
    scales: torch.Tensor  # bfloat16 [num_rows, num_groups]
    offsets: torch.Tensor  # bfloat16 [num_rows, num_groups]
    logical_shape: tuple[int, ...]
    bits: int
    group_size: int
    clipped_fraction: float = 0.0
    clip_improvement: float = 0.0

    @property
    def layout(self) -> LayerLayout:
        return LayerLayout.create(self.logical_shape, self.bits, self.group_size)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.offsets, self.layout, dtype)

    def layer_entry(self) -> dict:
        return self.layout.entry(round(self.clipped_fraction, 6), round(self.clip_improvement, 6))


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    layout: LayerLayout,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``w = q * scale + offset`` in float32, cast to ``dtype``, in the module's logical shape."""
    w = dequantize_rows(qweight, scales, offsets, layout.bits, layout.group_size,
                        layout.in_features, dtype)
    return w.reshape(layout.logical_shape)


def dequantize_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize a block of rows (e.g. the embedding rows a batch looks up) to [rows, in],
    into ``out`` if given (a reused buffer spares the page faults of a fresh tensor).

    The native kernel answers when it can (float32/bf16 outputs), bit-identical to the torch
    path below."""
    fast = row_kernels.dequantize_rows(qweight, scales, offsets, bits, group_size, in_features,
                                       dtype, out=out)
    if fast is not None:
        return fast
    w = dequantize_rows_torch(qweight, scales, offsets, bits, group_size, in_features, dtype)
    return w if out is None else out.copy_(w)


def dequantize_rows_torch(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The torch path of :func:`dequantize_rows`: ``w = q * scale + offset`` in float32."""
    rows, groups = scales.shape
    w = unpack_codes(qweight, bits).view(rows, groups, group_size).to(torch.float32)
    # multiply, then add (no fused multiply-add): the reference's exact float32 arithmetic
    w.mul_(scales.to(torch.float32).unsqueeze(-1)).add_(offsets.to(torch.float32).unsqueeze(-1))
    w = w.view(rows, groups * group_size)
    if groups * group_size != in_features:
        w = w[:, :in_features]
    return w.to(dtype)


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _scale_offset(lo: torch.Tensor, hi: torch.Tensor, max_code: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored (bf16-rounded) scale and offset of ranges ``lo``/``hi``, and a safe divisor.

    A constant group has scale 0: its divisor is inf, so every code is 0 and w_hat = offset.
    """
    scale = _round_bf16((hi - lo) / max_code)
    offset = _round_bf16(lo)
    return scale, offset, torch.where(scale == 0, torch.inf, scale)


def _positions(w: torch.Tensor, offset: torch.Tensor, divisor: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x = (w - offset) / scale: the real-valued code of every value (groups on the last axis)."""
    return torch.sub(w, offset.unsqueeze(-1), out=out).div_(divisor.unsqueeze(-1))


@dataclass
class _ChunkResult:
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    clipped_groups: int
    chosen_error: float
    minmax_error: float


LANES = 16


def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a multiple of 16 long) in the order the format fixes: value j goes
    to lane j % 16, each lane adds its values in order, and the lanes are combined as
    ``((l0+l8) + (l4+l12)) + ((l2+l10) + (l6+l14))`` + ... i.e. halves added lane-wise
    (16 -> 8 -> 4), then ``(s0 + s2) + (s1 + s3)``. Every implementation sums this way, so the
    clip search's near-ties resolve the same in all of them (float32 sums depend on order)."""
    blocks = x.unflatten(-1, (-1, LANES))
    acc = blocks[..., 0, :].clone()
    for k in range(1, blocks.shape[-2]):
        acc += blocks[..., k, :]
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def _search_errors(w: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, weight: torch.Tensor | None,
                   max_code: int, alphas: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """Per group: the best alpha, its error and the min-max (alpha = 1) error.

    The error of a group is ``scale^2 * lane_sum((q - x)^2)`` (= sum (q*scale + offset - w)^2,
    the error with the stored scale/offset). The per-group scales of every alpha are computed at
    once; the loop over alphas only makes the passes over the values, in two scratch buffers
    small enough to stay in cache. ``argmin`` keeps the first (largest) alpha among equal errors.
    """
    a = _alpha_tensor(alphas).view(-1, 1, 1)
    scale, offset, divisor = _scale_offset(mn * a, mx * a, max_code)  # [A, r, g]
    errs = torch.empty_like(scale)
    x, q = torch.empty_like(w), torch.empty_like(w)
    for i in range(len(alphas)):
        _positions(w, offset[i], divisor[i], out=x)
        torch.round(x, out=q).clamp_(0, max_code).sub_(x).square_()
        if weight is not None:
            q.mul_(weight)
        errs[i] = lane_sum(q)
    errs.mul_(scale.square())
    constant = scale == 0
    if bool(constant.any()):  # constant groups: the error is the offset's rounding
        d = (w.unsqueeze(0) - offset.unsqueeze(-1)).square_()
        errs = torch.where(constant, lane_sum(d if weight is None else d * weight), errs)
    best = errs.argmin(0)
    return a.view(-1)[best], errs.gather(0, best.unsqueeze(0))[0], errs[0]


def _quantize_chunk(
    w: torch.Tensor, valid: torch.Tensor | None, weight: torch.Tensor | None, bits: int,
    alphas: tuple[float, ...]
) -> _ChunkResult:
    """Quantize groups ``w`` [r, g, gs] (padding where ``valid`` is False; error ``weight``)."""
    max_code = (1 << bits) - 1
    if valid is None:
        mn, mx = w.amin(-1), w.amax(-1)
    else:
        mn = torch.where(valid, w, torch.inf).amin(-1)
        mx = torch.where(valid, w, -torch.inf).amax(-1)
    best_alpha, best_err, minmax_err = _search_errors(w, mn, mx, weight, max_code, alphas)
    scale, offset, divisor = _scale_offset(mn * best_alpha, mx * best_alpha, max_code)
    q = torch.round(_positions(w, offset, divisor)).clamp_(0, max_code)
    if valid is not None:
        q.masked_fill_(~valid, 0)  # padding is code 0
    return _ChunkResult(
        qweight=pack_codes(q.to(torch.uint8).reshape(q.shape[0], -1), bits),
        scales=scale.to(torch.bfloat16),
        offsets=offset.to(torch.bfloat16),
        clipped_groups=int((best_alpha < 1.0).sum()),
        chosen_error=float(best_err.double().sum()),
        minmax_error=float(minmax_err.double().sum()),
    )


def _quantize_rows_torch(rows: torch.Tensor, layout: LayerLayout, alphas: tuple[float, ...],
                         importance: torch.Tensor | None) -> _ChunkResult:
    """The torch path: float32 rows [r, in_features] padded to whole groups, then searched."""
    if not bool(torch.isfinite(rows).all()):
        raise QuantizationError("weight holds NaN or Inf values", field="weight")
    pad = layout.padded_in_features - layout.in_features
    valid = weight = None
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
        valid = (torch.arange(layout.padded_in_features) < layout.in_features).reshape(
            layout.num_groups, layout.group_size)
    if pad or importance is not None:  # per-column error weights; padding weighs nothing
        weight = torch.zeros(layout.padded_in_features)
        weight[: layout.in_features] = 1.0 if importance is None else importance
        weight = weight.reshape(layout.num_groups, layout.group_size)
    groups = rows.reshape(rows.shape[0], layout.num_groups, layout.group_size)
    return _quantize_chunk(groups, valid, weight, layout.bits, alphas)


def _quantize_rows_native(rows: torch.Tensor, bits: int, group_size: int,
                          alphas: tuple[float, ...], importance: torch.Tensor | None
                          ) -> _ChunkResult | None:
    """The same computation in the native kernel; None when it is unavailable."""
    try:
        res = row_kernels.quantize_rows(rows, bits, group_size, _alpha_tensor(alphas), importance)
    except ValueError:
        raise QuantizationError("weight holds NaN or Inf values", field="weight") from None
    if res is None:
        return None
    return _ChunkResult(
        qweight=res.qweight,
        scales=res.scales,
        offsets=res.offsets,
        clipped_groups=int(res.chosen.count_nonzero()),  # alphas[0] == 1.0: no clip
        chosen_error=float(res.chosen_error.sum(dtype=torch.float64)),
        minmax_error=float(res.first_error.sum(dtype=torch.float64)),
    )


@cache
def _alpha_tensor(alphas: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(alphas, dtype=torch.float32)


def _check_weight(weight: torch.Tensor, importance: torch.Tensor | None) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise QuantizationError("weight must be a floating-point torch.Tensor", field="weight")
    if weight.ndim < 2 or weight.numel() == 0:
        raise QuantizationError(
            f"weight must have 2 or more non-empty dimensions, got shape {list(weight.shape)}",
            field="weight",
        )
    allowed = {(weight.shape[-1],)} | ({(weight.shape[0], weight.shape[-1])}
                                        if weight.ndim == 3 else set())
    if importance is not None and tuple(importance.shape) not in allowed:
        raise QuantizationError(
            f"importance must have shape [{weight.shape[-1]}] (or [experts, {weight.shape[-1]}] "
            f"for an expert bank), got {list(importance.shape)}", field="importance")


def quantize_tensor(
    weight: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    clip: bool = True,
    importance: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``weight`` (groups along its last axis) to ``bits`` with bf16 scales/offsets.

    ``clip`` runs the clip search for widths below 8 (8-bit codes are never clipped).
    ``importance`` [in_features], if given, weights the squared error of each input column; an
    expert bank [E, out, in] may have one row of it per expert ([E, in]: each expert's own
    inputs), and each expert is then quantized with its own.
    """
    _check_weight(weight, importance)
    layout = LayerLayout.create(tuple(weight.shape), bits, group_size)
    w_rows = weight.detach().reshape(layout.num_rows, layout.in_features)
    if importance is not None:
        importance = importance.detach().to(torch.float32)
    alphas = CLIP_ALPHAS if clip and bits < 8 else (1.0,)
    parts: list[_ChunkResult] = []
    for start, stop, cols in _row_blocks(layout, w_rows.dtype, importance):
        block = w_rows[start:stop]
        if block.dtype not in native.INPUT_DTYPES:
            block = block.to(torch.float32)
        res = _quantize_rows_native(block, bits, group_size, alphas, cols)
        parts.append(res if res is not None else
                     _quantize_rows_torch(block.to(torch.float32), layout, alphas, cols))
    total_groups = layout.num_rows * layout.num_groups
    chosen = sum(p.chosen_error for p in parts)
    minmax = sum(p.minmax_error for p in parts)
    return QuantizedTensor(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        offsets=torch.cat([p.offsets for p in parts]),
        logical_shape=layout.logical_shape,
        bits=bits,
        group_size=group_size,
        clipped_fraction=sum(p.clipped_groups for p in parts) / total_groups,
        clip_improvement=(1.0 - chosen / minmax) if minmax > 0 else 0.0,
    )


def _row_blocks(layout: LayerLayout, dtype: torch.dtype, importance: torch.Tensor | None
                ) -> list[tuple[int, int, torch.Tensor | None]]:
    """(first row, end row, column importance) of the blocks quantized at once. The native
    kernel reads float32/bf16 rows in place (one call, split across threads); the torch path and
    other dtypes take cache-sized blocks converted to float32; per-expert importance, one block
    per expert."""
    if importance is not None and importance.ndim == 2:
        per = layout.num_rows // importance.shape[0]
        return [(e * per, (e + 1) * per, importance[e]) for e in range(importance.shape[0])]
    whole = native.available() and dtype in native.INPUT_DTYPES
    step = layout.num_rows if whole else max(1, CHUNK_ELEMENTS // layout.padded_in_features)
    return [(s, min(s + step, layout.num_rows), importance)
            for s in range(0, layout.num_rows, step)]


def squared_norm(weight: torch.Tensor) -> float:
    """||W||^2 in float64, a block at a time (no full-size float64 copy of a large tensor)."""
    flat = weight.detach().reshape(-1)
    return sum(float(flat[i : i + CHUNK_ELEMENTS].to(torch.float32).square().sum(
        dtype=torch.float64)) for i in range(0, flat.numel(), CHUNK_ELEMENTS))


def relative_error(weight: torch.Tensor, qt: QuantizedTensor,
                   importance: torch.Tensor | None = None) -> float:
    """||W - W_hat||^2 / ||W||^2 (W_hat in float32), weighted per input column by
    ``importance`` when given. Computed a block of rows at a time: never a full float copy.
    Summed by numpy in a fixed order: the same bits on any number of threads (a Ray worker's
    one thread and a local run's several write the same maps)."""
    lay = qt.layout
    rows = weight.detach().reshape(lay.num_rows, lay.in_features)
    col = None if importance is None else importance.detach().to(torch.float32)
    per_expert = col is not None and col.ndim == 2
    rows_per = lay.num_rows // col.shape[0] if per_expert else 0
    step = max(1, CHUNK_ELEMENTS // lay.in_features)
    num = den = 0.0
    for r in range(0, lay.num_rows, step):
        w = rows[r : r + step].to(torch.float32)
        w_hat = dequantize_rows(qt.qweight[r : r + step], qt.scales[r : r + step],
                                qt.offsets[r : r + step], lay.bits, lay.group_size,
                                lay.in_features, torch.float32)
        d2, w2 = (w_hat - w).square_(), w.square()
        if col is not None:
            c = col[torch.arange(r, r + w.shape[0]) // rows_per] if per_expert else col
            d2, w2 = d2 * c, w2 * c
        num += float(d2.numpy().sum(dtype=np.float64))
        den += float(w2.numpy().sum(dtype=np.float64))
    return num / den if den > 0 else 0.0


__all__ = ["CLIP_ALPHAS", "QuantizedTensor", "dequantize", "quantize_tensor", "relative_error",
           "width"]
