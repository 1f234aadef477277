"""Group-wise asymmetric quantization with a per-group clip search.

Per group of ``group_size`` consecutive values along the last axis:
``scale = (hi - lo) / (2^bits - 1)`` and ``offset = lo``, both rounded to bfloat16 *before* the
codes are computed, ``q = clamp(round((w - offset) / scale), 0, 2^bits - 1)`` and
``w_hat = q * scale + offset`` (float32). The clip search tries ``[lo, hi] = alpha * [min, max]`` for
alpha = 1.00, 0.98, ..., 0.80 and keeps, per group, the alpha with the least (optionally
importance-weighted) squared error measured with the stored bf16 scale/offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dynquant.errors import QuantizationError
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import pack_codes, unpack_codes
from dynquant.format.widths import DEFAULT_GROUP_SIZE, width

CLIP_ALPHAS: tuple[float, ...] = tuple(round(1.0 - 0.02 * k, 2) for k in range(11))
# Rows are processed in chunks of about this many values, so that scratch memory stays bounded
# (~10 float32 temporaries of this size: ~320 MB) whatever the tensor's size.
CHUNK_ELEMENTS = 1 << 23


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
) -> torch.Tensor:
    """Dequantize a block of rows (e.g. the embedding rows a batch looks up) to [rows, in]."""
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


def _codes_for(
    w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, max_code: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored scale/offset and codes of groups ``w`` [r, g, gs] for ranges ``lo``/``hi`` [r, g]."""
    scale = _round_bf16((hi - lo) / max_code)
    offset = _round_bf16(lo)
    # A constant group has scale 0: every code is 0 and w_hat = offset (never a division by 0).
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((w - offset.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, max_code)
    w_hat = q * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    return q, scale, offset, w_hat


@dataclass
class _ChunkResult:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    clipped_groups: int
    chosen_error: float
    minmax_error: float


def _quantize_chunk(
    w: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor, bits: int, clip: bool
) -> _ChunkResult:
    """Quantize groups ``w`` [r, g, gs] (padding where ``valid`` is False; error ``weight``)."""
    max_code = (1 << bits) - 1
    inf = torch.tensor(math.inf)
    mn = torch.where(valid, w, inf).amin(-1)
    mx = torch.where(valid, w, -inf).amax(-1)
    # Track only the best alpha per group; the codes are computed once, for the winners.
    best_alpha = torch.ones_like(mn)
    best_err = minmax_err = None
    for alpha in CLIP_ALPHAS if clip else (1.0,):
        *_, w_hat = _codes_for(w, mn * alpha, mx * alpha, max_code)
        err = ((w_hat - w).square_() * weight).sum(-1)
        if best_err is None:
            best_err = minmax_err = err
            continue
        better = err < best_err
        best_alpha = torch.where(better, alpha, best_alpha)
        best_err = torch.where(better, err, best_err)
    clipped = best_alpha < 1.0
    q, scale, offset, _ = _codes_for(w, mn * best_alpha, mx * best_alpha, max_code)
    q = torch.where(valid, q, torch.zeros_like(q))  # padding is code 0
    return _ChunkResult(
        codes=q.to(torch.uint8).reshape(q.shape[0], -1),
        scales=scale.to(torch.bfloat16),
        offsets=offset.to(torch.bfloat16),
        clipped_groups=int(clipped.sum()),
        chosen_error=float(best_err.double().sum()),
        minmax_error=float(minmax_err.double().sum()),
    )


def _check_weight(weight: torch.Tensor, importance: torch.Tensor | None) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise QuantizationError("weight must be a floating-point torch.Tensor", field="weight")
    if weight.ndim < 2 or weight.numel() == 0:
        raise QuantizationError(
            f"weight must have 2 or more non-empty dimensions, got shape {list(weight.shape)}",
            field="weight",
        )
    if importance is not None and tuple(importance.shape) != (weight.shape[-1],):
        raise QuantizationError(
            f"importance must have shape [{weight.shape[-1]}], got {list(importance.shape)}",
            field="importance",
        )


def quantize_tensor(
    weight: torch.Tensor,
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    clip: bool = True,
    importance: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``weight`` (groups along its last axis) to ``bits`` with bf16 scales/offsets.

    ``clip`` runs the clip search for widths below 8 (8-bit codes are never clipped).
    ``importance`` [in_features], if given, weights the squared error of each input column.
    """
    _check_weight(weight, importance)
    layout = LayerLayout.create(tuple(weight.shape), bits, group_size)
    w_rows = weight.detach().reshape(layout.num_rows, layout.in_features)
    pad = layout.padded_in_features - layout.in_features
    col_weight = torch.ones(layout.padded_in_features)
    if importance is not None:
        col_weight[: layout.in_features] = importance.detach().to(torch.float32)
    col_weight[layout.in_features :] = 0.0
    col_weight = col_weight.reshape(layout.num_groups, group_size)
    valid = (torch.arange(layout.padded_in_features) < layout.in_features).reshape(
        layout.num_groups, group_size
    )
    step = max(1, CHUNK_ELEMENTS // layout.padded_in_features)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    clipped = 0
    chosen = minmax = 0.0
    for start in range(0, layout.num_rows, step):
        chunk = w_rows[start : start + step].to(torch.float32)
        if not bool(torch.isfinite(chunk).all()):
            raise QuantizationError("weight holds NaN or Inf values", field="weight")
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        groups = chunk.reshape(chunk.shape[0], layout.num_groups, group_size)
        res = _quantize_chunk(groups, valid, col_weight, bits, clip and bits < 8)
        parts.append((pack_codes(res.codes, bits), res.scales, res.offsets))
        clipped += res.clipped_groups
        chosen += res.chosen_error
        minmax += res.minmax_error
    total_groups = layout.num_rows * layout.num_groups
    return QuantizedTensor(
        qweight=torch.cat([p[0] for p in parts]),
        scales=torch.cat([p[1] for p in parts]),
        offsets=torch.cat([p[2] for p in parts]),
        logical_shape=layout.logical_shape,
        bits=bits,
        group_size=group_size,
        clipped_fraction=clipped / total_groups,
        clip_improvement=(1.0 - chosen / minmax) if minmax > 0 else 0.0,
    )


def relative_error(weight: torch.Tensor, qt: QuantizedTensor) -> float:
    """||W - W_hat||^2 / ||W||^2 with W_hat in float32 (before the cast to the compute dtype)."""
    w = weight.detach().to(torch.float32)
    w_hat = qt.dequantize(torch.float32)
    denom = float(w.double().square().sum())
    return float((w - w_hat).double().square().sum()) / denom if denom > 0 else 0.0


__all__ = ["CLIP_ALPHAS", "QuantizedTensor", "dequantize", "quantize_tensor", "relative_error",
           "width"]
