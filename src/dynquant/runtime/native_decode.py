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
from dynquant.runtime.packed_modules import PackedWeight, QuantExpertBank, TiedQuantHead
from dynquant.runtime.stored_linear import StoredLinear

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "olmoe", "lfm2", "lfm2_moe",
            "dynquant_hybrid")
# the layer types a family's native step runs (LFM2: attention and short convolutions)
LAYER_TYPES = {family: ("full_attention", "conv")
               for family in ("lfm2", "lfm2_moe", "dynquant_hybrid")}
LAYER_SLOTS = 26  # decode_step.c's layer descriptor
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


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


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
    """The descriptors ``dq_decode_step`` reads, for one model and cache capacity, with every
    tensor they point into kept alive (``keep``): keys and values for the attention layers
    (``k``, ``v``: [attention layers, kv_heads, capacity, head_dim], ``attention[i]`` the index of
    layer i or None) and the states of the convolution layers (``conv``: [convolution layers,
    hidden, K], ``convolution[i]``)."""

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
        layers: list[int] = []
        for i, part in enumerate(parts):
            slots, full_qk_norm, kind, state = (
                self._attention(part, self.attention[i]) if part.attn is not None
                else self._convolution(part, self.convolution[i]))
            mlp, router = self._mlp(part)
            layers += [self._norm(part.norm), *slots, self._norm(part.mlp_norm), *mlp,
                       full_qk_norm, kind, *router]
            layers[-LAYER_SLOTS + 11:-LAYER_SLOTS + 13] = state
        rotary = next(getattr(core, n) for n in ("rotary_emb", "pos_emb", "rotary")
                      if hasattr(core, n))  # Llama-style, LFM2-MoE, the hybrid
        inv_freq = rotary.inv_freq.detach().float().contiguous()
        self.keep.append(inv_freq)
        self.layers = _int64s(layers)
        final_norm = core.embedding_norm if hasattr(core, "embedding_norm") else core.norm
        inter = max((p.dense_mlp[0].out_features for p in parts if p.dense_mlp is not None),
                    default=getattr(cfg, "intermediate_size", 0))
        self.model = _int64s([len(parts), self.hidden, self.heads, self.kv_heads, self.head_dim,
                              inter, self._norm(final_norm), self._product(model.lm_head),
                              inv_freq.data_ptr(), capacity, native.kernel_threads(),
                              ATTENTION_PARALLEL_MIN_MACS, int(self.k.dtype == torch.float16)])
        self.vocab = self._rows(model.lm_head)
        eps = getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps
        self.scalars = (ctypes.c_float * 3)(eps, float(getattr(rotary, "attention_scaling", 1.0)),
                                            self.head_dim ** -0.5)

    def _attention(self, part: _Layer, index: int) -> tuple[list[int], int, int, list[int]]:
        """An attention layer's slots 1-6, 20 (q/k norms over all heads), 21 (kind 0) and 11-12
        (its keys and values)."""
        att = part.attn
        full_qk_norm = part.q_norm is not None and part.q_norm.weight.numel() != self.head_dim
        return ([*map(self._product, (att.q_proj, att.k_proj, att.v_proj, part.out_proj)),
                 self._norm(part.q_norm), self._norm(part.k_norm)], int(full_qk_norm), 0,
                [self.k[index].data_ptr(), self.v[index].data_ptr()])

    def _convolution(self, part: _Layer, index: int) -> tuple[list[int], int, int, list[int]]:
        """A short-convolution layer's slots (decode_step.c): 1-6, 20, 21 (kind 1), 11-12."""
        conv, k = part.conv, self.conv.shape[-1]
        if conv.conv.kernel_size[0] != k:
            raise _Unsupported("convolutions of different kernel sizes")
        weight = conv.conv.weight.detach().float().reshape(self.hidden, k).contiguous()
        bias = None if conv.conv.bias is None else conv.conv.bias.detach().float().contiguous()
        self.keep += [weight, bias]
        return ([self._product(conv.in_proj), weight.data_ptr(),
                 0 if bias is None else bias.data_ptr(), self._product(conv.out_proj), k, 0],
                0, 1, [self.conv[index].data_ptr(), 0])

    def _mlp(self, part: _Layer) -> tuple[list[int], list[int]]:
        """Slots 8-19 of a layer: a dense MLP's products (and room for the caches at 11, 12),
        or routed experts' router, banks, top k, renormalisation and intermediate size; and
        slots 22-24: the router's kind, expert bias and routed scaling factor."""
        if part.dense_mlp is not None:
            return [*map(self._product, part.dense_mlp), 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0]
        if part.hybrid_moe is not None:
            return self._hybrid_moe(part.hybrid_moe)
        experts, router = part.mlp.experts, part.mlp.gate
        banks = (getattr(experts, "gate_up_proj", None), experts.down_proj)
        if not (all(isinstance(b, QuantExpertBank) for b in banks) and experts.has_gate
                and experts.is_concatenated and not experts.is_transposed
                and not experts.has_bias and not experts.has_post_expert_norm
                and DEFAULT_APPLY_GATE is not None
                and type(experts)._apply_gate is DEFAULT_APPLY_GATE
                and getattr(experts.config, "hidden_act", "silu") == "silu"):
            raise _Unsupported("experts the native step does not run")
        pairs = [self._pairs(bank, along_groups=True) for bank in banks]
        inter = banks[0].layout.logical_shape[1] // 2
        slots = [0, 0, 0, 0, 0, 1, self._dense(router.weight), *pairs, router.top_k,
                 int(getattr(router, "norm_topk_prob", True)), inter]
        if not part.lfm2:
            return slots, [0, 0, 0, 0]
        bias = part.mlp.expert_bias if part.mlp.use_expert_bias else None
        scale = torch.tensor([float(router.routed_scaling_factor)])
        self.keep.append(scale)
        return slots, [1, self._vector(bias), scale.data_ptr(), 0]

    def _hybrid_moe(self, moe: nn.Module) -> tuple[list[int], list[int]]:
        """The reference hybrid's MoE (MLP kind 2): the shared expert in slots 8-10, the x @ W[e]
        banks' pair blocks in 15, 16 and 25, a softmax router whose top k is renormalised."""
        banks = (moe.w1, moe.w3, moe.w2)
        if not all(isinstance(b, QuantExpertBank) for b in banks):
            raise _Unsupported("experts the native step does not run")
        pairs = [self._pairs(bank, along_groups=False) for bank in banks]
        shared = [self._product(m) for m in (moe.sw1, moe.sw3, moe.sw2)]
        inter = banks[0].layout.logical_shape[2]
        return ([*shared, 0, 0, 2, self._dense(moe.gate.weight), pairs[0], pairs[1], moe.top_k,
                 1, inter], [0, 0, 0, pairs[2]])

    def _pairs(self, bank: QuantExpertBank, along_groups: bool) -> int:
        """The address of a bank's pair kernels' argument block (ExpertPairs), split over the
        kernel pool as the step's products are."""
        prepared = bank._prepared(along_groups=along_groups)
        if prepared is None:
            raise _Unsupported("an expert bank without its pair kernels")
        args = (ctypes.c_int64 * len(prepared[0].args))(*prepared[0].args)
        args[9], args[10] = STEP_PARALLEL_MIN_ELEMENTS, native.kernel_threads()
        self.keep += [prepared[0], args]
        return ctypes.addressof(args)

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

    def _product(self, module: nn.Module) -> int:
        """The address of a product descriptor (see decode_step.c) for a Linear or tied head."""
        bias = getattr(module, "bias", None)
        bias_ptr = 0
        if bias is not None:
            bias = bias.detach().float().contiguous()
            self.keep.append(bias)
            bias_ptr = bias.data_ptr()
        packed = module.embedding[0] if isinstance(module, TiedQuantHead) else module
        if isinstance(packed, PackedWeight):
            fast = packed.one_token_product()
            if fast is None:
                raise _Unsupported(f"{type(module).__name__} has no one-token kernel")
            args = (ctypes.c_int64 * len(fast.args))(*fast.args)
            args[7] = native.threads_for(fast.rows * fast.n, STEP_PARALLEL_MIN_ELEMENTS)
            self.keep += [fast, args]
            kind = 1 if fast.int8 else 4 if fast.int16 else 0
            a, rows, cols = ctypes.addressof(args), fast.rows, fast.n
        elif isinstance(module, (nn.Linear, StoredLinear)):
            return self._dense(module.weight, bias_ptr)
        else:
            raise _Unsupported(f"no native product for {type(module).__name__}")
        return self._descriptor(kind, a, rows, cols, bias_ptr)

    def _dense(self, weight: torch.Tensor, bias_ptr: int = 0) -> int:
        """A product descriptor for a dense float32 or bf16 matrix."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.ndim != 2:
            raise _Unsupported(f"no native product for a {weight.dtype} matrix")
        w = weight.detach().contiguous()
        self.keep.append(w)
        kind = 2 if w.dtype == torch.float32 else 3
        return self._descriptor(kind, w.data_ptr(), *w.shape, bias_ptr)

    def _descriptor(self, kind: int, a: int, rows: int, cols: int, bias_ptr: int) -> int:
        threads = native.threads_for(rows * cols, STEP_PARALLEL_MIN_ELEMENTS)
        desc = _int64s([kind, a, rows, cols, bias_ptr, threads])
        self.keep.append(desc)
        return ctypes.addressof(desc)


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
        rc = native.library().dq_decode_step(prog.model, prog.layers, prog.scalars, h.data_ptr(),
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
