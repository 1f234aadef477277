"""Error-compensating quantization (GPTQ / OBQ) into exactly the seed's group-wise format.

Columns (input features) are quantized one at a time, the inputs of the largest mean square
first (GPTQ's act-order, :func:`act_order`). When a column is rounded, its error is pushed onto
the columns not yet quantized through the inverse of the input second-moment matrix
H = X^T X / n taken in that order, so that the layer's output ``W x`` (not the weight) is what
stays close:

    P = act_order(H);  Hinv = inverse(H[P, P] + DAMP * mean(diag H) * I);  U = upper Cholesky
    factor of Hinv;  for each position k, column j = P[k]:  e = (w_j - w_hat_j) / U[k, k];
    w_P[m] -= e * U[k, m]  for m > k

Each group of ``group_size`` consecutive columns gets its bf16 scale and offset when the first
of its columns is reached in that order, from the usual clip search (``quantize_tensor``) on the
group's error-updated weights, weighted by diag(H) (the column mean squares the RTN path uses as
importance): the codes are ordinary asymmetric codes in the format's own groups (no column
index), and the clip statistics keep their meaning. The fast path (``gptq_quantize``) applies
the updates of a block of columns lazily with one matrix product; ``gptq_quantize_ref`` is the
plain statement, column by column in float64 (numpy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

from dynquant.errors import QuantizationError
from dynquant.format.layout import LayerLayout
from dynquant.format.packing import pack_codes, unpack_codes
from dynquant.numerics import native
from dynquant.numerics.float32_sums import add_product
from dynquant.numerics.lapack_threads import lapack_threads
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor

# Of the mean diagonal: keeps H invertible where inputs are (near) collinear, and keeps the
# compensation from fitting the calibration sample. 0.1, not GPTQ's 0.01: held-out KL of the
# sequential pass at 2.5 bits 0.27x vs 0.31x round-to-nearest's on SmolLM2, 0.41x vs 0.53x on
# llama-ref; at 3.25-4.25 bits within +-0.02 (BENCHMARKS.md "Error-compensating codes").
DAMP = 0.1
# Columns whose errors reach the later columns in one product. Each product reads and writes
# every later column's weights, so 256 would move less memory at the same output error; but it
# rounds differently, and the tuned codes that start from GPTQ's follow any such change (one
# moved SmolLM2's KL by 5%): 128 keeps the codes BENCHMARKS.md measured
BLOCK = 128
# Columns a block's error updates reach one by one before a product takes them to the rest of
# the block: numpy's rank-1 update per column moves the block's rows through memory each time
# (on a 49,152-row head, 8 of gptq's 14 s), a product moves them once per sub-block
SUB_BLOCK = 16
RESIDUAL_CHUNK = 1 << 20  # weights a chunk of the residual's rows holds
TRANSPOSE_BAND = 1024  # rows a band of a reordering transpose holds


def inverse_factor(hessian: torch.Tensor, damp: float = DAMP,
                   dtype: torch.dtype = torch.float64,
                   order: torch.Tensor | None = None) -> torch.Tensor:
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 with H = ``hessian``
    taken in ``order`` (default: as it is), in ``dtype`` (float32 falls back to float64 when
    the damped H is too ill-conditioned for it). Columns that no input drives (diag 0) get a
    unit diagonal: their error goes nowhere.

    With J the reversal permutation and J H J = K K^T (lower Cholesky), H^-1 = (J K^-1 J)^T
    (J K^-1 J) and J K^-1 J is upper triangular: one Cholesky and one triangular inverse
    (LAPACK trtri), a third of the work of inverting H and factoring the inverse. The
    reordered, reversed H is one gather in ``dtype``, and the factor is computed in its memory:
    at a 7B model's down projection (18,944 inputs) every copy of H is 1.4 GB more at the
    peak."""
    from scipy.linalg import lapack

    n = hessian.shape[0]
    order = torch.arange(n) if order is None else order
    taken = order.flip(0)
    h = hessian[taken[:, None], taken[None, :]].to(dtype)  # J P H P J
    diagonal = torch.diagonal(h)
    diagonal[diagonal <= 0] = 1.0
    diagonal.add_(damp * float(diagonal.mean(dtype=torch.float64)))
    single = dtype == torch.float32
    potrf, trtri = (lapack.spotrf, lapack.strtri) if single else (lapack.dpotrf, lapack.dtrtri)
    # The symmetric H read in Fortran order is itself, and an upper factor U (U^T U = H) stored
    # in Fortran order is K read in C order: LAPACK factors and inverts in the gather's own
    # memory, which then holds K^-1 (read in C order), and U's reversal of it.
    # on torch's thread count (a job takes the driver's): the factor rounds by thread count
    with lapack_threads(torch.get_num_threads()):
        upper, info = potrf(h.numpy().T, lower=0, overwrite_a=1)
        if info == 0:
            inv_t, info = trtri(upper, lower=0, overwrite_c=1)
    if info == 0 and np.isfinite(inv_t.sum(dtype=np.float64)):
        return torch.from_numpy(_reversed_in_place(inv_t.T))
    if dtype != torch.float64:
        return inverse_factor(hessian, damp, torch.float64, order).to(dtype)
    raise QuantizationError("second moments are not positive definite", field="hessian")


def _reversed_in_place(a: np.ndarray, step: int = 1 << 20) -> np.ndarray:
    """``a[::-1, ::-1]`` of a C-contiguous matrix in its own memory (the flat array reversed,
    a chunk from each end at a time): no second copy of a 1.4 GB factor."""
    flat = a.reshape(-1)
    i, j = 0, flat.size
    while j - i > 1:
        k = min(step, (j - i) // 2)
        head = flat[i:i + k].copy()
        flat[i:i + k] = flat[j - k:j][::-1]
        flat[j - k:j] = head[::-1]
        i, j = i + k, j - k
    return a


def _group_params(block: torch.Tensor, bits: int, group_size: int, importance: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Scale/offset (float32 of the stored bf16) of one group's columns [rows, <= gs], from the
    clip search; and its clip statistics (groups clipped, relative error the search saved)."""
    qt = quantize_tensor(block.to(torch.float32).contiguous(), bits, group_size,
                         importance=importance)
    clipped = round(qt.clipped_fraction * block.shape[0])
    return qt.scales[:, 0].float(), qt.offsets[:, 0].float(), clipped, qt.clip_improvement


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int = 128,
                  damp: float = DAMP, block: int = BLOCK, dtype: torch.dtype = torch.float32,
                  factor: torch.Tensor | None = None) -> QuantizedTensor:
    """``weight`` [out, in] quantized with error feedback through ``hessian`` [in, in].

    Works on the transpose in act order (a column of W is a contiguous row) with numpy inside a
    block, where every step touches one column and torch's per-call and threading overheads
    would dominate; the block's updates to later columns are one matrix product. ``factor``:
    the ``ordered_factor(hessian, damp)`` when the caller has it already (several widths)."""
    return _gptq(weight, hessian, bits, group_size, damp, block, dtype, factor, False)[0]


def gptq_residual(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int = 128,
                  factor: torch.Tensor | None = None
                  ) -> tuple[QuantizedTensor, torch.Tensor]:
    """``gptq_quantize``'s codes (the same bits) and each weight's rounding residual in codes,
    float16 [out, in], clamped to [-1, 1] (a clipped weight's is larger; past one code it
    says nothing more)."""
    qt, residual = _gptq(weight, hessian, bits, group_size, DAMP, BLOCK, torch.float32, factor,
                         True)
    assert residual is not None
    return qt, residual


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, damp: float,
          block: int, dtype: torch.dtype, factor: torch.Tensor | None, keep_residual: bool
          ) -> tuple[QuantizedTensor, torch.Tensor | None]:
    if weight.ndim != 2 or tuple(hessian.shape) != (weight.shape[1],) * 2:
        raise QuantizationError(f"gptq needs a 2-D weight and an [in, in] second-moment matrix, "
                                f"got {list(weight.shape)} and {list(hessian.shape)}",
                                field="hessian")
    # a sum is non-finite where any term is (and sums no copy of a 1.4 GB H into a mask)
    if not bool(torch.isfinite(weight.sum())) or not bool(torch.isfinite(hessian.sum())):
        raise QuantizationError("weight or second moments hold NaN or Inf", field="weight")
    layout = LayerLayout.create(tuple(weight.shape), bits, group_size)
    rows, cols = weight.shape
    importance = torch.diagonal(hessian).to(torch.float32).clamp(min=0)
    order = act_order(hessian)
    u = (ordered_factor(hessian, damp, dtype) if factor is None else factor).to(dtype)
    un = np.ascontiguousarray(u.numpy())
    wt = _ordered_transpose(weight.detach(), order, dtype)  # [in, out], in act order
    w = wt.numpy()
    column = order.numpy()
    position = np.empty(cols, dtype=np.int64)
    position[column] = np.arange(cols)  # a column's place in act order
    codes = np.zeros((layout.padded_in_features, rows), dtype=np.uint8)
    scales = np.zeros((layout.num_groups, rows), dtype=np.float32)
    offsets = np.zeros((layout.num_groups, rows), dtype=np.float32)
    fixed = np.zeros(layout.num_groups, dtype=bool)
    divisors = np.zeros((layout.num_groups, rows), dtype=np.float32)  # 0 scales divide to 0
    max_code = (1 << bits) - 1
    clipped, improvements = 0, []  # clip_improvement: the mean over the column groups
    sweep = _ColumnSweep(w, un, column, group_size, scales, offsets, divisors, codes,
                         max_code, keep_residual)
    for start in range(0, cols, block):
        end = min(start + block, cols)
        errors = np.zeros((end - start, rows), dtype=w.dtype)
        for sub in range(start, end, SUB_BLOCK):
            sub_end = min(sub + SUB_BLOCK, end)
            k = sub
            while k < sub_end:
                g = column[k] // group_size
                if not fixed[g]:  # the group's first column reached: its weights as they are now
                    span = slice(g * group_size, min((g + 1) * group_size, cols))
                    now = _current(w, un, errors, position[span], (start, sub, k, sub_end, end))
                    sc, of, c, improvement = _group_params(torch.from_numpy(now.T), bits,
                                                           group_size, importance[span])
                    scales[g], offsets[g], fixed[g] = sc.numpy(), of.numpy(), True
                    divisors[g] = np.where(sc.numpy() == 0, np.inf, sc.numpy())
                    clipped += c
                    improvements.append(improvement)
                run = k + 1  # the columns from k on whose groups have their scales
                while run < sub_end and fixed[column[run] // group_size]:
                    run += 1
                sweep.run(k, run, sub_end, start, errors)
                k = run
            if sub_end < end:  # the sub-block's errors reach the rest of the block at once
                wt[sub_end:end].addmm_(u[sub:sub_end, sub_end:end].T,
                                       torch.from_numpy(errors[sub - start:sub_end - start]),
                                       alpha=-1)
        if end < cols:  # the block's errors reach every later column in one product
            wt[end:].addmm_(u[start:end, end:].T, torch.from_numpy(errors), alpha=-1)
    qt = QuantizedTensor(
        # torch's transposing copy: numpy's takes 1.8 s on a 49,152 x 3,584 head's codes
        qweight=pack_codes(torch.from_numpy(codes).T.contiguous(), bits),
        scales=torch.from_numpy(scales).T.contiguous().to(torch.bfloat16),
        offsets=torch.from_numpy(offsets).T.contiguous().to(torch.bfloat16),
        logical_shape=layout.logical_shape, bits=bits, group_size=group_size,
        clipped_fraction=clipped / (rows * layout.num_groups),
        clip_improvement=sum(improvements) / len(improvements))
    if not keep_residual:
        return qt, None
    if sweep.residual is not None:  # the native sweep's, in act order
        return qt, _ordered_transpose(torch.from_numpy(sweep.residual).view(torch.float16),
                                      order, torch.float16, inverse=True)
    # each column's weights as it was rounded: no update reaches a column once it is rounded
    at = torch.from_numpy(position)
    return qt, _residual(qt, lambda a, b: wt[:, a:b][at].T)


def _ordered_transpose(weight: torch.Tensor, order: torch.Tensor, dtype: torch.dtype,
                       inverse: bool = False) -> torch.Tensor:
    """``weight.T[order]`` as a new contiguous tensor in ``dtype`` (``inverse``: the ``t`` with
    ``t.T[order] == weight``), a band of rows at a time: torch's gather of the transposed view
    reads the weight a column at a time (a 49,152 x 3,584 head: 3.2 s against 1.2 s)."""
    out = torch.empty(weight.shape[1], weight.shape[0], dtype=dtype)
    if inverse:  # weight's rows gathered in the inverse order, a band of its columns at a time
        at = torch.argsort(order)
        for r in range(0, out.shape[0], TRANSPOSE_BAND):
            out[r:r + TRANSPOSE_BAND].copy_(weight[at, r:r + TRANSPOSE_BAND].T)
        return out
    for r in range(0, weight.shape[0], TRANSPOSE_BAND):
        out[:, r:r + TRANSPOSE_BAND].copy_(weight[r:r + TRANSPOSE_BAND, order].T)
    return out


@dataclass
class _ColumnSweep:
    """GPTQ's rounding of a run of columns of the act-ordered transpose ``w`` [in, out] whose
    groups have their scales: each column rounded, its error (over ``u``'s diagonal) kept in
    ``errors`` (rows from the block's start) and taken off the sub-block's later columns. The
    native kernel where it runs (``native/gptq_columns.c``: the same float32 operations, the
    rows split over the threads), else numpy column by column."""

    w: np.ndarray
    u: np.ndarray
    column: np.ndarray
    group_size: int
    scales: np.ndarray
    offsets: np.ndarray
    divisors: np.ndarray
    codes: np.ndarray
    max_code: int
    keep_residual: bool
    # the kernels (float32 only; None: numpy), and where they run and ``keep_residual``, each
    # weight's rounding residual as they make it: float16 bits [in, out] in act order (None
    # once any run went to numpy: the caller then makes it from the rounded weights)
    lib: ctypes.CDLL | None = field(init=False)
    residual: np.ndarray | None = field(init=False)

    def __post_init__(self) -> None:
        single = self.w.dtype == self.u.dtype == np.float32
        self.lib = native.library() if single else None
        self.residual = (np.empty(self.w.shape, np.uint16)
                         if self.keep_residual and self.lib is not None else None)

    def run(self, k0: int, k1: int, sub_end: int, start: int, errors: np.ndarray) -> None:
        """Columns [k0, k1), errors into ``errors`` (the block's, from column ``start``)."""
        if self.lib is None or self.lib.dq_gptq_columns(
                *(a.ctypes.data for a in (self.w, self.u)), self.w.shape[1], self.w.shape[0],
                k0, k1, sub_end, start, self.column.ctypes.data, self.group_size,
                *(a.ctypes.data for a in (self.scales, self.offsets, self.divisors, self.codes)),
                None if self.residual is None else self.residual.ctypes.data, errors.ctypes.data,
                self.max_code, native.kernel_threads()) != 0:
            self.lib = self.residual = None
            self.run_numpy(k0, k1, sub_end, start, errors)

    def run_numpy(self, k0: int, k1: int, sub_end: int, start: int, errors: np.ndarray
                  ) -> None:
        w, u = self.w, self.u
        for k in range(k0, k1):
            g = self.column[k] // self.group_size
            s, o = self.scales[g], self.offsets[g]
            x = (w[k].astype(np.float32) - o) / self.divisors[g]
            q = np.clip(np.rint(x), 0, self.max_code)
            self.codes[self.column[k]] = q
            err = (w[k] - (q * s + o)) / u[k, k]
            w[k + 1:sub_end] -= u[k, k + 1:sub_end, None] * err[None, :]
            errors[k - start] = err


def _current(w: np.ndarray, un: np.ndarray, errors: np.ndarray, at: np.ndarray,
             steps: tuple[int, int, int, int, int]) -> np.ndarray:
    """Rows ``at`` of the act-ordered transpose as the reference has them at step ``k``, with
    ``steps`` = (start, sub, k, sub_end, end) of the block and sub-block under way: rows past
    the block still lack the updates of its columns before ``k`` (applied at its end), rows
    past the sub-block those of the sub-block's columns before ``k``."""
    start, sub, k, sub_end, end = steps
    now = w[at]  # a gather: a copy
    for pending, first in ((at >= end, start), ((at >= sub_end) & (at < end), sub)):
        if pending.any() and k > first:
            now[pending] -= un[first:k, at[pending]].T @ errors[first - start : k - start]
    return now


def output_error(weight: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float:
    """tr(dW H dW^T) / tr(W H W^T): the relative squared error of the layer's output over the
    calibration inputs (what compensation minimises; with a diagonal H it is the
    importance-weighted relative error of round-to-nearest)."""
    w = weight.detach().to(torch.float32)
    den = float(((w @ hessian.to(torch.float32)) * w).sum(dtype=torch.float64))
    return output_squared_error(weight, qt, hessian) / den if den > 0 else 0.0


def output_squared_error(weight: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor
                         ) -> float:
    """tr(dW H dW^T): ``output_error``'s numerator (a ratio of two codes' errors on the same
    weight needs no more). A bf16 ``hessian`` (a bf16 measure's ratios) is multiplied with dW
    rounded to bf16, summed in float32 (~3x float32's rate where the CPU multiplies bf16)."""
    d = qt.dequantize(torch.float32) - weight.detach().to(torch.float32)
    if hessian.dtype == torch.bfloat16:
        dh = torch.zeros_like(d)
        add_product(dh, d.bfloat16(), hessian)
    else:
        dh = d @ hessian.to(torch.float32)
    return float((dh * d).sum(dtype=torch.float64))


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
    stored bf16); columns by decreasing diagonal of ``hessian`` (ties in their order) in
    float64, every update applied at once, a group's scale/offset from its columns' weights as
    they are when its first column is reached."""
    from dynquant.numerics.reference import quantize_group_ref

    h = np.asarray(hessian, dtype=np.float64)
    order = np.argsort(-np.diag(h), kind="stable")
    position = np.argsort(order)
    w = np.asarray(weight, dtype=np.float64)[:, order].copy()
    rows, cols = w.shape
    u = _inverse_factor_ref(h[np.ix_(order, order)], damp)
    importance = np.clip(np.diag(h), 0, None).astype(np.float32)
    groups = -(-cols // group_size)
    codes = np.zeros((rows, cols), dtype=np.int64)
    scales = np.zeros((rows, groups), dtype=np.float32)
    offsets = np.zeros((rows, groups), dtype=np.float32)
    fixed = np.zeros(groups, dtype=bool)
    max_code = (1 << bits) - 1
    for k in range(cols):
        g = order[k] // group_size
        if not fixed[g]:
            span = slice(g * group_size, min((g + 1) * group_size, cols))
            for r in range(rows):
                _, scales[r, g], offsets[r, g] = quantize_group_ref(
                    w[r, position[span]].astype(np.float32), bits, importance[span])
            fixed[g] = True
        s, o = scales[:, g], offsets[:, g]
        x = (w[:, k].astype(np.float32) - o) / np.where(s == 0, np.inf, s)
        q = np.clip(np.round(x), 0, max_code)
        codes[:, order[k]] = q
        w_hat = (q.astype(np.float32) * s + o).astype(np.float64)
        err = (w[:, k] - w_hat) / u[k, k]
        w[:, k + 1:] -= np.outer(err, u[k, k + 1:])
    return codes, scales, offsets


def act_order(hessian: torch.Tensor) -> torch.Tensor:
    """The order GPTQ takes a weight's inputs in: the largest mean square first (ties in their
    order), so that the inputs that matter most are rounded while the most inputs are left to
    take their error. Both forms use it: a Linear's columns (``gptq_quantize``) and a bank's
    rows (``gptq_quantize_rows``)."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


def ordered_factor(hessian: torch.Tensor, damp: float = DAMP,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse factor both GPTQ forms use: of ``hessian`` in :func:`act_order`."""
    return inverse_factor(hessian, damp, dtype, act_order(hessian))


def gptq_quantize_rows(weight: torch.Tensor, hessian: torch.Tensor, bits: int,
                       group_size: int = 128, damp: float = DAMP,
                       factor: torch.Tensor | None = None) -> QuantizedTensor:
    """``weight`` [in, out], used as ``x @ weight`` (an expert of a bank stored ``[E, in, out]``),
    quantized with error feedback along its *rows*: the format's groups run along the last
    axis, so each row (one input feature) is quantized whole, its groups getting their
    scale/offset from the clip search when the row is reached (free here: a row's groups run
    along it), and its error goes to the rows not yet quantized through the factor of
    ``hessian`` [in, in] (same update as ``gptq_quantize`` on the transpose). Rows are taken in
    ``act_order``; ``factor``: the ``ordered_factor(hessian, damp)`` when the caller has it
    already."""
    return _gptq_rows(weight, hessian, bits, group_size, damp, factor, False)[0]


def gptq_residual_rows(weight: torch.Tensor, hessian: torch.Tensor, bits: int,
                       group_size: int = 128, factor: torch.Tensor | None = None
                       ) -> tuple[QuantizedTensor, torch.Tensor]:
    """``gptq_quantize_rows``'s codes and their rounding residual [in, out] (``gptq_residual``)."""
    qt, residual = _gptq_rows(weight, hessian, bits, group_size, DAMP, factor, True)
    assert residual is not None
    return qt, residual


def _gptq_rows(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
               damp: float, factor: torch.Tensor | None, keep_residual: bool
               ) -> tuple[QuantizedTensor, torch.Tensor | None]:
    rows, cols = weight.shape
    if tuple(hessian.shape) != (rows, rows):
        raise QuantizationError(f"gptq needs an [in, in] second-moment matrix for a weight "
                                f"used as x @ W, got {list(hessian.shape)} for "
                                f"{list(weight.shape)}", field="hessian")
    order = act_order(hessian)
    u = ordered_factor(hessian, damp) if factor is None else factor.float()
    w = weight.detach().to(torch.float32)[order].clone()
    parts: list[QuantizedTensor | None] = [None] * rows
    for j in range(rows):
        qt = quantize_tensor(w[j:j + 1].contiguous(), bits, group_size)
        err = (w[j] - qt.dequantize(torch.float32)[0]) / u[j, j]
        w[j + 1:] -= u[j, j + 1:, None] * err[None, :]
        parts[int(order[j])] = qt
    qt = concat_rows(parts, (rows, cols))
    # each row as it was rounded: no update reaches a row once it is rounded
    at = torch.argsort(order)
    return qt, (_residual(qt, lambda a, b: w[at[a:b]]) if keep_residual else None)


def _residual(qt: QuantizedTensor, rounded_rows: Callable[[int, int], torch.Tensor]
              ) -> torch.Tensor:
    """``(rounded - offset) / scale - code`` [rows, in_features] in float16, clamped to [-1, 1]
    (0 in a group of scale 0, whose weights are all its offset), given ``rounded_rows(a, b)``:
    rows a..b of the values the codes were rounded from. A chunk of rows at a time: whole,
    its float32 temporaries would be ~20 bytes a weight (a 7B down projection: 1.4 GB)."""
    lay = qt.layout
    out = torch.empty(lay.num_rows, lay.in_features, dtype=torch.float16)
    step = max(1, RESIDUAL_CHUNK // (lay.num_groups * lay.group_size))
    for a in range(0, lay.num_rows, step):
        b = min(a + step, lay.num_rows)
        out[a:b] = _residual_chunk(qt, a, b, rounded_rows(a, b))
    return out


def _residual_chunk(qt: QuantizedTensor, a: int, b: int, rounded: torch.Tensor
                    ) -> torch.Tensor:
    lay = qt.layout
    shape = (b - a, lay.num_groups, lay.group_size)
    codes = unpack_codes(qt.qweight[a:b], lay.bits).view(shape).float()
    pad = lay.num_groups * lay.group_size - lay.in_features
    x = F.pad(rounded.float().reshape(b - a, -1), (0, pad)).view(shape)
    s, o = qt.scales[a:b].float()[..., None], qt.offsets[a:b].float()[..., None]
    r = torch.where(s == 0, 0.0, (x - o) / s - codes).clamp_(-1, 1).to(torch.float16)
    # a residual a hair under 0.5 is 0.5 in float16, which rounds away from the code half the
    # time: one step towards 0 keeps every code where it is until it is tuned
    off = torch.round(codes + r.float()).clamp_(0, (1 << lay.bits) - 1) != codes
    r[off] = torch.nextafter(r[off], torch.zeros((), dtype=r.dtype))
    return r.reshape(b - a, -1)[:, : lay.in_features]


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


def float_target_shift(weights: dict[str, torch.Tensor], moments: torch.Tensor,
                       factor: torch.Tensor, shifts: dict[str, torch.Tensor], fraction: float
                       ) -> dict[str, torch.Tensor]:
    """GPTAQ's weights: GPTQ on ``W + fraction * S H^-1`` (H: ``moments`` X^T X / tokens damped
    as GPTQ damps it; S: ``shifts``' ((X_float - X) W^T)^T X / tokens) minimises
    ``|X Q^T - X_float W^T|^2`` at ``fraction`` 1, the codes on the quantized model's inputs
    ``X`` fitted to the float model's outputs (its own inputs ``X_float``): the unconstrained
    optimum of that is the shifted W, and the error of any Q differs from ``|X (Q - W')^T|^2``
    by a constant. H^-1 from GPTQ's own ``factor`` (``ordered_factor(moments)``: U^T U is H^-1
    in act order), so no second factor of H is held (1.4 GB at 18,944 inputs)."""
    order = act_order(moments)
    shifted = {}
    for m, w in weights.items():
        taken = times_upper(times_upper(shifts[m][:, order], factor, transposed=True), factor)
        solved = torch.empty_like(taken)
        solved[:, order] = taken
        shifted[m] = w.add(solved, alpha=fraction)
    return shifted


def times_upper(x: torch.Tensor, upper: torch.Tensor, transposed: bool = False,
                 block: int = 1024) -> torch.Tensor:
    """``x @ upper`` (or ``x @ upper.T``) for an upper triangular ``upper``, a block of its
    columns (rows) at a time with only the blocks that are not zero: half a full product."""
    n = upper.shape[0]
    out = torch.empty(x.shape[0], n)
    for j in range(0, n, block):
        e = min(j + block, n)
        out[:, j:e] = x[:, j:] @ upper[j:e, j:].T if transposed else x[:, :e] @ upper[:e, j:e]
    return out
