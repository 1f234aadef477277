"""``y = x @ W^T`` and ``y = x @ W`` straight from a packed weight: a few tokens (decode), many
tokens (prefill: the packed GEMMs), and a few (token, expert) pairs of an expert bank.

``packed_matvec`` contracts over the axis the groups run along (a Linear, ``F.linear(x, W)``);
``packed_vecmat`` over the other one (an expert bank used as ``x @ W[e]``). The native kernels
(``native/packed_matvec.c``, ``native/packed_vecmat.c``) read the packed codes and never
materialise W: a step of decode reads ``bits/16`` of the bytes a bf16 matrix would. They
accumulate in float32, closer to the exact product than dequantizing to bf16 first. The ``*_ref``
functions are the plain definitions the kernels are held to. Beyond ``MAX_TOKENS`` tokens
(prefill) the packed GEMMs (``native/packed_gemm.c``) take over.

``packed_matvec_q8`` is the one-token product with int8 activations (``native/packed_matvec_q8.c``):
the token quantized in blocks of ``Q8_BLOCK`` and multiplied with the codes as integers; its
result is defined operation by operation by :func:`packed_matvec_q8_ref`, which every build
matches bit for bit.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dynquant.format.layout import LayerLayout
from dynquant.format.packing import unpack_codes
from dynquant.numerics import native
from dynquant.numerics.native.interface import (
    PAIRS_MATVEC,
    PAIRS_MATVEC_Q8,
    PAIRS_MATVEC_Q16,
    PAIRS_VECMAT,
    ExpertPairsBlock,
    PackedBlock,
)
from dynquant.numerics.quantizer import dequantize_rows

MAX_TOKENS = 8
# Below this many weights a decode product runs on one thread. The decode kernels split their
# work with native/pool.c, whose hand-off takes ~1 us while its worker spins, but tens of µs to
# wake it once it sleeps (after 20 us idle), which is how a decode step finds it: its products
# are separated by norms and attention. With a pause before each call two threads win only from
# about 1 M weights (back to back, from 64 K): `benchmarks/packed_products.py`, "hand-off".
PARALLEL_MIN_ELEMENTS = 1 << 20
VECMAT_PARALLEL_MIN_ELEMENTS = 1 << 20
# The packed GEMMs split their work across threads (native/pool.c) from this many multiply-adds
# (tokens x weights).
GEMM_PARALLEL_MIN_MACS = 1 << 23
# in_features the GEMM multiplies unpadded when a multiple of it: every build's vector width
# (packed_gemm.c's VW: 16 floats with AVX-512, 8 with AVX2, 4 portable) divides it
GEMM_UNPADDED_MULTIPLE = 16
# int8 activations: one float scale per block of this many inputs (llama.cpp's Q8 block).
Q8_BLOCK = 32
# Blocks whose largest |x| is below this quantize to zeros (127 / amax would overflow).
Q8_TINY = 1e-30


def packed_matvec_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      offsets: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """float32 [m, rows]: ``x`` [m, in_features] times the dequantized float32 rows."""
    w = dequantize_rows(qweight, scales, offsets, layout.bits, layout.group_size,
                        layout.in_features, torch.float32)
    return x.to(torch.float32) @ w.T


def packed_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                  ) -> torch.Tensor | None:
    """float32 [m, rows] from the native kernel, or None when it is unavailable.

    ``x`` [m, in_features]; ``qweight``/``scales``/``offsets`` are any block of the layout's rows.
    ``portable`` forces the kernel's portable path (to hold the SIMD path to it).
    """
    lib = native.library()
    if lib is None:
        return None
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, True)
    rows = qweight.shape[0]
    y = torch.empty(xf.shape[0], rows)

    threads = native.threads_for(rows * layout.padded_in_features, PARALLEL_MIN_ELEMENTS)
    args = (qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), rows,
            layout.padded_in_features, layout.group_size, layout.bits, xf.data_ptr(),
            xf.shape[0], y.data_ptr(), rows)
    # 2-8 tokens: the few-token kernels' own entry (-2: none for this build or group size)
    rc = -2 if portable or xf.shape[0] == 1 else lib.dq_matvec_tokens_mt(*args, threads)
    if rc == -2:
        rc = lib.dq_matvec_mt(*args, int(portable), threads)
    if rc:
        raise RuntimeError("dq_matvec failed (out of memory or unsupported group size)")
    return y


def packed_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                ) -> torch.Tensor | None:
    """float32 [m, rows] = ``x`` [m, in_features] @ W^T for any number of tokens (prefill), from
    the native GEMM (``native/packed_gemm.c``: a panel of rows dequantized into a per-thread
    float32 buffer, then register tiles with fused multiply-adds), rows split across threads;
    None when the kernels are unavailable. Equal to :func:`packed_matvec_ref` up to float32
    rounding (another summation order)."""
    lib = native.library()
    if lib is None:
        return None
    # the padding's columns are neither copied nor multiplied where the kernel's vectors fit
    # the unpadded width
    pad = layout.in_features % GEMM_UNPADDED_MULTIPLE != 0
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, True, pad=pad)
    rows = qweight.shape[0]
    y = torch.empty(xf.shape[0], rows)

    work = rows * xf.shape[1] * xf.shape[0]
    if lib.dq_gemm_mt(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), rows,
                      layout.padded_in_features, layout.group_size, layout.bits, xf.data_ptr(),
                      xf.shape[1], xf.shape[0], y.data_ptr(), rows, int(portable),
                      native.threads_for(work, GEMM_PARALLEL_MIN_MACS)):
        raise RuntimeError("dq_gemm failed (out of memory or unsupported group size)")
    return y


# int8 and int16 activations: the largest level, and the integer dtype
LEVELS = {torch.int8: 127.0, torch.int16: 32767.0}


def quantize_activations_ref(x: torch.Tensor, dtype: torch.dtype = torch.int8,
                             block: int = Q8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 (or int16) [n] and float32 [n / block] for a float32 vector x [n] (n a multiple of
    block): per block, ``d = amax / L`` and ``xq = round(x * (L / amax))`` (ties to even), in
    float32, L = 127 (32767); what ``dq_q8_quantize`` (blocks of Q8_BLOCK) and
    ``dq_q16_quantize`` (blocks of a layout's group size) compute."""
    levels = LEVELS[dtype]
    blocks = x.to(torch.float32).reshape(-1, block)
    amax = blocks.abs().amax(dim=1)
    live = amax >= Q8_TINY
    zero = torch.zeros_like(amax)
    inv = torch.where(live, levels / torch.where(live, amax, 1.0), zero)
    d = torch.where(live, amax / levels, zero)
    return torch.round(blocks * inv[:, None]).to(dtype).reshape(-1), d


def quantize_activations(x: torch.Tensor, dtype: torch.dtype = torch.int8,
                         block: int = Q8_BLOCK) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`quantize_activations_ref` by the native kernel (None without it; int8 takes blocks
    of Q8_BLOCK only)."""
    lib = native.library()
    if lib is None:
        return None
    if dtype == torch.int8 and block != Q8_BLOCK:
        raise ValueError(f"int8 activations are quantized in blocks of {Q8_BLOCK}")
    xf = x.to(torch.float32).contiguous()
    xq = torch.empty(xf.numel(), dtype=dtype)
    d = torch.empty(xf.numel() // block)
    if dtype == torch.int16:
        lib.dq_q16_quantize(xf.data_ptr(), xf.numel(), block, xq.data_ptr(), d.data_ptr())
    else:
        lib.dq_q8_quantize(xf.data_ptr(), xf.numel(), xq.data_ptr(), d.data_ptr())
    return xq, d


def _padded_token(x: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    xf = x.to(torch.float32).reshape(-1)
    return F.pad(xf, (0, layout.padded_in_features - layout.in_features))


def group_dots_ref(xq: torch.Tensor, qweight: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """int64 [rows, groups]: each group's codes . xq, exactly."""
    codes = unpack_codes(qweight, layout.bits).to(torch.int64)
    rows = codes.shape[0]
    return (codes * xq.to(torch.int64)).view(rows, -1, layout.group_size).sum(-1)


def group_dots(xq: torch.Tensor, qweight: torch.Tensor, layout: LayerLayout,
               portable: bool = False) -> torch.Tensor | None:
    """int32 [rows, groups] from the kernel's own integer dot products, for an int8 or int16
    token (None without the kernels)."""
    lib = native.library()
    if lib is None:
        return None
    q = qweight.contiguous()
    out = torch.empty(q.shape[0], layout.padded_in_features // layout.group_size,
                      dtype=torch.int32)
    kernel = lib.dq_q16_group_dots if xq.dtype == torch.int16 else lib.dq_q8_group_dots
    if kernel(q.data_ptr(), q.shape[0], layout.padded_in_features, layout.group_size,
              layout.bits, xq.contiguous().data_ptr(), out.data_ptr(), int(portable)):
        raise RuntimeError("dq_q8_group_dots: unsupported width or group size")
    return out


def q8_order(bits: int) -> torch.Tensor:
    """Which code of a block of 32 sits at each position of the width's lane order (the
    header of ``native/packed_matvec_q8.c``): position p feeds lane p // 4."""
    p = torch.arange(Q8_BLOCK)
    if bits == 4:
        return torch.where(p < 16, 2 * p, 2 * (p - 16) + 1)
    if bits == 2:
        return 4 * (p % 8) + p // 8
    if bits == 8:
        return p
    lane = p % 8  # 3, 5, 6 bits: the 16-bit lanes of unpack32_words packed to bytes
    return 16 * (p // 16) + 4 * ((p % 16) // 8) + lane // 2 + 8 * (lane % 2)


def q8_pairs(bits: int, group_size: int) -> bool:
    """Whether the int8 product takes a width's blocks in pairs (4 bits, groups of an even number
    of blocks: the header of ``native/packed_matvec_q8.c``): lane l of a pair sums its codes
    8l .. 8l+7, in natural order."""
    return bits == 4 and group_size % (2 * Q8_BLOCK) == 0


def q16_order(bits: int) -> torch.Tensor:
    """The int16 products' order of a block's codes (``q16_code`` in
    ``native/packed_matvec_q8.c``): position p is 16-bit lane i = p % 16 of unpacked register
    r = p // 16."""
    p = torch.arange(Q8_BLOCK)
    r, i = p // 16, p % 16
    if bits == 2:
        return 4 * (2 * (i % 4) + r) + i // 4
    if bits == 4:
        return 2 * (2 * (i % 8) + r) + i // 8
    return 16 * (i // 8) + 4 * r + (i % 8) // 2 + 8 * (i % 2)


# Which positions of a block each of the 8 integer lanes sums: int8 4l .. 4l+3; int16 2l, 2l+1,
# 16+2l, 17+2l.
LANE_POSITIONS = {
    torch.int8: torch.arange(Q8_BLOCK).view(8, 4),
    torch.int16: torch.stack([torch.arange(0, 16, 2), torch.arange(1, 16, 2),
                              torch.arange(16, 32, 2), torch.arange(17, 32, 2)], dim=1),
}


def packed_matvec_q8_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         offsets: torch.Tensor, layout: LayerLayout,
                         dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """float32 [rows]: one token x [in_features] times the packed rows with int8 (``dtype``
    int16: int16) activations, operation by operation as ``native/packed_matvec_q8.c`` defines
    it (its header, and its int16 section)."""
    xf = _padded_token(x, layout)
    rows, gs = qweight.shape[0], layout.group_size
    groups, blocks = layout.padded_in_features // gs, gs // Q8_BLOCK
    int16 = dtype == torch.int16
    xq, d = quantize_activations_ref(xf, dtype, gs if int16 else Q8_BLOCK)
    pairs = not int16 and q8_pairs(layout.bits, gs)
    unit = 2 * Q8_BLOCK if pairs else Q8_BLOCK  # the blocks, or pairs of them, that fill 8 lanes
    codes = unpack_codes(qweight, layout.bits).to(torch.int32).view(rows, -1, unit)
    xu = xq.to(torch.int32).view(-1, unit)
    if pairs:
        lanes = (codes * xu).view(rows, -1, 8, 8).sum(-1)
        steps = d.view(-1, 2).repeat_interleave(4, dim=1)  # each lane's block's d
    else:
        order = q16_order(layout.bits) if int16 else q8_order(layout.bits)
        lanes = (codes[:, :, order] * xu[:, order])[:, :, LANE_POSITIONS[dtype]].sum(-1)
        steps = d[:, None].expand(-1, 8)
    units = gs // unit
    lanes = lanes.view(rows, groups, units, 8)
    if int16:
        return _q16_epilogue(lanes.sum(2), xq, d, scales, offsets, gs)
    lanes = lanes.to(torch.float32)
    block_sums = d * xq.to(torch.int32).view(-1, Q8_BLOCK).sum(-1).to(torch.float32)
    xsum = torch.zeros(groups)
    for b in range(blocks):  # the offsets multiply the quantized token too
        xsum = xsum + block_sums.view(groups, blocks)[:, b]
    acc, o_sum = torch.zeros(rows, 8), torch.zeros(rows)
    for g in range(groups):
        gacc = torch.zeros(rows, 8)
        for b in range(units):
            gacc = gacc + steps[g * units + b] * lanes[:, g, b]
        acc = acc + scales[:, g].float()[:, None] * gacc
        o_sum = o_sum + offsets[:, g].float() * xsum[g]
    return _sum8(acc) + o_sum


def _q16_epilogue(lanes: torch.Tensor, xq: torch.Tensor, d: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor, gs: int) -> torch.Tensor:
    """The int16 product's float part from each group's integer lanes [rows, groups, 8] (exact
    sums over its blocks) and the token quantized per group (xq, d [groups]): each group's dot
    (its lanes' exact sum) in float lane g % 8, eight groups at a time, the terms past the last
    group +0."""
    rows, groups = lanes.shape[:2]
    xsum = d * xq.to(torch.int32).view(-1, gs).sum(-1).to(torch.float32)
    pad = -groups % 8
    dots = F.pad(lanes.sum(-1), (0, pad)).to(torch.float32)
    d, xsum = F.pad(d, (0, pad)), F.pad(xsum, (0, pad))
    scales, offsets = F.pad(scales.float(), (0, pad)), F.pad(offsets.float(), (0, pad))
    acc, off = torch.zeros(rows, 8), torch.zeros(rows, 8)
    for g in range(0, groups + pad, 8):
        at = slice(g, g + 8)
        acc = acc + (d[at] * scales[:, at]) * dots[:, at]
        off = off + offsets[:, at] * xsum[at]
    return _sum8(acc) + _sum8(off)


def _sum8(a: torch.Tensor) -> torch.Tensor:
    """((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) of each row of [rows, 8]."""
    s4 = a[:, :4] + a[:, 4:]
    return (s4[:, 0] + s4[:, 2]) + (s4[:, 1] + s4[:, 3])


def packed_matvec_q16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                      ) -> torch.Tensor | None:
    """:func:`packed_matvec_q8` with int16 activations (widths 2-6)."""
    return packed_matvec_q8(x, qweight, scales, offsets, layout, portable, torch.int16)


def packed_matvec_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     offsets: torch.Tensor, layout: LayerLayout, portable: bool = False,
                     dtype: torch.dtype = torch.int8) -> torch.Tensor | None:
    """float32 [m, rows] for x [m, in_features]: row t is :func:`packed_matvec_q8_ref` of token t
    (each token quantized on its own to ``dtype``), by the native kernel; None without it."""
    lib = native.library()
    if lib is None:
        return None
    xf, q, s, o = _inputs(x, qweight, scales, offsets, layout, True)
    rows = q.shape[0]
    y = torch.empty(xf.shape[0], rows)
    threads = native.threads_for(rows * layout.padded_in_features, PARALLEL_MIN_ELEMENTS)
    kernel = lib.dq_matvec_q16_mt if dtype == torch.int16 else lib.dq_matvec_q8_mt
    if kernel(q.data_ptr(), s.data_ptr(), o.data_ptr(), rows, layout.padded_in_features,
              layout.group_size, layout.bits, xf.data_ptr(), xf.shape[0], y.data_ptr(), rows,
              int(portable), threads):
        raise RuntimeError("dq_matvec_q8 failed (out of memory or unsupported layout)")
    return y


Q8_PATHS = {2: "vnni", 1: "avx2", 0: "portable"}


def q8_path() -> str | None:
    """How the int8 products are computed: ``vnni``, ``avx2`` or ``portable`` (None: no kernels)."""
    lib = native.library()
    return None if lib is None else Q8_PATHS[lib.dq_q8_simd()]


class OneTokenMatvec:
    """``packed_matvec`` of one float32 token with the per-call work done once: the block's
    checks, pointers, arguments and thread count are fixed when it is made, in one descriptor
    the kernel reads (``dq_packed_block``; ``dq_matvec_one``: three converted arguments per
    call, not thirteen); it keeps the tensors alive, and callers rebuild it when a buffer is
    replaced. A decode step calls it once per Linear; on small matrices (256 x 256) the
    general call's checks and conversions cost more than the product. Same kernel, same bits;
    x need not be padded (the kernel pads a copy where the layout does)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 layout: LayerLayout, int8: bool = False, int16: bool = False) -> None:
        native.check_packed_block(qweight, scales, offsets, layout.bits, layout.group_size,
                                  layout.in_features)
        # int8 activations (dq_matvec_q8_one), int16 (dq_matvec_q16_one), else float32
        self.int8, self.int16 = int8, int16 and not int8
        if not (qweight.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
            raise ValueError("OneTokenMatvec needs contiguous tensors")
        self.rows, self.n, self.layout = qweight.shape[0], layout.in_features, layout
        self.tensors = (qweight, scales, offsets)  # kept alive while their pointers are used
        threads = native.threads_for(self.rows * self.n, PARALLEL_MIN_ELEMENTS)
        self.block = PackedBlock(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                                 self.rows, layout.padded_in_features, layout.group_size,
                                 self.n, layout.bits, threads)

    def __deepcopy__(self, memo: dict) -> OneTokenMatvec:
        """A copy over the copied tensors (a descriptor's addresses are not copied)."""
        q, s, o = (copy.deepcopy(t, memo) for t in self.tensors)
        twin = OneTokenMatvec(q, s, o, self.layout, self.int8, self.int16)
        twin.threads = self.threads
        return twin

    @property
    def threads(self) -> int:
        return self.block.threads

    @threads.setter
    def threads(self, value: int) -> None:
        self.block.threads = value

    def __call__(self, lib, x: torch.Tensor, shape: tuple[int, ...] | None = None
                 ) -> torch.Tensor:
        """float32 ``shape`` (default [1, rows]; its last axis: rows) for a contiguous float32 x
        of ``in_features`` values."""
        y = torch.empty(shape or (1, self.rows))
        kernel = (lib.dq_matvec_q8_one if self.int8 else
                  lib.dq_matvec_q16_one if self.int16 else lib.dq_matvec_one)
        if kernel(self.block, x.data_ptr(), y.data_ptr()):
            raise RuntimeError("dq_matvec failed (out of memory)")
        return y


def _inputs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
            layout: LayerLayout, along_groups: bool, block_rows: int | None = None,
            pad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, contiguous inputs of a product: x as float32, with zeros in the layout's padding
    when the product contracts along the groups (``along_groups``; else along the rows) unless
    ``pad`` is False (a kernel that multiplies the unpadded columns only).
    ``block_rows``: x multiplies blocks of that many rows (the experts of a bank), the first of
    which is checked."""
    block = (qweight, scales, offsets) if block_rows is None else (
        qweight[:block_rows], scales[:block_rows], offsets[:block_rows])
    contracted = layout.in_features if along_groups else block[0].shape[0]
    _check(x, *block, layout, contracted)
    xf = x.to(torch.float32)
    padding = layout.padded_in_features - layout.in_features
    if along_groups and pad and padding:
        xf = F.pad(xf, (0, padding))
    return xf.contiguous(), qweight.contiguous(), scales.contiguous(), offsets.contiguous()


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
           layout: LayerLayout, contracted: int) -> None:
    native.check_packed_block(qweight, scales, offsets, layout.bits, layout.group_size,
                              layout.in_features)
    if x.ndim != 2 or x.shape[1] != contracted or not x.is_floating_point():
        raise ValueError(f"x must be a float [tokens, {contracted}] matrix, got "
                         f"{x.dtype} {list(x.shape)}")


def packed_vecmat_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      offsets: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """float32 [m, in_features]: ``x`` [m, rows] times the dequantized float32 rows."""
    w = dequantize_rows(qweight, scales, offsets, layout.bits, layout.group_size,
                        layout.in_features, torch.float32)
    return x.to(torch.float32) @ w


def packed_vecmat(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                  ) -> torch.Tensor | None:
    """float32 [m, in_features] = ``x`` [m, rows] @ W for a block of the layout's rows, from the
    native kernel (groups split across threads); None when it is unavailable."""
    lib = native.library()
    if lib is None:
        return None
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, False)
    rows, n = qweight.shape[0], layout.padded_in_features
    y = torch.empty(xf.shape[0], n)

    threads = native.threads_for(rows * n, VECMAT_PARALLEL_MIN_ELEMENTS)
    if lib.dq_vecmat_mt(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), rows, n,
                        layout.group_size, layout.bits, xf.data_ptr(), xf.shape[0], y.data_ptr(),
                        int(portable), threads):
        raise RuntimeError("dq_vecmat failed (unsupported group size)")
    return y[:, : layout.in_features]


def packed_gemm_t(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor, layout: LayerLayout, portable: bool = False
                  ) -> torch.Tensor | None:
    """float32 [m, in_features] = ``x`` [m, rows] @ W for any number of tokens, W a block of rows
    stored in groups along the output dimension (expert banks used as ``x @ W[e]``): a group's
    columns of every row dequantized into a per-thread panel, then the GEMM's register tiles;
    groups split across threads. None without the kernels. Equal to :func:`packed_vecmat_ref` up
    to float32 rounding."""
    lib = native.library()
    if lib is None:
        return None
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, False)
    rows, n = qweight.shape[0], layout.padded_in_features
    y = torch.empty(xf.shape[0], n)

    if lib.dq_gemm_t_mt(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), rows, n,
                        layout.group_size, layout.bits, xf.data_ptr(), xf.shape[0], y.data_ptr(),
                        int(portable),
                        native.threads_for(rows * n * xf.shape[0], GEMM_PARALLEL_MIN_MACS)):
        raise RuntimeError("dq_gemm_t failed (out of memory or unsupported group size)")
    return y[:, : layout.in_features]


def _expert_rows(layout: LayerLayout) -> int:
    return layout.num_rows // layout.logical_shape[0]


def _check_experts(experts: torch.Tensor, x: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    if experts.ndim != 1 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"one expert per row of x: experts {list(experts.shape)}, "
                         f"x {list(x.shape)}")
    ids = experts.to(torch.int64).contiguous()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < layout.logical_shape[0]):
        raise ValueError(f"expert index out of range [0, {layout.logical_shape[0]})")
    return ids


def packed_matvec_experts(x: torch.Tensor, experts: torch.Tensor, qweight: torch.Tensor,
                          scales: torch.Tensor, offsets: torch.Tensor, layout: LayerLayout
                          ) -> torch.Tensor | None:
    """float32 [pairs, R]: row p is ``F.linear(x[p], W[experts[p]])`` for a bank ``W`` [E, R, N]
    (groups along N), all pairs in one native call (rows split across threads); each row is
    bit-identical to :func:`packed_matvec` of that expert alone. None without the kernels."""
    lib = native.library()
    if lib is None:
        return None
    per = _expert_rows(layout)
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, True, per)
    ids = _check_experts(experts, x, layout)
    y = torch.empty(xf.shape[0], per)

    work = xf.shape[0] * per * layout.padded_in_features
    if lib.dq_matvec_experts_mt(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), per,
                                layout.padded_in_features, layout.group_size, layout.bits,
                                ids.data_ptr(), xf.shape[0], xf.data_ptr(), y.data_ptr(), 0,
                                native.threads_for(work, PARALLEL_MIN_ELEMENTS)):
        raise RuntimeError("dq_matvec_experts failed (out of memory or unsupported group size)")
    return y


def packed_vecmat_experts(x: torch.Tensor, experts: torch.Tensor, qweight: torch.Tensor,
                          scales: torch.Tensor, offsets: torch.Tensor, layout: LayerLayout
                          ) -> torch.Tensor | None:
    """float32 [pairs, N]: row p is ``x[p] @ W[experts[p]]`` for a bank ``W`` [E, R, N] (groups
    along N, used as ``x @ W[e]``), all pairs in one native call (groups split across threads);
    each row bit-identical to :func:`packed_vecmat` of that expert alone. None without the
    kernels."""
    lib = native.library()
    if lib is None:
        return None
    per = _expert_rows(layout)
    xf, qweight, scales, offsets = _inputs(x, qweight, scales, offsets, layout, False, per)
    ids = _check_experts(experts, x, layout)
    n = layout.padded_in_features
    y = torch.empty(xf.shape[0], n)

    work = xf.shape[0] * per * n
    if lib.dq_vecmat_experts_mt(qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr(), per, n,
                                layout.group_size, layout.bits, ids.data_ptr(), xf.shape[0],
                                xf.data_ptr(), y.data_ptr(), 0,
                                native.threads_for(work, VECMAT_PARALLEL_MIN_ELEMENTS)):
        raise RuntimeError("dq_vecmat_experts failed (unsupported group size)")
    return y[:, : layout.in_features]


class ExpertPairs:
    """``packed_matvec_experts`` (``F.linear(x[p], W[e_p])``, ``along_groups``) or
    ``packed_vecmat_experts`` (``x[p] @ W[e_p]``) of one bank with the per-call work done once,
    as ``OneTokenMatvec`` does for a Linear: the bank's checks, pointers and thread rule fixed
    in one descriptor (``dq_expert_pairs``; ``dq_experts_one`` checks the expert indices itself
    and pads a copy of x where the layout pads the inputs). A decode step calls it once per bank. Same
    kernels, same bits; ``int8`` (``along_groups`` only): the int8-activation products, each pair
    equal to :func:`packed_matvec_q8` of its expert; ``int16`` the same with int16 activations
    (:func:`packed_matvec_q16`, widths 2-6)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 layout: LayerLayout, along_groups: bool, int8: bool = False,
                 int16: bool = False) -> None:
        per = _expert_rows(layout)
        native.check_packed_block(qweight[:per], scales[:per], offsets[:per], layout.bits,
                                  layout.group_size, layout.in_features)
        if not (qweight.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
            raise ValueError("ExpertPairs needs contiguous tensors")
        n = layout.padded_in_features
        self.contracted, self.width = (layout.in_features, per) if along_groups else (per, n)
        self.keep = None if along_groups or n == layout.in_features else layout.in_features
        self.tensors = (qweight, scales, offsets)  # kept alive while their pointers are used
        self.made_with = (layout, along_groups, int8, int16)
        least = PARALLEL_MIN_ELEMENTS if along_groups else VECMAT_PARALLEL_MIN_ELEMENTS
        kind = (PAIRS_MATVEC_Q8 if int8 else PAIRS_MATVEC_Q16 if int16 else PAIRS_MATVEC
                ) if along_groups else PAIRS_VECMAT
        self.block = ExpertPairsBlock(
            qweight=qweight.data_ptr(), scales=scales.data_ptr(), offsets=offsets.data_ptr(),
            rows_per_expert=per, padded_n=n, gs=layout.group_size,
            in_features=layout.in_features, experts=layout.logical_shape[0], min_work=least,
            bits=layout.bits, kind=kind, threads=native.kernel_threads())

    def __deepcopy__(self, memo: dict) -> ExpertPairs:
        """A copy over the copied tensors (a descriptor's addresses are not copied)."""
        q, s, o = (copy.deepcopy(t, memo) for t in self.tensors)
        twin = ExpertPairs(q, s, o, *self.made_with)
        twin.block.min_work = self.block.min_work
        return twin

    def __call__(self, lib, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """float32 [pairs, width] for a contiguous float32 x [pairs, contracted] and int64
        expert indices [pairs]."""
        if x.ndim != 2 or x.shape[1] != self.contracted or experts.shape != (x.shape[0],):
            raise ValueError(f"x must be [pairs, {self.contracted}] with one expert per row, got "
                             f"x {list(x.shape)}, experts {list(experts.shape)}")
        ids = experts.to(torch.int64).contiguous()
        y = torch.empty(x.shape[0], self.width)
        rc = lib.dq_experts_one(self.block, ids.data_ptr(), x.shape[0], x.data_ptr(),
                                y.data_ptr())
        if rc == -2:
            raise ValueError(f"expert index out of range [0, {self.block.experts})")
        if rc:
            raise RuntimeError("expert products failed (out of memory)")
        return y if self.keep is None else y[:, :self.keep]


SIMD_PATHS = {2: "avx512vbmi", 1: "avx2", 0: "portable"}


def simd_path() -> str | None:
    """How the kernels unpack codes: ``avx512vbmi``, ``avx2`` or ``portable`` (None: no kernels)."""
    lib = native.library()
    return None if lib is None else SIMD_PATHS[lib.dq_matvec_has_simd()]


__all__ = [
    "MAX_TOKENS",
    "ExpertPairs",
    "OneTokenMatvec",
    "packed_gemm",
    "packed_gemm_t",
    "packed_matvec",
    "packed_matvec_experts",
    "packed_matvec_q8",
    "packed_matvec_q8_ref",
    "packed_matvec_q16",
    "packed_matvec_ref",
    "packed_vecmat",
    "packed_vecmat_experts",
    "packed_vecmat_ref",
    "q8_path",
    "quantize_activations",
    "quantize_activations_ref",
    "simd_path",
]
