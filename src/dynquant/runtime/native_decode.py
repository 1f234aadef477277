"""Decode steps of Llama-style models (Llama, Qwen3, the MoE Qwen3-MoE, Mixtral, OLMoE; LFM2,
LFM2-MoE and the reference hybrid with their gated short convolutions) in one native call a
token.

Through transformers' modules a decode step pays a Python dispatch for every norm, rotary,
cat, attention and module call: on small models more than the products themselves. Here the
model's ``forward`` is wrapped: a one-token forward that continues a ``DynamicCache`` (what
``generate`` does at every step) runs ``dq_decode_step`` (``numerics/native/decode_step.c``): all
layers, the final norm and the head in C, the products by dynquant's one-token kernels (int8,
int16 or float32 activations, as the model's packed modules are set) with keys and values (and
LFM2's convolution states) kept in a float32 cache of its own. Everything else (prefill, batches,
gradients, other caches, attention or hidden-state outputs) runs transformers' forward, as does
any model this module does not recognise. So ``generate`` keeps all of its features (sampling,
streamers, stopping criteria): only its model calls change.

The cache: at the first native step of a ``DynamicCache`` its keys and values (the prompt's,
from the eager prefill) and convolution states are copied in; later steps advance the native
copy alone. A forward that is not a native step and meets such a cache first writes the native
keys, values and states back into it, so a cache stays correct for anything that continues it
through ``forward``.

``DYNQUANT_NATIVE_DECODE=0`` switches the native steps off.
"""

from __future__ import annotations

import copy
import ctypes
import os
import weakref
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.integrations import moe as transformers_moe
from transformers.modeling_outputs import CausalLMOutputWithPast

from dynquant.numerics import native
from dynquant.numerics.native.interface import (
    LAYER_ATTENTION,
    LAYER_CONVOLUTION,
    MLP_DENSE,
    MLP_EXPERTS,
    MLP_HYBRID_EXPERTS,
    PRODUCT_DENSE_BF16,
    PRODUCT_DENSE_F32,
    PRODUCT_PACKED,
    PRODUCT_PACKED_Q8,
    PRODUCT_PACKED_Q16,
    ROUTER_SIGMOID,
    DecodeLayer,
    DecodeProgram,
    ExpertPairsBlock,
    PackedBlock,
    Product,
)
from dynquant.runtime.packed_modules import PackedWeight, QuantExpertBank, TiedQuantHead
from dynquant.runtime.stored_linear import StoredLinear

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "olmoe", "lfm2", "lfm2_moe",
            "dynquant_hybrid")
# the layer types a family's native step runs (LFM2: attention and short convolutions)
LAYER_TYPES = {family: ("full_attention", "conv")
               for family in ("lfm2", "lfm2_moe", "dynquant_hybrid")}
# transformers' gated activation of fused experts, act(gate) * up on [gate; up] (what the native
# step computes); an experts class with its own is not run natively
DEFAULT_APPLY_GATE = getattr(transformers_moe, "_default_apply_gate", None)
# rotary types whose inverse frequencies do not depend on the sequence's length
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
FIRST_CAPACITY = 256
# Products from this many weights split over the kernel pool's threads. Inside a native step
# they run back to back, so the pool's workers are still spinning when the next one comes (a
# hand-off of ~1 us, not the ~25 us wake-up between transformers' modules that keeps
# PARALLEL_MIN_ELEMENTS high): benchmarks/packed_products.py, "hand-off".
STEP_PARALLEL_MIN_ELEMENTS = 1 << 16
# A step's attention (units of a key/value head by 128 positions) split over the pool from this many
# multiply-adds: SmolLM2's 9 heads of 64 from ~14 cached positions (its time grows with the
# context, the products' does not).
ATTENTION_PARALLEL_MIN_MACS = 1 << 14
# The native cache's keys and values: float16 (llama.cpp's default; half the bytes a step reads
# over a long context) or float32 (``DYNQUANT_KV_CACHE=float32``: the eager path's own numbers).
KV_CACHE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def kv_cache_dtype() -> torch.dtype:
    name = os.environ.get("DYNQUANT_KV_CACHE", "float16")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"DYNQUANT_KV_CACHE={name}: one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def supports(config: Any) -> bool:
    """Whether a model of this config can take native decode steps (family and features)."""
    if getattr(config, "model_type", None) not in FAMILIES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    types = getattr(config, "layer_types", None) or []
    allowed = LAYER_TYPES.get(config.model_type, ("full_attention",))
    if any(t not in allowed for t in types):
        return False
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return rope in STATIC_ROPE


def _indices(flags: list[bool]) -> list[int | None]:
    """Each flagged position's index among the flagged ones (None where not flagged)."""
    count, out = 0, []
    for flag in flags:
        out.append(count if flag else None)
        count += flag
    return out


class _Layer:
    """A decoder layer's parts under one set of names: Llama-style (``input_layernorm``,
    ``self_attn`` with ``o_proj`` and ``q_norm``/``k_norm``, ``post_attention_layernorm``, ``mlp``
    with ``gate_proj``/``up_proj``/``down_proj`` or routed experts) or LFM2's
    (``operator_norm``, ``self_attn`` with ``out_proj`` and ``q_layernorm``/``k_layernorm``, or
    ``conv``; ``ffn_norm``; ``feed_forward`` with ``w1``/``w3``/``w2`` or LFM2-MoE's routed
    experts, whose router takes sigmoids) or the reference hybrid's (LFM2's, but ``o_proj``,
    ``q_norm``/``k_norm`` and ``moe``: banks ``w1``/``w3``/``w2`` multiplied as x @ W[e] and a
    shared expert ``sw1``/``sw3``/``sw2``)."""

    def __init__(self, layer: nn.Module) -> None:
        self.lfm2 = lfm2 = hasattr(layer, "operator_norm")  # LFM2, LFM2-MoE, the hybrid
        self.norm = layer.operator_norm if lfm2 else layer.input_layernorm
        self.mlp_norm = layer.ffn_norm if lfm2 else layer.post_attention_layernorm
        self.attn = getattr(layer, "self_attn", None)
        self.conv = getattr(layer, "conv", None) if lfm2 else None
        if self.attn is not None:
            self.out_proj = getattr(self.attn, "out_proj", None) or self.attn.o_proj
            self.q_norm = getattr(self.attn, "q_layernorm", None) or getattr(self.attn, "q_norm",
                                                                             None)
            self.k_norm = getattr(self.attn, "k_layernorm", None) or getattr(self.attn, "k_norm",
                                                                             None)
        self.hybrid_moe = getattr(layer, "moe", None)
        self.mlp = self.hybrid_moe or (layer.feed_forward if lfm2 else layer.mlp)
        self.dense_mlp = (None if hasattr(self.mlp, "experts") or self.hybrid_moe else
                          (self.mlp.w1, self.mlp.w3, self.mlp.w2) if lfm2 else
                          (self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj))


class _Program:
    """The descriptors ``dq_decode_step`` reads (``kernels.h``'s ``dq_decode_program``, its layers
    and products), for one model and cache capacity, with every tensor and descriptor they point
    into kept alive (``keep``): keys and values for the attention layers (``k``, ``v``: [attention
    layers, kv_heads, capacity, head_dim], ``attention[i]`` the index of layer i or None) and the
    states of the convolution layers (``conv``: [convolution layers, hidden, K],
    ``convolution[i]``)."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        cfg, core = model.config, model.model
        self.keep: list[Any] = []
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self.capacity = capacity
        parts = [_Layer(layer) for layer in core.layers]
        self.attention = _indices([p.attn is not None for p in parts])
        self.convolution = _indices([p.conv is not None for p in parts])
        if any(a is None and c is None for a, c in zip(self.attention, self.convolution,
                                                    strict=True)):
            raise _Unsupported("a layer that is neither attention nor a short convolution")
        kernel = max((p.conv.conv.kernel_size[0] for p in parts if p.conv is not None), default=1)
        # a key/value head's positions in a row: the attention reads them in order
        self.k = torch.zeros(sum(a is not None for a in self.attention), self.kv_heads,
                             capacity, self.head_dim, dtype=kv_cache_dtype())
        self.v = torch.zeros_like(self.k)
        self.conv = torch.zeros(sum(c is not None for c in self.convolution), self.hidden, kernel)
        self.layers = (DecodeLayer * len(parts))()
        for i, (part, layer) in enumerate(zip(parts, self.layers, strict=True)):
            layer.norm, layer.mlp_norm = self._norm(part.norm), self._norm(part.mlp_norm)
            if part.attn is not None:
                self._attention(part, self.attention[i], layer)
            else:
                self._convolution(part, self.convolution[i], layer)
            self._mlp(part, layer)
        rotary = next(getattr(core, n) for n in ("rotary_emb", "pos_emb", "rotary")
                      if hasattr(core, n))  # Llama-style, LFM2-MoE, the hybrid
        inv_freq = rotary.inv_freq.detach().float().contiguous()
        self.keep.append(inv_freq)
        final_norm = core.embedding_norm if hasattr(core, "embedding_norm") else core.norm
        inter = max((p.dense_mlp[0].out_features for p in parts if p.dense_mlp is not None),
                    default=getattr(cfg, "intermediate_size", 0))
        eps = getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps
        self.program = DecodeProgram(
            layers=self.layers, final_norm=self._norm(final_norm), inv_freq=inv_freq.data_ptr(),
            head=self._product(model.lm_head), layer_count=len(parts), hidden=self.hidden,
            heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, intermediate=inter,
            capacity=capacity, attention_min_macs=ATTENTION_PARALLEL_MIN_MACS,
            attention_threads=native.kernel_threads(),
            cache_half=int(self.k.dtype == torch.float16), rms_eps=eps,
            rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
            attention_scale=self.head_dim ** -0.5)
        self.vocab = self._rows(model.lm_head)

    def _attention(self, part: _Layer, index: int, layer: DecodeLayer) -> None:
        """An attention layer's products, q/k norms (over all heads where a norm's weight spans
        them: OLMoE) and its keys and values."""
        att = part.attn
        layer.kind = LAYER_ATTENTION
        layer.q, layer.k, layer.v, layer.o = map(
            self._product, (att.q_proj, att.k_proj, att.v_proj, part.out_proj))
        layer.q_norm, layer.k_norm = self._norm(part.q_norm), self._norm(part.k_norm)
        layer.qk_norm_all_heads = int(part.q_norm is not None
                                      and part.q_norm.weight.numel() != self.head_dim)
        layer.keys, layer.values = self.k[index].data_ptr(), self.v[index].data_ptr()

    def _convolution(self, part: _Layer, index: int, layer: DecodeLayer) -> None:
        """A short-convolution layer's projections, weight, bias and state."""
        conv, k = part.conv, self.conv.shape[-1]
        if conv.conv.kernel_size[0] != k:
            raise _Unsupported("convolutions of different kernel sizes")
        weight = conv.conv.weight.detach().float().reshape(self.hidden, k).contiguous()
        self.keep.append(weight)
        layer.kind = LAYER_CONVOLUTION
        layer.in_proj, layer.out_proj = self._product(conv.in_proj), self._product(conv.out_proj)
        layer.conv_weight, layer.conv_bias = weight.data_ptr(), self._vector(conv.conv.bias)
        layer.conv_state, layer.conv_kernel = self.conv[index].data_ptr(), k

    def _mlp(self, part: _Layer, layer: DecodeLayer) -> None:
        """A dense MLP's products, or routed experts' router, banks, top k, renormalisation and
        intermediate size (and LFM2-MoE's sigmoid router: its expert bias and scaling)."""
        if part.dense_mlp is not None:
            layer.mlp_kind = MLP_DENSE
            layer.gate, layer.up, layer.down = map(self._product, part.dense_mlp)
            return
        if part.hybrid_moe is not None:
            return self._hybrid_moe(part.hybrid_moe, layer)
        experts, router = part.mlp.experts, part.mlp.gate
        banks = (getattr(experts, "gate_up_proj", None), experts.down_proj)
        if not (all(isinstance(b, QuantExpertBank) for b in banks) and experts.has_gate
                and experts.is_concatenated and not experts.is_transposed
                and not experts.has_bias and not experts.has_post_expert_norm
                and DEFAULT_APPLY_GATE is not None
                and type(experts)._apply_gate is DEFAULT_APPLY_GATE
                and getattr(experts.config, "hidden_act", "silu") == "silu"):
            raise _Unsupported("experts the native step does not run")
        layer.mlp_kind = MLP_EXPERTS
        layer.router = self._dense(router.weight)
        layer.expert_gate, layer.expert_down = (self._pairs(b, along_groups=True) for b in banks)
        layer.top_k, layer.expert_intermediate = router.top_k, banks[0].layout.logical_shape[1] // 2
        layer.renormalize = int(getattr(router, "norm_topk_prob", True))
        if part.lfm2:
            layer.router_kind = ROUTER_SIGMOID
            layer.expert_bias = self._vector(part.mlp.expert_bias if part.mlp.use_expert_bias
                                             else None)
            layer.routed_scaling = float(router.routed_scaling_factor)

    def _hybrid_moe(self, moe: nn.Module, layer: DecodeLayer) -> None:
        """The reference hybrid's MoE: the x @ W[e] banks, a shared expert in gate/up/down, a
        softmax router whose top k is renormalised."""
        banks = (moe.w1, moe.w3, moe.w2)
        if not all(isinstance(b, QuantExpertBank) for b in banks):
            raise _Unsupported("experts the native step does not run")
        layer.mlp_kind = MLP_HYBRID_EXPERTS
        layer.gate, layer.up, layer.down = map(self._product, (moe.sw1, moe.sw3, moe.sw2))
        layer.router = self._dense(moe.gate.weight)
        layer.expert_gate, layer.expert_up, layer.expert_down = (
            self._pairs(b, along_groups=False) for b in banks)
        layer.top_k, layer.renormalize = moe.top_k, 1
        layer.expert_intermediate = banks[0].layout.logical_shape[2]

    def _pairs(self, bank: QuantExpertBank, along_groups: bool) -> ctypes._Pointer:
        """A bank's pair kernels' descriptor (a copy of ExpertPairs' own), split over the kernel
        pool as the step's products are."""
        prepared = bank._prepared(along_groups=along_groups)
        if prepared is None:
            raise _Unsupported("an expert bank without its pair kernels")
        block = ExpertPairsBlock.from_buffer_copy(prepared[0].block)
        block.min_work, block.threads = STEP_PARALLEL_MIN_ELEMENTS, native.kernel_threads()
        self.keep += [prepared[0], block]
        return ctypes.pointer(block)

    def _norm(self, module: nn.Module | None) -> int:
        return 0 if module is None else self._vector(module.weight)

    def _vector(self, weight: torch.Tensor | None) -> int:
        """The address of a float32 copy of a vector (0 for None), kept alive."""
        if weight is None:
            return 0
        w = weight.detach().float().contiguous()
        self.keep.append(w)
        return w.data_ptr()

    @staticmethod
    def _rows(module: nn.Module) -> int:
        if isinstance(module, TiedQuantHead):
            return module.embedding[0].num_embeddings
        return module.out_features

    def _product(self, module: nn.Module) -> ctypes._Pointer:
        """A product descriptor for a Linear or tied head."""
        bias = self._vector(getattr(module, "bias", None))
        packed = module.embedding[0] if isinstance(module, TiedQuantHead) else module
        if isinstance(packed, PackedWeight):
            fast = packed.one_token_product()
            if fast is None:
                raise _Unsupported(f"{type(module).__name__} has no one-token kernel")
            block = PackedBlock.from_buffer_copy(fast.block)
            block.threads = native.threads_for(fast.rows * fast.n, STEP_PARALLEL_MIN_ELEMENTS)
            self.keep += [fast, block]
            kind = (PRODUCT_PACKED_Q8 if fast.int8 else PRODUCT_PACKED_Q16 if fast.int16
                    else PRODUCT_PACKED)
            return self._descriptor(kind, ctypes.addressof(block), fast.rows, fast.n, bias)
        if isinstance(module, (nn.Linear, StoredLinear)):
            return self._dense(module.weight, bias)
        raise _Unsupported(f"no native product for {type(module).__name__}")

    def _dense(self, weight: torch.Tensor, bias: int = 0) -> ctypes._Pointer:
        """A product descriptor for a dense float32 or bf16 matrix."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.ndim != 2:
            raise _Unsupported(f"no native product for a {weight.dtype} matrix")
        w = weight.detach().contiguous()
        self.keep.append(w)
        kind = PRODUCT_DENSE_F32 if w.dtype == torch.float32 else PRODUCT_DENSE_BF16
        return self._descriptor(kind, w.data_ptr(), *w.shape, bias)

    def _descriptor(self, kind: int, weight: int, rows: int, cols: int, bias: int
                    ) -> ctypes._Pointer:
        product = Product(weight=weight, bias=bias, rows=rows, cols=cols, kind=kind,
                          threads=native.threads_for(rows * cols, STEP_PARALLEL_MIN_ELEMENTS))
        self.keep.append(product)
        return ctypes.pointer(product)


class _Unsupported(Exception):
    """A module the native step cannot run (the model then keeps transformers' forward)."""


class NativeDecode:
    """``model.forward`` with native decode steps (see the module's docstring). An object
    holding the model, not a closure: a deep copy of the model gets its own."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__doc__ = type(model).forward.__doc__
        self.program: _Program | None = None
        self.cache: weakref.ref | None = None  # the DynamicCache the native copy continues
        self.length = 0  # positions in the native copy
        self.supported: bool | None = None  # whether the modules can run natively (checked once)

    def __deepcopy__(self, memo: dict) -> NativeDecode:
        """The copied model's own, from a fresh start (a program's descriptors hold the
        original's addresses)."""
        twin = NativeDecode.__new__(NativeDecode)
        memo[id(self)] = twin
        twin.__init__(copy.deepcopy(self.model, memo))
        twin.supported = self.supported
        return twin

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self._native_step(args, kwargs, cache):
            return self._step(kwargs["input_ids"], cache, kwargs.get("cache_position"))
        if self.cache is not None and self.cache() is cache and cache is not None:
            self._write_back(cache)
        return type(self.model).forward(self.model, *args, **kwargs)

    def _native_step(self, args: tuple, kwargs: dict[str, Any], cache: Any) -> bool:
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        return (not args and isinstance(ids, torch.Tensor) and ids.shape == (1, 1)
                and (mask is None or bool(mask.all()))  # padding: transformers' masks
                and type(cache) is DynamicCache and cache.get_seq_length() > 0
                and not torch.is_grad_enabled() and kwargs.get("inputs_embeds") is None
                and kwargs.get("labels") is None and not kwargs.get("output_attentions")
                and not kwargs.get("output_hidden_states")
                and kwargs.get("use_cache", True) is not False
                and os.environ.get("DYNQUANT_NATIVE_DECODE", "1") != "0"
                and native.library() is not None and self._ready())

    def _ready(self) -> bool:
        """Whether the model's modules can be run natively (checked once, kept)."""
        if self.supported is None:
            try:
                _Program(self.model, 1)
                self.supported = True
            except _Unsupported:
                self.supported = False
        return self.supported

    def _start(self, cache: DynamicCache, pos: int) -> None:
        """A native copy of ``cache`` (its first ``pos`` positions) in a fresh program."""
        capacity = max(FIRST_CAPACITY, 2 * (pos + 1))
        prog = self.program = _Program(self.model, capacity)
        for i, layer in enumerate(cache.layers):
            if (a := prog.attention[i]) is not None:
                prog.k[a, :, :pos] = layer.keys[0, :, :pos]
                prog.v[a, :, :pos] = layer.values[0, :, :pos]
            if (c := prog.convolution[i]) is not None and (state := cache.get_conv_state(i)) \
                    is not None:
                prog.conv[c] = state[0, :, -prog.conv.shape[-1]:].float()
        self.cache, self.length = weakref.ref(cache), pos

    def _grow(self) -> None:
        old = self.program
        self.program = _Program(self.model, 2 * old.capacity)
        self.program.k[:, :, :old.capacity] = old.k
        self.program.v[:, :, :old.capacity] = old.v
        self.program.conv.copy_(old.conv)

    def _step(self, ids: torch.Tensor, cache: DynamicCache, cache_position: Any
              ) -> CausalLMOutputWithPast:
        ours = self.cache is not None and self.cache() is cache
        if cache_position is not None:
            pos = int(cache_position[0])
        else:  # transformers derives positions from the cache, whose length we keep here
            pos = self.length if ours else cache.get_seq_length()
        if not ours or pos != self.length:
            self._start(cache, pos)
        if self.length >= self.program.capacity:
            self._grow()
        prog = self.program
        h = self.model.model.embed_tokens(ids).reshape(-1).float().contiguous()
        logits = torch.empty(prog.vocab)
        rc = native.library().dq_decode_step(ctypes.byref(prog.program), h.data_ptr(),
                                             self.length, logits.data_ptr())
        if rc:
            raise RuntimeError(f"dq_decode_step failed ({rc})")
        self.length += 1
        return CausalLMOutputWithPast(logits=logits.view(1, 1, -1), cache=cache)

    def _write_back(self, cache: DynamicCache) -> None:
        """The native keys, values and convolution states into ``cache``, which then stands on
        its own again."""
        n, prog = self.length, self.program
        for i, layer in enumerate(cache.layers):
            if (a := prog.attention[i]) is not None:
                dtype = layer.keys.dtype
                layer.keys = prog.k[a, :, :n].unsqueeze(0).to(dtype).contiguous()
                layer.values = prog.v[a, :, :n].unsqueeze(0).to(dtype).contiguous()
            if (c := prog.convolution[i]) is not None and (state := cache.get_conv_state(i)) \
                    is not None:
                state[0, :, -prog.conv.shape[-1]:].copy_(prog.conv[c])
        self.cache, self.program, self.length = None, None, 0


def use_native_decode(model: nn.Module) -> nn.Module:
    """Wrap ``model.forward`` with :class:`NativeDecode` where the family is supported (the
    modules are checked at the first decode step); returns the model."""
    if supports(model.config) and hasattr(model, "model"):
        model.forward = NativeDecode(model)
    return model


def has_native_decode(model: nn.Module) -> bool:
    """Whether ``model`` takes native decode steps (its family, modules and the kernels)."""
    fwd = model.__dict__.get("forward")
    return isinstance(fwd, NativeDecode) and native.library() is not None and fwd._ready()


__all__ = ["FAMILIES", "NativeDecode", "has_native_decode", "supports", "use_native_decode"]
