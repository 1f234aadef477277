"""The reference hybrid model: short convolutions and attention, each followed by a MoE block.

Read top to bottom, small pieces first (after nanoGPT's model.py). Shapes: B batch, T tokens,
H hidden, E experts, I expert width. Module names are the seed checkpoint's contract.
The cache is transformers' ``DynamicCache`` built from ``config.layer_types`` (as for LFM2):
attention layers keep keys/values, conv layers keep their last ``kernel`` inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from dynquant.models.hybrid.configuration import DynquantHybridConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        d = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with RMS-normed queries and keys."""

    def __init__(self, cfg: DynquantHybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.d = layer_idx, cfg.head_dim
        self.nq, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nq * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nq * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], cache: Cache | None
                ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nq, self.d)).transpose(1, 2)  # (B,nq,T,d)
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        past = k.shape[2] - t
        mask = None
        if t > 1 and past > 0:  # a chunk after cached tokens: causal with an offset
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=t > 1 and past == 0, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.nq * self.d))


class ShortConv(nn.Module):
    """y = out_proj(C * conv(B * x)), with B, C, x = in_proj(input) and a causal depthwise conv."""

    def __init__(self, cfg: DynquantHybridConfig, layer_idx: int) -> None:
        super().__init__()
        h, self.k, self.layer_idx = cfg.hidden_size, cfg.conv_kernel_size, layer_idx
        self.in_proj = nn.Linear(h, 3 * h, bias=False)
        self.conv = nn.Conv1d(h, h, self.k, groups=h, bias=False, padding=self.k - 1)
        self.out_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        t = x.shape[1]
        b_gate, c_gate, xs = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)  # (B, H, T) each
        u = b_gate * xs
        if cache is not None:  # prepend the cached inputs, keep the last k for the next step
            u = cache.update_conv_state(u, self.layer_idx, conv_kernel_size=self.k)
        if t == 1 and u.shape[-1] >= self.k:  # decode: one output, the last k inputs . kernel
            # (a conv1d call's oneDNN set-up costs far more than this one dot product per channel)
            y = (u[..., -self.k:] * self.conv.weight[:, 0, :]).sum(-1, keepdim=True)
        else:
            y = F.conv1d(u, self.conv.weight, groups=u.shape[1], padding=self.k - 1)
            y = y[..., u.shape[-1] - t : u.shape[-1]]  # the outputs of the current tokens
        return self.out_proj((c_gate * y).transpose(1, 2))


# Up to this many (token, expert) pairs, the routed experts run pair by pair (decode) instead of
# grouping tokens by expert (torch.where + index_add_ per routed expert: overhead per expert).
FEW_PAIRS = 32


def pairs_matmul(x: torch.Tensor, bank: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Row p: ``x[p] @ bank[experts[p]]``. A packed bank (``runtime.packed_modules``) does every
    pair in one kernel call; a dense one multiplies views of its experts (no gathered copy)."""
    packed = getattr(bank, "pairs_matmul", None)
    y = packed(x, experts) if packed is not None else None
    if y is not None:
        return y
    return torch.stack([x[p] @ bank[e] for p, e in enumerate(experts.tolist())])


def grouped_matmul(xs: list[torch.Tensor], bank: torch.Tensor, experts: list[int]
                   ) -> list[torch.Tensor]:
    """``[xs[i] @ bank[experts[i]]]``. A packed bank dequantizes its experts a run at a time for
    a long bf16 prefill (``grouped_matmul``); otherwise expert by expert."""
    packed = getattr(bank, "grouped_matmul", None)
    ys = packed(xs, experts) if packed is not None else None
    return ys if ys is not None else [x @ bank[e] for x, e in zip(xs, experts, strict=True)]


class MoE(nn.Module):
    """Softmax top-k routing over expert banks (SwiGLU, ``x @ W[e]``) plus a shared expert."""

    def __init__(self, cfg: DynquantHybridConfig) -> None:
        super().__init__()
        h, e, i, s = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                      cfg.shared_intermediate_size)
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(h, e, bias=False)  # the router, kept dense
        self.w1 = nn.Parameter(torch.empty(e, h, i))
        self.w3 = nn.Parameter(torch.empty(e, h, i))
        self.w2 = nn.Parameter(torch.empty(e, i, h))
        self.sw1 = nn.Linear(h, s, bias=False)
        self.sw3 = nn.Linear(h, s, bias=False)
        self.sw2 = nn.Linear(s, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        probs = self.gate(flat).float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if self.training:  # switch-style load balancing: share of tokens x mean probability
            share = F.one_hot(experts, probs.shape[-1]).float().sum((0, 1)) / experts.numel()
            self.aux_loss = probs.shape[-1] * (share * probs.mean(0)).sum()
        out = self.sw2(F.silu(self.sw1(flat)) * self.sw3(flat))
        if experts.numel() <= FEW_PAIRS and not self.training:
            return (out + self._few_pairs(flat, experts, weights)).view_as(x)
        ids = experts.unique().tolist()  # only the experts tokens are routed to
        routed = [torch.where(experts == e) for e in ids]  # (token, slot) of each
        hs = [flat[token] for token, _ in routed]
        acts = [F.silu(a) * b for a, b in zip(grouped_matmul(hs, self.w1, ids),
                                              grouped_matmul(hs, self.w3, ids), strict=True)]
        for (token, slot), y in zip(routed, grouped_matmul(acts, self.w2, ids), strict=True):
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view_as(x)

    def _few_pairs(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                   ) -> torch.Tensor:
        """The routed experts' sum for a few tokens: pair p = (token p // k, slot p % k)."""
        ids = experts.reshape(-1)
        h = flat.repeat_interleave(self.top_k, dim=0)
        act = F.silu(pairs_matmul(h, self.w1, ids)) * pairs_matmul(h, self.w3, ids)
        y = pairs_matmul(act, self.w2, ids) * weights.reshape(-1, 1)
        return y.view(flat.shape[0], self.top_k, -1).sum(dim=1)


class Block(nn.Module):
    def __init__(self, cfg: DynquantHybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_attention = layer_idx in cfg.attention_layers
        if self.is_attention:
            self.self_attn = Attention(cfg, layer_idx)
        else:
            self.conv = ShortConv(cfg, layer_idx)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], cache: Cache | None
                ) -> torch.Tensor:
        h = self.operator_norm(x)
        x = x + (self.self_attn(h, rope, cache) if self.is_attention else self.conv(h, cache))
        return x + self.moe(self.ffn_norm(x))


class DynquantHybridPreTrainedModel(PreTrainedModel):
    config_class = DynquantHybridConfig
    config: DynquantHybridConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d):
            module.weight.normal_(0.0, std)
        elif isinstance(module, MoE):
            for p in (module.w1, module.w3, module.w2):
                p.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, Rotary):  # from_pretrained builds buffers on meta: recompute
            module.inv_freq.copy_(module.frequencies())


class DynquantHybridModel(DynquantHybridPreTrainedModel):
    def __init__(self, config: DynquantHybridConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, cache: Cache | None = None,
                use_cache: bool = False, **kwargs) -> BaseModelOutputWithPast:
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        x = self.embed_tokens(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        positions = (torch.arange(input_ids.shape[1], device=x.device) + past)[None]
        rope = self.rotary(positions, x.dtype)
        for block in self.layers:
            x = block(x, rope, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache)


class DynquantHybridForCausalLM(DynquantHybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DynquantHybridConfig) -> None:
        super().__init__(config)
        self.model = DynquantHybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, cache: Cache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids, cache=cache if cache is not None else past_key_values,
                         use_cache=bool(use_cache))
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
