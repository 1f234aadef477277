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
was a near tie flips where the caller's error says so (BENCHMARKS.md "Tuned scales"). Each
step is clipped to its size, so only the weights within the steps' sum of a tie can flip, and
only those carry a ``u``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from dynquant.format.packing import pack_codes, unpack_codes
from dynquant.numerics import native
from dynquant.numerics.quantizer import QuantizedTensor, dequantize_rows


def _straight(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` in the forward pass (exactly: x - x is 0), the identity's gradient in the
    backward."""
    return rounded.detach() + (x - x.detach())


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return _straight(x, x.detach().to(torch.bfloat16).float())


CHUNK_ELEMENTS = 1 << 20  # codes a chunk of rows holds: its float temporaries stay in cache
GROUP_LANES = 16  # the group sums' lanes (group_sums_torch)


class _GroupDequantize(torch.autograd.Function):
    """``tunable``'s codes with scales ``s`` and offsets ``o`` (bf16 values in float32) as the
    format dequantizes them (``dequantize_rows``: [rows, in_features] float32, the native kernel
    where it runs), and the gradients in ``s`` and ``o`` (``group_gradients``). What is kept
    for the backward of codes read from a file is their packed form (``bits / 8`` bytes a
    weight, dropped and read again where the caller checkpoints), summed from as they are
    (``packed_group_gradients``)."""

    @staticmethod
    def forward(ctx, tunable: TunableScales, s: torch.Tensor, o: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        packed = tunable.packed()
        ctx.save_for_backward(packed)
        ctx.tunable = tunable
        w = tunable.dequantize(packed, s, o)
        return w if dtype == torch.float32 else w.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor, None]:
        (packed,) = ctx.saved_tensors
        return None, *ctx.tunable.group_gradients(grad, packed), None


def group_gradients(grad: torch.Tensor, q: torch.Tensor,
                    rounding: RoundingOffsets | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients in the scales and offsets [rows, groups] of codes ``q`` [rows, groups,
    group_size] given the dequantized weight's ``grad`` [rows, in_features]: the group sums of
    the gradient times the codes, and of the gradient (``group_sums``); then ``rounding``'s step
    on each chunk's gradient (after its codes' sums: the codes the forward used). A chunk of rows
    at a time: the torch path's temporaries (a float copy of the codes, the product) stay a
    chunk's, not the block's."""
    grad, grad_s, grad_o = _grouped(grad, q.shape)
    # the native kernels read a bf16 gradient as it is (the same values: widened exactly)
    keep = native.library() is not None and grad.dtype == torch.bfloat16
    for i, rs in enumerate(row_chunks(q.shape)):
        g = grad[rs] if keep else grad[rs].float()
        group_sums(g, q[rs], grad_s[rs], grad_o[rs])
        if rounding is not None:
            rounding.step(i, g)
    return grad_s, grad_o


def packed_group_gradients(grad: torch.Tensor, packed: torch.Tensor, bits: int,
                           shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_gradients`` of codes given packed (int32 [rows, words], the format's; ``shape``
    their rows, groups and group size), the same sums bit for bit: the native kernel unpacks
    each group where it sums it (``native/tunable_dequantize.c``), else the codes are unpacked
    first, a chunk of rows at a time."""
    lib = native.library()
    grad, grad_s, grad_o = _grouped(grad, shape)
    packed = packed.contiguous()
    _, groups, size = shape
    for rs in row_chunks(shape):
        g = grad[rs].float().contiguous()
        rows = len(g)
        if lib is None or lib.dq_tunable_backward_packed(
                g.data_ptr(), packed[rs].data_ptr(), rows, groups, size, bits,
                grad_s[rs].data_ptr(), grad_o[rs].data_ptr(), native.kernel_threads()) != 0:
            q = unpack_codes(packed[rs], bits).view(rows, groups, size)
            group_sums(g, q, grad_s[rs], grad_o[rs])
    return grad_s, grad_o


def _grouped(grad: torch.Tensor, shape: tuple[int, int, int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad`` [rows, in_features] as [rows, groups, group_size] (a padded last group's pad
    given no gradient; bf16 left as it is, made float a chunk at a time by the callers), and the
    two gradients' [rows, groups] to fill."""
    rows, groups, size = shape
    if grad.shape[1] != groups * size:
        grad = F.pad(grad, (0, groups * size - grad.shape[1]))
    return (grad.contiguous().view(rows, groups, size),
            torch.empty(rows, groups, dtype=torch.float32),
            torch.empty(rows, groups, dtype=torch.float32))


def group_sums(grad: torch.Tensor, q: torch.Tensor, times_out: torch.Tensor,
               plain_out: torch.Tensor) -> None:
    """Into ``times_out`` and ``plain_out`` [rows, groups]: the sums over each group of
    ``grad`` * ``q`` and of ``grad`` (float32 or bf16, and uint8 [rows, groups, group_size],
    contiguous), in ``group_sums_torch``'s order: the native kernel where it runs
    (``native/tunable_dequantize.c``, one pass), else that."""
    lib = native.library()
    rows, groups, size = q.shape
    if lib is None or size % GROUP_LANES or lib.dq_tunable_backward(
            grad.data_ptr(), grad.dtype == torch.bfloat16, q.data_ptr(), rows, groups, size,
            times_out.data_ptr(), plain_out.data_ptr(), native.kernel_threads()) != 0:
        times, plain = group_sums_torch(grad.float(), q)
        times_out.copy_(times)
        plain_out.copy_(plain)


def group_sums_torch(grad: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_sums``' torch path and the native kernel's reference, bit for bit: each sum in 16
    lanes from +0, lane l adding values l, l + 16, ... in order, then lane l + 8 added to lane l,
    l + 4 to l, l + 2 to l, l + 1 to l (a fixed order: torch's own sum's depends on its vector
    width)."""
    rows, groups, size = q.shape
    g = grad.view(rows, groups, size // GROUP_LANES, GROUP_LANES)
    c = q.view(rows, groups, size // GROUP_LANES, GROUP_LANES)
    times = torch.zeros(rows, groups, GROUP_LANES)
    plain = torch.zeros(rows, groups, GROUP_LANES)
    for k in range(size // GROUP_LANES):
        times.add_(g[:, :, k] * c[:, :, k])
        plain.add_(g[:, :, k])
    h = GROUP_LANES // 2
    while h:
        times, plain = times[..., :h] + times[..., h:2 * h], plain[..., :h] + plain[..., h:2 * h]
        h //= 2
    return times[..., 0], plain[..., 0]


class RoundingOffsets:
    """Each weight's rounding, tuned: code ``clamp(round(q0 + u))`` for GPTQ's code ``q0``, with
    ``u`` starting at the residual GPTQ rounded away (so at GPTQ's codes) and kept within
    [-1, 1] (a code moves by one at most), stepped by Adam on the weight's gradient, which
    passes straight through the rounding. (That gradient times the group's scale is ``u``'s own;
    Adam's step does not change with a constant factor on a weight's gradient, and the scale
    moves by a few per cent over a tuning.)

    Each step is clipped to the step size, so that ``u`` moves by at most ``reach`` (the step
    sizes' sum) over the tuning: only a weight whose residual lies within ``reach`` of a tie
    (|r| >= 0.5 - reach) can change its code, and only those have a ``u``, Adam's moments (bf16:
    a moment in float32 would double them) and GPTQ's code, 9 bytes, in their order in their
    chunk of rows; which they are is a bit a weight (``mask``: 64 to an int64 word, the low bit
    first), with the count of them before each segment of ``SEGMENT`` weights (``first``: where
    a thread's share starts). A third of the weights at 100 steps of 3e-3 (~3 bytes a weight),
    60% at 6e-3 (~5.6). The codes ``q`` (uint8 [rows, groups, group_size]) are moved in place
    where they change, so the forward is a plain dequantize.

    The step is taken inside the backward pass, a chunk of rows at a time as each chunk's
    gradient is made (``group_gradients``): a whole block's gradient would be 4 more bytes a
    weight (a 7B block: 0.9 GB)."""

    BETAS = (0.9, 0.999)
    EPS = 1e-8
    SEGMENT = 4096  # kernels.h's DQ_ROUNDING_SEGMENT

    def __init__(self, q: torch.Tensor, residual: torch.Tensor, max_code: int, reach: float
                 ) -> None:
        if not q.is_contiguous():  # its chunks' codes are written in place, by offset
            raise ValueError("the codes must be contiguous")
        self.q, self.max_code = q, max_code
        self.chunks = row_chunks(q.shape)
        self.mask: list[torch.Tensor] = []
        self.first: list[torch.Tensor] = []
        self.q0: list[torch.Tensor] = []  # their GPTQ codes
        self.u: list[torch.Tensor] = []
        for rs in self.chunks:
            r = residual[rs].reshape(-1)
            # (a thousandth of a code more: u's float32 sums round)
            tunable = r.float().abs() >= 0.499 - reach
            self.mask.append(_bits(tunable))
            counts = F.pad(tunable, (0, -len(r) % self.SEGMENT)).view(-1, self.SEGMENT).sum(1)
            self.first.append(F.pad(counts.cumsum(0), (1, 0)))
            self.q0.append(q[rs].reshape(-1)[tunable])
            self.u.append(r[tunable].float())
        self.m = [torch.zeros_like(u, dtype=torch.bfloat16) for u in self.u]
        self.s2 = [torch.zeros_like(u, dtype=torch.bfloat16) for u in self.u]
        self.t, self.lr = 0, 0.0

    def index(self, i: int) -> torch.Tensor:
        """The places (int64, ascending) in chunk ``i``'s flattened codes of its weights that can
        change their code: ``mask``'s set bits."""
        flags = self.mask[i].view(torch.uint8)[:, None].bitwise_right_shift(_BIT_PLACES) & 1
        return torch.nonzero(flags.reshape(-1)).squeeze(1)

    def next_step(self, lr: float) -> None:
        """The step the next backward pass takes (0: none), and the native kernel's constants
        for it (the same for every chunk)."""
        self.lr = lr
        self.t += lr > 0
        (b1, b2), t = self.BETAS, max(self.t, 1)
        self.constants = torch.tensor([b1, 1 - b1, b2, 1 - b2, (1 - b2 ** t) ** 0.5, self.EPS,
                                       1 / (1 - b1 ** t), lr], dtype=torch.float32)

    def step(self, i: int, grad: torch.Tensor) -> None:
        """Adam's step, clipped to the step size, on chunk ``i``'s weights that can change their
        code, given the chunk's gradient [rows, groups, group_size]; their codes then moved. The
        native kernel where it runs (``native/tuned_rounding.c``, one pass), else
        ``step_torch``."""
        if self.lr <= 0:
            return
        lib = native.library()
        if lib is None:
            self.step_torch(i, grad.float())
            return
        grad = grad.contiguous()
        tensors = (self.mask[i], self.first[i], None, self.u[i], self.m[i], self.s2[i],
                   self.q0[i], self.q[self.chunks[i]], self.constants)
        lib.dq_rounding_step(grad.data_ptr(), grad.dtype == torch.bfloat16,
                             *(len(self.mask[i]) if x is None else x.data_ptr()
                               for x in tensors), self.max_code, native.kernel_threads())

    def step_torch(self, i: int, grad: torch.Tensor) -> None:
        """``step``'s torch path, the native kernel's reference (the same float32 operations)."""
        (b1, b2), t, index = self.BETAS, self.t, self.index(i)
        g = torch.index_select(grad.reshape(-1), 0, index)
        m = self.m[i].float().mul_(b1).add_(g * (1 - b1))
        s2 = self.s2[i].float().mul_(b2).add_(g.mul(g).mul_(1 - b2))
        self.m[i].copy_(m)
        self.s2[i].copy_(s2)
        # (torch's float32 square root is not always the nearest float; in float64 it is)
        denominator = s2.double().sqrt_().float().div_((1 - b2 ** t) ** 0.5).add_(self.EPS)
        step = m.div_(denominator).mul_(1 / (1 - b1 ** t)).clamp_(-1, 1)
        u = self.u[i].sub_(step.mul_(self.lr)).clamp_(-1, 1)
        codes = torch.round(self.q0[i].float() + u).clamp_(0, self.max_code).to(torch.uint8)
        self.q[self.chunks[i]].reshape(-1)[index] = codes


_BIT_PLACES = torch.arange(8, dtype=torch.uint8)


def _bits(flags: torch.Tensor) -> torch.Tensor:
    """``flags`` (bool [n]) as bits: int64 words, 64 flags to a word, the first flag the low bit
    of the first (little-endian bytes, low bit first)."""
    flags = F.pad(flags, (0, -len(flags) % 64)).view(-1, 8).to(torch.uint8)
    return flags.bitwise_left_shift(_BIT_PLACES).sum(1, dtype=torch.uint8).view(torch.int64)


class _RoundedGroupDequantize(torch.autograd.Function):
    """``rounding``'s codes (as they are) with scales ``s`` and offsets ``o`` [rows, groups]
    dequantized ([rows, groups * group_size], float32 or ``dtype``: ``_dequantize``); in the backward
    the gradients in ``s`` and ``o`` and the rounding's step (``group_gradients``)."""

    @staticmethod
    def forward(ctx, rounding: RoundingOffsets, s: torch.Tensor, o: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        ctx.rounding = rounding
        q = rounding.q
        rows, groups, size = q.shape
        out = torch.empty(rows, groups, size, dtype=dtype)
        _dequantize(q, s.contiguous(), o.contiguous(), out, rounding.chunks)
        return out.view(rows, groups * size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor, None]:
        rounding: RoundingOffsets = ctx.rounding
        return None, *group_gradients(grad, rounding.q, rounding), None


def _dequantize(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, out: torch.Tensor,
                chunks: list[slice]) -> None:
    """``out`` (q's shape, float32 or bf16) = q * s + o in float32, multiply then add (the
    format's dequantize, bit for bit), then rounded to ``out``'s dtype as torch rounds: the
    native kernel's one pass where it runs (float32 stored past the caches: the weights are
    read later, by the block's products), else a chunk of rows at a time in torch."""
    rows, groups, size = q.shape
    lib = native.library()
    if lib is not None and not size % GROUP_LANES and out.dtype in (torch.float32, torch.bfloat16):
        at = (q.data_ptr(), s.data_ptr(), o.data_ptr(), rows, groups, size, out.data_ptr(),
              native.kernel_threads())
        if (lib.dq_tunable_forward(*at) if out.dtype == torch.float32
                else lib.dq_tunable_forward_bf16(*at)) == 0:
            return
    for rs in chunks:
        if out.dtype == torch.float32:
            torch.mul(q[rs], s[rs, :, None], out=out[rs]).add_(o[rs, :, None])
        else:
            out[rs].copy_(torch.mul(q[rs], s[rs, :, None]).add_(o[rs, :, None]))


def row_chunks(shape: tuple[int, ...], elements: int | None = None) -> list[slice]:
    """Slices of the rows of codes ``shape`` [rows, groups, group_size], each of at most
    ``elements`` codes (``CHUNK_ELEMENTS`` by default) and at least one row."""
    rows, groups, size = shape
    step = max(1, (CHUNK_ELEMENTS if elements is None else elements) // (groups * size))
    return [slice(i, i + step) for i in range(0, rows, step)]


class TunableScales(nn.Module):
    """One tensor's codes with learnable group scales and offsets, and with learnable rounding
    where ``residual`` (float16 [rows, in_features]: ``gptq_residual``'s) is given, over steps
    whose sizes sum to ``reach`` (``RoundingOffsets``)."""

    def __init__(self, start: QuantizedTensor, residual: torch.Tensor | None = None,
                 reach: float = 0.0, codes: Callable[[], torch.Tensor] | None = None) -> None:
        super().__init__()
        lay = start.layout
        self.start, self.in_features = start, lay.in_features
        self.max_code = (1 << lay.bits) - 1
        # where the packed codes come from each time they are used (a file, for a whole
        # model's: ``start.qweight`` may then be a meta tensor); ``start``'s own by default
        self._codes = codes
        self._q: torch.Tensor | None = None  # held codes, unpacked once they are needed
        # (the start's scales and offsets are read as bf16, made float where used: a whole
        # model's groups are many)
        self.a = nn.Parameter(torch.zeros(start.scales.shape))
        self.b = nn.Parameter(torch.zeros(start.scales.shape))
        self.rounding: RoundingOffsets | None = None
        if residual is not None:  # a padded group's pad: code 0, residual 0, no gradient: 0
            pad = lay.num_groups * lay.group_size - lay.in_features
            r = F.pad(residual.reshape(lay.num_rows, -1), (0, pad)).view(self.shape)
            # the codes as bytes (the rounding moves them in place)
            self.rounding = RoundingOffsets(self.unpacked(), r, self.max_code, reach)

    @property
    def shape(self) -> tuple[int, int, int]:
        lay = self.start.layout
        return lay.num_rows, lay.num_groups, lay.group_size

    def packed(self) -> torch.Tensor:
        """The packed codes as they are now (int32 [rows, words])."""
        if self.rounding is not None:
            return pack_codes(self.rounding.q.reshape(self.shape[0], -1), self.start.bits)
        return self.start.qweight if self._codes is None else self._codes()

    def unpacked(self) -> torch.Tensor:
        """The codes as they are now, a byte each (uint8 [rows, groups, group_size]): the
        rounding's own (moved in place); held codes unpacked once; codes read from a file read
        again."""
        if self.rounding is not None:
            return self.rounding.q
        if self._codes is not None:
            return unpack_codes(self._codes(), self.start.bits).view(self.shape)
        if self._q is None:
            self._q = unpack_codes(self.start.qweight, self.start.bits).view(self.shape)
        return self._q

    def group_gradients(self, grad: torch.Tensor, packed: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients in the scales and offsets of rows ``packed`` of the codes (what
        ``packed()`` gave, or rows of it) given their dequantized weight's ``grad``: from held
        codes (unpacked once), else from the packed ones."""
        rows, groups, size = self.shape
        if self._codes is None and len(packed) == rows:
            return group_gradients(grad, self.unpacked())
        return packed_group_gradients(grad, packed, self.start.bits, (len(packed), groups, size))

    def dequantize(self, packed: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Rows ``packed`` of the codes with their scales ``s`` and offsets ``o`` (bf16 values in
        float32) as the format dequantizes them: float32 [rows, in_features]."""
        lay = self.start.layout
        return dequantize_rows(packed, s.to(torch.bfloat16), o.to(torch.bfloat16), lay.bits,
                               lay.group_size, lay.in_features, torch.float32)

    def scale_parameters(self) -> list[nn.Parameter]:
        return [self.a, self.b]

    def scale_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and offsets [rows, groups] the current factors give (bf16 values in
        float32), differentiable in them."""
        s0, o0 = self.start.scales.float(), self.start.offsets.float()
        return _bf16(s0 * (1 + self.a)), _bf16(o0 + s0 * self.b)

    def forward(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight in its logical shape (the format's arithmetic in float32:
        multiply, then add; then rounded to ``dtype``, its gradient taken in it)."""
        s, o = self.scale_offset()
        if self.rounding is None:
            w = _GroupDequantize.apply(self, s, o, dtype)
        else:
            w = _RoundedGroupDequantize.apply(self.rounding, s, o, dtype)[:, : self.in_features]
        return w.reshape(self.start.logical_shape)

    def next_rounding_step(self, lr: float) -> None:
        """Adam's step size on the rounding in the next backward pass (none without it)."""
        if self.rounding is not None:
            self.rounding.next_step(lr)

    @torch.no_grad()
    def codes(self) -> QuantizedTensor:
        """The codes with the current scales and offsets (dequantizing to ``forward()``)."""
        s, o = self.scale_offset()
        return replace(self.start, qweight=self.packed(), scales=s.to(torch.bfloat16),
                       offsets=o.to(torch.bfloat16))
