"""Error-compensating quantization (GPTQ / OBQ) into exactly the seed's group-wise format.

Columns (input features) are quantized in order. When column ``j`` is rounded, its error is
pushed onto the columns not yet quantized through the inverse of the input second-moment matrix
H = X^T X / n, so that the layer's output ``W x`` (not the weight) is what stays close:

    Hinv = inverse(H + DAMP * mean(diag H) * I);  U = upper Cholesky factor of Hinv
    for each column j:  e = (w_j - w_hat_j) / U[j, j];  w_k -= e * U[j, k]  for k > j

Each group of ``group_size`` consecutive columns gets its bf16 scale and offset when its first
column is reached, from the usual clip search (``quantize_tensor``) on the error-updated
weights, weighted by diag(H) (the column mean squares the RTN path uses as importance): the
codes are ordinary asymmetric codes, the clip statistics keep their meaning. The fast path
(``gptq_quantize``) applies the updates of a block of columns lazily with one matrix product;
``gptq_quantize_ref`` is the plain statement, column by column in float64 (numpy).
"""

from __future__ import annotations

import numpy as np
import torch

from dynquant.errors import QuantizationError
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import pack_codes
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor

# Of the mean diagonal: keeps H invertible where inputs are (near) collinear, and keeps the
# compensation from fitting the calibration sample. 0.1, not GPTQ's 0.01: held-out KL of the
# sequential pass at 2.5 bits 0.27x vs 0.31x round-to-nearest's on SmolLM2, 0.41x vs 0.53x on
# llama-ref; at 3.25-4.25 bits within +-0.02 (BENCHMARKS.md "Error-compensating codes").
DAMP = 0.1


def inverse_factor(hessian: torch.Tensor, damp: float = DAMP,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in ``dtype`` (float32
    falls back to float64 when the damped H is too ill-conditioned for it). Columns that no
    input drives (diag 0) get a unit diagonal: their error goes nowhere.

    With J the reversal permutation and J H J = K K^T (lower Cholesky), H^-1 = (J K^-1 J)^T
    (J K^-1 J) and J K^-1 J is upper triangular: one Cholesky and one triangular inverse
    (LAPACK trtri), a third of the work of inverting H and factoring the inverse."""
    from scipy.linalg import lapack

    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    trtri = lapack.strtri if dtype == torch.float32 else lapack.dtrtri
    lower, info = torch.linalg.cholesky_ex(h.flip(0, 1).to(dtype))
    if int(info) == 0:
        inv, info = trtri(lower.numpy(), lower=1)
        if info == 0 and np.isfinite(inv).all():
            return torch.from_numpy(inv).flip(0, 1).contiguous()
    if dtype != torch.float64:
        return inverse_factor(hessian, damp, torch.float64).to(dtype)
    raise QuantizationError("second moments are not positive definite", field="hessian")


def _group_params(block: torch.Tensor, bits: int, group_size: int, importance: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Scale/offset (float32 of the stored bf16) of one group's columns [rows, <= gs], from the
    clip search; and its clip statistics (groups clipped, relative error the search saved)."""
    qt = quantize_tensor(block.to(torch.float32).contiguous(), bits, group_size,
                         importance=importance)
    clipped = round(qt.clipped_fraction * block.shape[0])
    return qt.scales[:, 0].float(), qt.offsets[:, 0].float(), clipped, qt.clip_improvement


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int = 128,
                  damp: float = DAMP, block: int = 128, dtype: torch.dtype = torch.float32,
                  factor: torch.Tensor | None = None) -> QuantizedTensor:
    """``weight`` [out, in] quantized with error feedback through ``hessian`` [in, in].

    Works on the transpose (a column of W is a contiguous row) with numpy inside a block, where
    every step touches one column and torch's per-call and threading overheads would dominate;
    the block's updates to later columns are one matrix product. ``factor``: the
    ``inverse_factor(hessian, damp)`` when the caller has it already (several widths)."""
    if weight.ndim != 2 or tuple(hessian.shape) != (weight.shape[1],) * 2:
        raise QuantizationError(f"gptq needs a 2-D weight and an [in, in] second-moment matrix, "
                                f"got {list(weight.shape)} and {list(hessian.shape)}",
                                field="hessian")
    if not bool(torch.isfinite(weight).all()) or not bool(torch.isfinite(hessian).all()):
        raise QuantizationError("weight or second moments hold NaN or Inf", field="weight")
    layout = LayerLayout.create(tuple(weight.shape), bits, group_size)
    rows, cols = weight.shape
    # whole groups per block: a group's scale/offset must see every earlier column's update,
    # and updates to columns past the block arrive only at its end
    block = group_size * max(1, block // group_size)
    u = (inverse_factor(hessian, damp, dtype) if factor is None else factor).to(dtype)
    un = u.numpy()
    importance = torch.diagonal(hessian).to(torch.float32).clamp(min=0)
    wt = weight.detach().to(dtype).T.contiguous()  # [in, out]
    w = wt.numpy()
    codes = np.zeros((layout.padded_in_features, rows), dtype=np.uint8)
    scales = np.zeros((layout.num_groups, rows), dtype=np.float32)
    offsets = np.zeros((layout.num_groups, rows), dtype=np.float32)
    max_code = (1 << bits) - 1
    clipped, improvements = 0, []  # clip_improvement: the mean over the column groups
    for start in range(0, cols, block):
        end = min(start + block, cols)
        errors = np.zeros((end - start, rows), dtype=w.dtype)
        for j in range(start, end):
            g = j // group_size
            if j % group_size == 0:
                g_end = min(j + group_size, cols)
                sc, of, c, improvement = _group_params(wt[j:g_end].T, bits, group_size,
                                                       importance[j:g_end])
                scales[g], offsets[g] = sc.numpy(), of.numpy()
                clipped += c
                improvements.append(improvement)
            s, o = scales[g], offsets[g]
            x = (w[j].astype(np.float32) - o) / np.where(s == 0, np.inf, s)
            q = np.clip(np.rint(x), 0, max_code)
            codes[j] = q
            err = (w[j] - (q * s + o)) / un[j, j]
            w[j + 1:end] -= un[j, j + 1:end, None] * err[None, :]
            errors[j - start] = err
        if end < cols:  # the block's errors reach every later column in one product
            wt[end:] -= u[start:end, end:].T @ torch.from_numpy(errors)
    return QuantizedTensor(
        qweight=pack_codes(torch.from_numpy(codes.T.copy()), bits),
        scales=torch.from_numpy(scales.T.copy()).to(torch.bfloat16),
        offsets=torch.from_numpy(offsets.T.copy()).to(torch.bfloat16),
        logical_shape=layout.logical_shape, bits=bits, group_size=group_size,
        clipped_fraction=clipped / (rows * layout.num_groups),
        clip_improvement=sum(improvements) / len(improvements))


def output_error(weight: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float:
    """tr(dW H dW^T) / tr(W H W^T): the relative squared error of the layer's output over the
    calibration inputs (what compensation minimises; with a diagonal H it is the
    importance-weighted relative error of round-to-nearest)."""
    w = weight.detach().to(torch.float32)
    h = hessian.to(torch.float32)
    d = qt.dequantize(torch.float32) - w
    den = float(((w @ h) * w).sum(dtype=torch.float64))
    return float(((d @ h) * d).sum(dtype=torch.float64)) / den if den > 0 else 0.0


def _inverse_factor_ref(hessian: np.ndarray, damp: float) -> np.ndarray:
    """The upper U with U^T U = (H + damp * mean(diag H) * I)^-1, plainly (dead inputs: 1)."""
    h = np.asarray(hessian, dtype=np.float64).copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(len(h))
    return np.linalg.cholesky(np.linalg.inv(h)).T


def gptq_quantize_ref(weight: np.ndarray, hessian: np.ndarray, bits: int, group_size: int = 128,
                      damp: float = DAMP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain reference: codes [out, in], scales and offsets [out, groups] (float32 values of the
    stored bf16), column by column in float64, every update applied at once."""
    from dynquant.numerics.reference import quantize_group_ref

    w = np.asarray(weight, dtype=np.float64).copy()
    rows, cols = w.shape
    u = _inverse_factor_ref(hessian, damp)
    importance = np.clip(np.diag(np.asarray(hessian, dtype=np.float64)), 0, None)
    groups = -(-cols // group_size)
    codes = np.zeros((rows, cols), dtype=np.int64)
    scales = np.zeros((rows, groups), dtype=np.float32)
    offsets = np.zeros((rows, groups), dtype=np.float32)
    max_code = (1 << bits) - 1
    for j in range(cols):
        g = j // group_size
        if j % group_size == 0:
            span = slice(j, min(j + group_size, cols))
            for r in range(rows):
                _, scales[r, g], offsets[r, g] = quantize_group_ref(
                    w[r, span].astype(np.float32), bits, importance[span].astype(np.float32))
        s, o = scales[:, g].astype(np.float32), offsets[:, g].astype(np.float32)
        x = (w[:, j].astype(np.float32) - o) / np.where(s == 0, np.inf, s)
        q = np.clip(np.round(x), 0, max_code)
        codes[:, j] = q
        w_hat = (q.astype(np.float32) * s + o).astype(np.float64)
        err = (w[:, j] - w_hat) / u[j, j]
        w[:, j + 1:] -= np.outer(err, u[j, j + 1:])
    return codes, scales, offsets


def row_order(hessian: torch.Tensor) -> torch.Tensor:
    """The order ``gptq_quantize_rows`` takes a weight's rows in: the inputs of the largest mean
    square first (GPTQ's act-order; free here, since a row's groups run along it and get their
    scale/offset whenever it is reached). On the hybrid reference model at 2.5 bits the
    compensated KL fell from 0.577x to 0.543x round-to-nearest's (natural order)."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


def rows_factor(hessian: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The inverse factor ``gptq_quantize_rows`` uses: of ``hessian`` in ``row_order``."""
    order = row_order(hessian)
    return inverse_factor(hessian[order][:, order], damp, torch.float32)


def gptq_quantize_rows(weight: torch.Tensor, hessian: torch.Tensor, bits: int,
                       group_size: int = 128, damp: float = DAMP,
                       factor: torch.Tensor | None = None) -> QuantizedTensor:
    """``weight`` [in, out], used as ``x @ weight`` (an expert of a bank stored ``[E, in, out]``),
    quantized with error feedback along its *rows*: the format's groups run along the last
    axis, so each row (one input feature) is quantized whole, its groups getting their
    scale/offset from the clip search when the row is reached, and its error goes to the rows
    not yet quantized through the factor of ``hessian`` [in, in] (same update as
    ``gptq_quantize`` on the transpose). Rows are taken in ``row_order``; ``factor``: the
    ``rows_factor(hessian, damp)`` when the caller has it already."""
    rows, cols = weight.shape
    if tuple(hessian.shape) != (rows, rows):
        raise QuantizationError(f"gptq needs an [in, in] second-moment matrix for a weight "
                                f"used as x @ W, got {list(hessian.shape)} for "
                                f"{list(weight.shape)}", field="hessian")
    order = row_order(hessian)
    u = rows_factor(hessian, damp) if factor is None else factor.float()
    w = weight.detach().to(torch.float32)[order].clone()
    parts: list[QuantizedTensor | None] = [None] * rows
    for j in range(rows):
        qt = quantize_tensor(w[j:j + 1].contiguous(), bits, group_size)
        err = (w[j] - qt.dequantize(torch.float32)[0]) / u[j, j]
        w[j + 1:] -= u[j, j + 1:, None] * err[None, :]
        parts[int(order[j])] = qt
    return concat_rows(parts, (rows, cols))


def concat_rows(parts: list[QuantizedTensor], logical_shape: tuple[int, ...]) -> QuantizedTensor:
    """Quantized blocks of rows (same width and group size) stacked into one tensor of
    ``logical_shape``: the format's rows are every axis but the last, flattened."""
    rows = sum(p.qweight.shape[0] for p in parts)
    return QuantizedTensor(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        offsets=torch.cat([p.offsets for p in parts]),
        logical_shape=tuple(logical_shape), bits=parts[0].bits, group_size=parts[0].group_size,
        clipped_fraction=sum(p.clipped_fraction * p.qweight.shape[0] for p in parts) / rows,
        clip_improvement=sum(p.clip_improvement for p in parts) / len(parts))


def gptq_quantize_rows_ref(weight: np.ndarray, hessian: np.ndarray, bits: int,
                           group_size: int = 128, damp: float = DAMP
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain reference of ``gptq_quantize_rows`` in float64: codes [in, out], scales and offsets
    [in, groups]; rows taken by decreasing diagonal of ``hessian`` (ties in their order)."""
    from dynquant.numerics.reference import quantize_group_ref

    h = np.asarray(hessian, dtype=np.float64)
    order = np.argsort(-np.diag(h), kind="stable")
    w = np.asarray(weight, dtype=np.float64)[order].copy()
    rows, cols = w.shape
    u = _inverse_factor_ref(h[np.ix_(order, order)], damp)
    groups = -(-cols // group_size)
    codes = np.zeros((rows, cols), dtype=np.int64)
    scales = np.zeros((rows, groups), dtype=np.float32)
    offsets = np.zeros((rows, groups), dtype=np.float32)
    for j in range(rows):
        w_hat = np.zeros(cols)
        r = order[j]
        for g in range(groups):
            span = slice(g * group_size, min((g + 1) * group_size, cols))
            codes[r, span], scales[r, g], offsets[r, g] = quantize_group_ref(
                w[j, span].astype(np.float32), bits)
            w_hat[span] = (codes[r, span].astype(np.float32) * scales[r, g] + offsets[r, g])
        err = (w[j] - w_hat) / u[j, j]
        w[j + 1:] -= np.outer(u[j, j + 1:], err)
    return codes, scales, offsets
