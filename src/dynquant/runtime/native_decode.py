"""Decode steps of Llama-style models (Llama, Qwen3, and the MoE Qwen3-MoE, Mixtral, OLMoE) in
one native call a token.

Through transformers' modules a decode step pays a Python dispatch for every norm, rotary,
cat, attention and module call: on small models more than the products themselves. Here the
model's ``forward`` is wrapped: a one-token forward that continues a ``DynamicCache`` (what
``generate`` does at every step) runs ``dq_llama_step`` (``numerics/native/decode_step.c``): all
layers, the final norm and the head in C, the products by dynquant's one-token kernels (int8 or
float32 activations, as the model's packed modules are set) with keys and values kept in a
float32 cache of its own. Everything else (prefill, batches, gradients, other caches, attention
or hidden-state outputs) runs transformers' forward, as does any model this module does not
recognise. So ``generate`` keeps all of its features (sampling, streamers, stopping criteria):
only its model calls change.

The cache: at the first native step of a ``DynamicCache`` its keys and values (the prompt's,
from the eager prefill) are copied in; later steps append to the native copy alone. A forward
that is not a native step and meets such a cache first writes the native keys and values back
into it, so a cache stays correct for anything that continues it through ``forward``.

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

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "olmoe")
LAYER_SLOTS = 22  # decode_step.c's layer descriptor
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


def supports(config: Any) -> bool:
    """Whether a model of this config can take native decode steps (family and features)."""
    if getattr(config, "model_type", None) not in FAMILIES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        return False
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return rope in STATIC_ROPE


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


class _Program:
    """The descriptors ``dq_llama_step`` reads, for one model and cache capacity, with every
    tensor they point into kept alive (``keep``)."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        cfg, core = model.config, model.model
        self.keep: list[Any] = []
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self.capacity = capacity
        nl = cfg.num_hidden_layers
        self.k = torch.zeros(nl, capacity, self.kv_heads, self.head_dim)
        self.v = torch.zeros_like(self.k)
        layers: list[int] = []
        for i, layer in enumerate(core.layers):
            att = layer.self_attn
            q_norm = getattr(att, "q_norm", None)
            full_qk_norm = q_norm is not None and q_norm.weight.numel() != self.head_dim
            layers += [self._norm(layer.input_layernorm), *map(self._product, (
                att.q_proj, att.k_proj, att.v_proj, att.o_proj)),
                self._norm(q_norm), self._norm(getattr(att, "k_norm", None)),
                self._norm(layer.post_attention_layernorm), *self._mlp(layer.mlp),
                int(full_qk_norm), 0]
            layers[-LAYER_SLOTS + 11:-LAYER_SLOTS + 13] = [self.k[i].data_ptr(),
                                                           self.v[i].data_ptr()]
        rotary = core.rotary_emb
        inv_freq = rotary.inv_freq.detach().float().contiguous()
        self.keep.append(inv_freq)
        self.layers = _int64s(layers)
        self.model = _int64s([nl, self.hidden, self.heads, self.kv_heads, self.head_dim,
                              cfg.intermediate_size, self._norm(core.norm),
                              self._product(model.lm_head), inv_freq.data_ptr(), capacity])
        self.vocab = self._rows(model.lm_head)
        self.scalars = (ctypes.c_float * 3)(cfg.rms_norm_eps, float(rotary.attention_scaling),
                                            self.head_dim ** -0.5)

    def _mlp(self, mlp: nn.Module) -> list[int]:
        """Slots 8-19 of a layer: a dense MLP's products (and room for the caches at 11, 12),
        or routed experts' router, banks, top k, renormalisation and intermediate size."""
        if not hasattr(mlp, "experts"):
            return [*map(self._product, (mlp.gate_proj, mlp.up_proj, mlp.down_proj)), 0, 0,
                    0, 0, 0, 0, 0, 0, 0]
        experts, router = mlp.experts, mlp.gate
        banks = (getattr(experts, "gate_up_proj", None), experts.down_proj)
        if not (all(isinstance(b, QuantExpertBank) for b in banks) and experts.has_gate
                and experts.is_concatenated and not experts.is_transposed
                and not experts.has_bias and not experts.has_post_expert_norm
                and DEFAULT_APPLY_GATE is not None
                and type(experts)._apply_gate is DEFAULT_APPLY_GATE
                and getattr(experts.config, "hidden_act", "silu") == "silu"):
            raise _Unsupported("experts the native step does not run")
        pairs = []
        for bank in banks:
            prepared = bank._prepared(along_groups=True)
            if prepared is None:
                raise _Unsupported("an expert bank without its pair kernels")
            args = (ctypes.c_int64 * len(prepared[0].args))(*prepared[0].args)
            args[9], args[10] = STEP_PARALLEL_MIN_ELEMENTS, native.kernel_threads()
            self.keep += [prepared[0], args]
            pairs.append(ctypes.addressof(args))
        inter = banks[0].layout.logical_shape[1] // 2
        return [0, 0, 0, 0, 0, 1, self._dense(router.weight), *pairs, router.top_k,
                int(getattr(router, "norm_topk_prob", True)), inter]

    def _norm(self, module: nn.Module | None) -> int:
        if module is None:
            return 0
        w = module.weight.detach().float().contiguous()
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
        self.program = _Program(self.model, capacity)
        for i, layer in enumerate(cache.layers):
            self.program.k[i, :pos] = layer.keys[0, :, :pos].transpose(0, 1).float()
            self.program.v[i, :pos] = layer.values[0, :, :pos].transpose(0, 1).float()
        self.cache, self.length = weakref.ref(cache), pos

    def _grow(self) -> None:
        old = self.program
        self.program = _Program(self.model, 2 * old.capacity)
        self.program.k[:, :old.capacity] = old.k
        self.program.v[:, :old.capacity] = old.v

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
        rc = native.library().dq_llama_step(prog.model, prog.layers, prog.scalars, h.data_ptr(),
                                            self.length, logits.data_ptr())
        if rc:
            raise RuntimeError(f"dq_llama_step failed ({rc})")
        self.length += 1
        return CausalLMOutputWithPast(logits=logits.view(1, 1, -1), cache=cache)

    def _write_back(self, cache: DynamicCache) -> None:
        """The native keys and values into ``cache``, which then stands on its own again."""
        n, prog = self.length, self.program
        for i, layer in enumerate(cache.layers):
            dtype = layer.keys.dtype
            layer.keys = prog.k[i, :n].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
            layer.values = prog.v[i, :n].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
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
