"""Packed modules: they hold qweight / scales / offsets and dequantize on the fly.

- ``QuantLinear``: a Linear, computed straight from the packed codes (``numerics/packed_matvec.py``):
  a few tokens (decode) by the matvec kernel, more (prefill) by the packed GEMM in float32; in
  bfloat16 on CPUs with native bf16, 4-bit modules use torch's int4 kernel and long prefills
  dequantize row blocks for the bf16 GEMM, which is faster there.
- ``QuantEmbedding``: dequantizes only the rows a batch looks up; ``TiedQuantHead`` runs a tied
  lm_head from it (packed product for a few tokens, row chunks otherwise).
- ``QuantExpertBank``: a 3-D expert bank; ``bank[e]`` is expert ``e`` (``PackedExpert``): products
  with a few tokens run from the packed codes, anything else dequantizes expert ``e`` alone;
  ``bank.pairs_linear`` / ``bank.pairs_matmul``: a few (token, expert) pairs in one kernel call
  (MoE decode: ``runtime/experts.py`` and the reference architecture's MoE use them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from dynquant.format.layout import LayerLayout
from dynquant.models.embedding_scale import EmbeddingScale
from dynquant.numerics import native
from dynquant.numerics.packed_matvec import (
    MAX_TOKENS,
    ExpertPairs,
    OneTokenMatvec,
    packed_gemm_t,
    packed_matvec_experts,
    packed_vecmat,
    packed_vecmat_experts,
)
from dynquant.numerics.quantizer import dequantize, dequantize_rows
from dynquant.runtime.int4_cpu import (
    dequantize_int4_rows,
    int4_linear,
    int4_supported,
    layout_is_known,
    pack_int4,
)
from dynquant.runtime.product_paths import Activations, ProductPath, product_path

HEAD_CHUNK_ROWS = 2048
# (token, expert) pairs that a bank multiplies in one kernel call (MoE decode: tokens x top-k).
MAX_PAIRS = 32
# Rows dequantized at a time for prefill: large enough that the native dequantization runs on
# all threads (it splits from 1 M values), small enough to stay in L3 while it is used.
DEQUANT_BLOCK_ELEMENTS = 1 << 22
# bfloat16 inputs up to this many tokens take the packed GEMM (float32 inside); beyond it, a CPU
# with native bf16 multiplies dequantized bf16 blocks faster. The blocks are faster from fewer
# tokens too, but short prompts stay on the float32-inside GEMM for accuracy: bf16 blocks there
# move a tiny OLMoE's prefill logits past what tests/runtime/test_moe_decode.py allows. float32 inputs
# always take the packed GEMM (BENCHMARKS.md "Packed products and the compute peak").
BF16_GEMM_MAX_TOKENS = 32


_scratch_buffers = threading.local()


def thread_scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] view of this thread's scratch buffer, grown as needed and kept for the
    thread's life (one block: 8-32 MB). Prefill dequantizes block after block; a fresh multi-MB
    tensor per block costs more in page faults than the dequantization itself. Never used when
    autograd may keep the block for a backward pass."""
    numel = shape[0] * shape[1]
    buf = getattr(_scratch_buffers, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = _scratch_buffers.buf = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _decode_product(product: Callable[..., torch.Tensor | None], x: torch.Tensor,
                    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    layout: LayerLayout, gemm: Callable[..., torch.Tensor | None] | None = None
                    ) -> torch.Tensor | None:
    """``product`` (packed_matvec or packed_vecmat) of x's tokens, in x's shape and dtype; with
    more than MAX_TOKENS tokens ``gemm`` (packed_gemm) where given and worthwhile (float32, or
    bfloat16 up to BF16_GEMM_MAX_TOKENS). None when none applies, when x needs a gradient (the
    kernels have no backward) or when the native kernels are unavailable: the caller then
    dequantizes."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if needs_grad(x):
        return None
    if m > MAX_TOKENS:
        if gemm is None or not packed_gemm_serves(x):
            return None
        product = gemm
    y = product(flat, qweight, scales, offsets, layout)
    return None if y is None else y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _past_bf16_gemm_tokens(x: torch.Tensor) -> bool:
    """More tokens than BF16_GEMM_MAX_TOKENS: where the bf16 GEMM of dequantized blocks wins."""
    return x.numel() > BF16_GEMM_MAX_TOKENS * x.shape[-1]


def packed_gemm_serves(x: torch.Tensor) -> bool:
    """Whether the packed GEMM (or matvec) takes x's tokens: float32 always, else up to
    BF16_GEMM_MAX_TOKENS (beyond, dequantized blocks and the bf16 GEMM are faster)."""
    return x.dtype == torch.float32 or not _past_bf16_gemm_tokens(x)


_ONE_TOKEN_DTYPES = (torch.float32, torch.bfloat16)
T = TypeVar("T")


class PackedWeight(nn.Module):
    """The three stored tensors of a quantized module, as buffers (state-dict keys M.qweight...).

    ``activations``: what its products take (float32, int8 or int16; every token or decode's
    few), set for a whole model by ``runtime/activations.py``; ``runtime/product_paths.py``
    turns it into kernels for the module's width."""

    def __init__(self, layout: LayerLayout, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.layout, self.compute_dtype = layout, compute_dtype
        self.activations = Activations()
        self.register_buffer("qweight", torch.empty(layout.qweight_shape, dtype=torch.int32,
                                                    device="meta"))
        self.register_buffer("scales", torch.empty(layout.scales_shape, dtype=torch.bfloat16,
                                                   device="meta"))
        self.register_buffer("offsets", torch.empty(layout.scales_shape, dtype=torch.bfloat16,
                                                    device="meta"))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.offsets, self.layout,
                          dtype or self.compute_dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None,
                        scratch: bool = False) -> torch.Tensor:
        """Rows [start, stop) dequantized. ``scratch``: into this thread's reused buffer, for a
        caller that is done with the result before it asks for the next block."""
        lay = self.layout
        dtype = dtype or self.compute_dtype
        out = thread_scratch((stop - start, lay.in_features), dtype) if scratch else None
        return dequantize_rows(self.qweight[start:stop], self.scales[start:stop],
                               self.offsets[start:stop], lay.bits, lay.group_size,
                               lay.in_features, dtype, out=out)

    def matvec(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ W^T`` from the packed codes, any number of tokens (see :func:`_decode_product`)."""
        if x.numel() == x.shape[-1] and x.dtype in _ONE_TOKEN_DTYPES and x.is_contiguous():
            fast = self._one_token(x)
            if fast is not None:  # the general path's own conversions: bf16 through float32
                y = fast[0](fast[1], x if x.dtype == torch.float32 else x.float(),
                            (*x.shape[:-1], fast[0].rows))
                return y if x.dtype == torch.float32 else y.to(x.dtype)
        product, gemm = self._products()
        return _decode_product(product, x, self.qweight, self.scales, self.offsets,
                               self.layout, gemm=gemm)

    def _products(self) -> tuple[Callable[..., torch.Tensor | None],
                                 Callable[..., torch.Tensor | None]]:
        """The products of a few tokens and of many along the groups, as the activations ask."""
        path = self.product_path()
        return path.few_tokens, path.many_tokens

    def product_path(self) -> ProductPath:
        """The kernels this module's width runs for its activations."""
        return product_path(self.layout.bits, self.activations)

    def _one_token(self, x: torch.Tensor) -> tuple[OneTokenMatvec, object] | None:
        """Decode's common case (one token, a small matrix) without the general call's per-call
        work: the prepared ``OneTokenMatvec`` and the native library; None where it does not
        apply. A decode step makes this call once per Linear, so its per-call Python is most of a
        small product's time (`benchmarks/one_token_products.py`)."""
        lib = native.library()  # DYNQUANT_NATIVE=0 switches the kernels off at any call
        if lib is None or needs_grad(x):
            return None
        fast = self.one_token_product()
        return None if fast is None else (fast, lib)

    def one_token_product(self) -> OneTokenMatvec | None:
        """The prepared one-token product for the module's activations (int8, int16 or float32), kept
        until a buffer is replaced; None off the CPU."""
        kind = self.product_path().activations
        return self._kept(f"matvec-{kind}", lambda q, s, o: OneTokenMatvec(
            q, s, o, self.layout, int8=kind == "int8", int16=kind == "int16"))

    def _kept(self, key: str, make: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], T]
              ) -> T | None:
        """``make(qweight, scales, offsets)`` (contiguous), made on first use and kept under
        ``key`` until a buffer is replaced; None off the CPU. Read on every decode product, so
        the buffers come from ``_buffers``, not through ``nn.Module.__getattr__``."""
        buffers = self._buffers
        q, s, o = buffers["qweight"], buffers["scales"], buffers["offsets"]
        known = self.__dict__.setdefault("_kept_calls", {})
        entry = known.get(key)
        if entry is None or entry[1] is not q or entry[2] is not s or entry[3] is not o:
            if q.device.type != "cpu":
                return None
            entry = (make(q.contiguous(), s.contiguous(), o.contiguous()), q, s, o)
            known[key] = entry
        return entry[0]

    def extra_repr(self) -> str:
        lay = self.layout
        return f"shape={list(lay.logical_shape)}, bits={lay.bits}, group_size={lay.group_size}"


class QuantLinear(PackedWeight):
    def __init__(self, layout: LayerLayout, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, use_int4: bool = True) -> None:
        super().__init__(layout, compute_dtype)
        self.out_features, self.in_features = layout.logical_shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # torch's int4 kernel wins only with bf16 activations (with float32 ones it is an order of
        # magnitude slower than the packed matvec: benchmarks/int4_gemv.py), so it serves bf16
        # compute alone.
        self.use_int4 = (use_int4 and layout.bits == 4 and compute_dtype == torch.bfloat16
                         and int4_supported(self.out_features, self.in_features,
                                            layout.group_size))
        self._int4: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        """Convert to the int4 kernel's layout once the buffers hold real data."""
        if self.use_int4 and self.qweight.device.type == "cpu":
            packed, scale_zero = pack_int4(self.qweight, self.scales, self.offsets)
            # The kernel's copy replaces our codes and scales (held once); our bf16 offsets stay
            # (2 bytes a group): long prefills dequantize the format's exact values from them.
            self._int4 = (packed, scale_zero)
            self.qweight = torch.empty(0, dtype=torch.int32)
            self.scales = torch.empty(0, dtype=torch.bfloat16)

    def one_token_product(self) -> OneTokenMatvec | None:
        return None if self._int4 is not None else super().one_token_product()

    def _int4_rows(self) -> bool:
        """Whether rows can be dequantized from the int4 kernel's copy (its layout is known)."""
        return self._int4 is not None and layout_is_known()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._int4_rows():
            return self.dequantize_rows(0, self.out_features, dtype)
        if self._int4 is not None:  # an unknown layout: rebuild through the kernel itself
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            w = int4_linear(eye, *self._int4, self.layout.group_size).T
            return w.to(dtype or self.compute_dtype)
        return super().dequantize(dtype)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None,
                        scratch: bool = False) -> torch.Tensor:
        if not self._int4_rows():
            return super().dequantize_rows(start, stop, dtype, scratch)
        dtype = dtype or self.compute_dtype
        out = thread_scratch((stop - start, self.in_features), dtype) if scratch else None
        return dequantize_int4_rows(*self._int4, self.offsets, self.layout.group_size, start,
                                    stop, dtype, out=out)

    def resident_nbytes(self) -> int:
        tensors = ([*self._int4, self.offsets] if self._int4 is not None
                   else [self.qweight, self.scales, self.offsets])
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._int4_product(x) if self._int4 is not None else self.matvec(x)
        if y is not None:
            return y if self.bias is None else y + self.bias.to(y.dtype)
        # Long bf16 prefills (and gradients): dequantize a block of rows at a time into the reused
        # scratch buffer (it stays in cache while it is used) and let the BLAS multiply it.
        step = max(1, DEQUANT_BLOCK_ELEMENTS // self.in_features)
        scratch = not needs_grad(x)
        parts = [F.linear(x, self.dequantize_rows(r, min(r + step, self.out_features), x.dtype,
                                                  scratch=scratch))
                 for r in range(0, self.out_features, step)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # one block: no copy
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _int4_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """The int4 kernel's product, or None where dequantized blocks serve better: gradients
        (the kernel has no backward) and prefills past BF16_GEMM_MAX_TOKENS (there dequantized blocks
        and the bf16 GEMM take about half the kernel's time)."""
        if not self._int4_rows():
            return (F.linear(x, self.dequantize(x.dtype)) if needs_grad(x)
                    else int4_linear(x, *self._int4, self.layout.group_size))
        if needs_grad(x) or _past_bf16_gemm_tokens(x):
            return None
        return int4_linear(x, *self._int4, self.layout.group_size)


class QuantEmbedding(PackedWeight):
    def __init__(self, layout: LayerLayout, compute_dtype: torch.dtype = torch.bfloat16,
                 padding_idx: int | None = None, scale: EmbeddingScale | None = None) -> None:
        super().__init__(layout, compute_dtype)
        self.num_embeddings, self.embedding_dim = layout.logical_shape
        self.padding_idx = padding_idx
        self.scale = scale  # the replaced module's factor on the looked-up rows (Gemma)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, gathered packed and dequantized: the output is as large as
        the dequantized rows, so finding repeated ids first (a sort) saves nothing: the sort
        costs more than the lookup."""
        flat = ids.reshape(-1)
        lay = self.layout
        rows = dequantize_rows(self.qweight[flat], self.scales[flat], self.offsets[flat],
                               lay.bits, lay.group_size, lay.in_features, self.compute_dtype)
        if self.scale is not None:
            factor = torch.tensor(self.scale.value)
            rows = rows * (factor.to(rows.dtype) if self.scale.in_row_dtype else factor)
        return rows.view(*ids.shape, lay.in_features)


class TiedQuantHead(nn.Module):
    """A tied lm_head computed from the packed embedding, ``HEAD_CHUNK_ROWS`` vocab rows at a time."""

    def __init__(self, embedding: QuantEmbedding) -> None:
        super().__init__()
        self.embedding = [embedding]  # a list: not a submodule, so its buffers are not duplicated

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        emb = self.embedding[0]
        y = emb.matvec(h)
        if y is not None:
            return y
        parts = [h @ emb.dequantize_rows(s, min(s + HEAD_CHUNK_ROWS, emb.num_embeddings),
                                         h.dtype, scratch=not needs_grad(h)).T
                 for s in range(0, emb.num_embeddings, HEAD_CHUNK_ROWS)]
        return torch.cat(parts, dim=-1)


class QuantExpertBank(PackedWeight):
    """``bank[e]`` is expert ``e``'s matrix ``logical_shape[1:]``, still packed (``PackedExpert``)."""

    def __getitem__(self, e: int | torch.Tensor) -> PackedExpert:
        return PackedExpert(self, int(e))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.layout.logical_shape)

    def __len__(self) -> int:
        return self.layout.logical_shape[0]

    def _pairs(self, product: Callable[..., torch.Tensor | None], x: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] > MAX_PAIRS or needs_grad(x):
            return None
        fast = (self._prepared(product is packed_matvec_experts)
                if x.dtype in _ONE_TOKEN_DTYPES else None)
        if fast is not None:
            y = fast[0](fast[1], (x if x.dtype == torch.float32 else x.float()).contiguous(),
                        experts)
        else:
            y = product(x, experts, self.qweight, self.scales, self.offsets, self.layout)
        return None if y is None else y.to(x.dtype)

    def _prepared(self, along_groups: bool) -> tuple[ExpertPairs, object] | None:
        """The bank's prepared pair products (``ExpertPairs``) and the native library; None
        where they do not apply. Decode calls a bank once per step: the general call's checks
        cost more than a small bank's product."""
        lib = native.library()  # DYNQUANT_NATIVE=0 switches the kernels off at any call
        if lib is None:
            return None
        kind = self.product_path().activations if along_groups else "float32"
        fast = self._kept(f"pairs-{along_groups}-{kind}", lambda q, s, o: ExpertPairs(
            q, s, o, self.layout, along_groups, int8=kind == "int8", int16=kind == "int16"))
        return None if fast is None else (fast, lib)

    def pairs_linear(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """Row p: ``F.linear(x[p], W[experts[p]])``, every pair in one native call; None for more
        than MAX_PAIRS pairs, inputs that need a gradient, or without the kernels."""
        return self._pairs(packed_matvec_experts, x, experts)

    def pairs_matmul(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """Row p: ``x[p] @ W[experts[p]]`` (as :meth:`pairs_linear`)."""
        return self._pairs(packed_vecmat_experts, x, experts)

    def grouped_linear(self, xs: list[torch.Tensor], experts: list[int]
                       ) -> list[torch.Tensor] | None:
        """``[F.linear(xs[i], W[experts[i]])]`` for a long bf16 prefill (see :meth:`_grouped`)."""
        return self._grouped(xs, experts, transposed=False)

    def grouped_matmul(self, xs: list[torch.Tensor], experts: list[int]
                       ) -> list[torch.Tensor] | None:
        """``[xs[i] @ W[experts[i]]]`` for a long bf16 prefill (see :meth:`_grouped`)."""
        return self._grouped(xs, experts, transposed=True)

    def _grouped(self, xs: list[torch.Tensor], experts: list[int], transposed: bool
                 ) -> list[torch.Tensor] | None:
        """Each expert's tokens times its matrix, the experts dequantized a run at a time (one
        native call for up to DEQUANT_BLOCK_ELEMENTS values, into the reused scratch buffer) and
        their products back to back: expert by expert, each product would pay a call and the
        wake-up of torch's threads after it, more than a small expert's product. An expert with
        few tokens in a run that is dequantized anyway uses it too (cheaper than its own packed
        GEMM); a run of such experts alone keeps the packed GEMM. None where the per-expert
        products serve better (float32, or only experts with few tokens) or can't (gradients,
        mixed dtypes)."""
        if (not xs or any(needs_grad(x) or x.dtype != xs[0].dtype for x in xs)
                or all(packed_gemm_serves(x) for x in xs)):
            return None
        n, a, c = self.shape
        per = self.layout.num_rows // n
        run = max(1, DEQUANT_BLOCK_ELEMENTS // (per * self.layout.in_features))
        order = sorted(range(len(xs)), key=lambda k: experts[k])
        ys: list[torch.Tensor] = [xs[0]] * len(xs)

        def product(x: torch.Tensor, w: torch.Tensor | PackedExpert) -> torch.Tensor:
            return x @ w if transposed else F.linear(x, w)

        i = 0
        while i < len(order):
            first = experts[order[i]]
            j = i
            while j < len(order) and experts[order[j]] - first < run:
                j += 1
            members = order[i:j]
            if all(packed_gemm_serves(xs[k]) for k in members):
                for k in members:
                    ys[k] = product(xs[k], self[experts[k]])
            else:
                block = self.dequantize_rows(first * per, (experts[order[j - 1]] + 1) * per,
                                             xs[0].dtype, scratch=True)
                for k in members:
                    e = experts[k] - first
                    ys[k] = product(xs[k], block[e * per:(e + 1) * per].view(a, c))
            i = j
        return ys


class PackedExpert:
    """One expert of a bank, not dequantized until something needs it.

    ``F.linear(x, W)`` and ``x @ W`` (how transformers' MoE blocks and the reference architecture
    use an expert) run from the packed codes for a few tokens (``numerics/packed_matvec.py``);
    every other torch function, every other attribute and more tokens see the dequantized tensor
    (``dense()``), so it behaves like the matrix it stands for.
    """

    def __init__(self, bank: QuantExpertBank, e: int) -> None:
        per = bank.layout.num_rows // bank.layout.logical_shape[0]
        self.bank, self.rows = bank, slice(e * per, (e + 1) * per)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.bank.layout.logical_shape[1:])

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self.bank.dequantize_rows(self.rows.start, self.rows.stop, dtype)
        return w.reshape(self.shape)

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.bank
        return b.qweight[self.rows], b.scales[self.rows], b.offsets[self.rows]

    def linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """``F.linear(x, self)`` from the packed codes (see :func:`_decode_product`)."""
        if not packed_gemm_serves(x):  # before slicing the codes it would not use
            return None
        product, gemm = self.bank._products()
        return _decode_product(product, x, *self._packed(), self.bank.layout, gemm=gemm)

    def rmatmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ self`` from the packed codes (see :func:`_decode_product`)."""
        if not packed_gemm_serves(x):
            return None
        return _decode_product(packed_vecmat, x, *self._packed(), self.bank.layout,
                               gemm=packed_gemm_t)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # the torch protocol
        kwargs = kwargs or {}
        x, w = (*args, None, None)[:2]
        if isinstance(w, PackedExpert) and isinstance(x, torch.Tensor):
            y = None
            if func is F.linear:
                y = w.linear(x)
                bias = dict(enumerate(args)).get(2, kwargs.get("bias"))
                if y is not None and bias is not None:
                    y = y + bias.to(y.dtype)
            elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
                y = w.rmatmul(x)
            if y is not None:
                return y
        # dequantized in the dtype of the tensor it meets (else the bank's compute dtype)
        dtype = x.dtype if isinstance(x, torch.Tensor) and x.is_floating_point() else None
        if isinstance(w, PackedExpert) and not kwargs and len(args) == 2:
            return func(x, w.dense(dtype))  # a prefill's x @ W[e]: no pytree walk of the arguments

        def densify(a: object) -> object:
            return a.dense(dtype) if isinstance(a, PackedExpert) else a

        return func(*tree_map(densify, args), **tree_map(densify, kwargs))

    def __getattr__(self, name: str) -> object:
        return getattr(self.dense(), name)
