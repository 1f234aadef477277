"""The ``"dynquant"`` experts implementation for transformers' MoE models (OLMoE, Qwen3-MoE,
Mixtral, LFM2-MoE...): with packed expert banks and a few tokens (decode), every routed
(token, expert) pair is multiplied from the packed codes in one kernel call per bank, without
transformers' eager loop over experts (``torch.where`` + ``index_add_`` per routed expert); in a
long bf16 prefill, the eager loop's grouping with each bank's experts dequantized a run at a time.
Any other case (dense banks, float32 prefills, gradients, biases, post-expert norms) runs the
model's own eager forward.

Registered in transformers' ``ALL_EXPERTS_FUNCTIONS`` by ``hf_integration.register_with_transformers``
and selected by ``dynquant.load`` and ``from_pretrained`` of a dynquant checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from dynquant.runtime.packed_modules import QuantExpertBank, packed_gemm_serves

NAME = "dynquant"


def _product(bank: QuantExpertBank, x: torch.Tensor, experts: torch.Tensor,
             transposed: bool) -> torch.Tensor | None:
    return bank.pairs_matmul(x, experts) if transposed else bank.pairs_linear(x, experts)


def _packed_up_bank(module: nn.Module) -> QuantExpertBank | None:
    """The packed bank of the experts' first product, where both banks are packed and nothing
    the packed paths leave out (biases, post-expert norms, expert parallelism) is in use."""
    up_bank = module.gate_up_proj if module.has_gate else module.up_proj
    if (not isinstance(up_bank, QuantExpertBank) or not isinstance(module.down_proj, QuantExpertBank)
            or module.has_bias or module.has_post_expert_norm
            or getattr(module, "_is_expert_parallel", False)):
        return None
    return up_bank


def _routed(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """The routed experts' sum for every token, or None where this path does not apply."""
    up_bank = _packed_up_bank(module)
    if up_bank is None:
        return None
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0)  # pair p = (token p // k, slot p % k)
    up = _product(up_bank, x, ids, module.is_transposed)
    if up is None:
        return None
    h = module._apply_gate(up) if module.has_gate else module.act_fn(up)
    down = _product(module.down_proj, h, ids, module.is_transposed)
    if down is None:
        return None
    weighted = down.float() * top_k_weights.reshape(-1, 1).float()
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _grouped_product(bank: QuantExpertBank, xs: list[torch.Tensor], experts: list[int],
                     transposed: bool) -> list[torch.Tensor] | None:
    return bank.grouped_matmul(xs, experts) if transposed else bank.grouped_linear(xs, experts)


def _grouped(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """transformers' eager loop over the routed experts (same grouping, order and arithmetic),
    each bank's experts dequantized a run at a time for a long bf16 prefill
    (``QuantExpertBank.grouped_linear``); None where that does not apply."""
    up_bank = _packed_up_bank(module)
    if up_bank is None or packed_gemm_serves(hidden):  # then every expert's share is served too
        return None
    ids = [e for e in top_k_index.unique().tolist() if e < len(up_bank)]  # n: "no expert"
    routed = [torch.where((top_k_index == e).T) for e in ids]  # (slot, token) of each
    up = _grouped_product(up_bank, [hidden[token] for _, token in routed], ids,
                          module.is_transposed)
    if up is None:
        return None
    acts = [module._apply_gate(u) if module.has_gate else module.act_fn(u) for u in up]
    down = _grouped_product(module.down_proj, acts, ids, module.is_transposed)
    if down is None:
        return None
    out = torch.zeros_like(hidden)
    for (slot, token), y in zip(routed, down, strict=True):
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def packed_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                           ) -> torch.Tensor:
    """transformers' experts forward signature: (tokens, hidden), (tokens, k), (tokens, k)."""
    out = _routed(module, hidden_states, top_k_index, top_k_weights)
    if out is None:
        out = _grouped(module, hidden_states, top_k_index, top_k_weights)
    if out is not None:
        return out
    eager = type(module).forward.__wrapped__  # the class's own forward (use_experts_implementation)
    return eager(module, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, packed_experts_forward)


def use_packed_experts(model: nn.Module) -> None:
    """Select the packed experts path on a model whose experts transformers dispatches."""
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        register_experts_implementation()
        model.set_experts_implementation(NAME)
