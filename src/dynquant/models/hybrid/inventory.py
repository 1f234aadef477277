"""The tensors of the reference hybrid architecture, by name and shape, from its config alone."""

from __future__ import annotations

from dynquant.format.planner import TensorSpec
from dynquant.models.hybrid.configuration import DynquantHybridConfig


def _layer_specs(cfg: DynquantHybridConfig, i: int) -> list[TensorSpec]:
    h, p = cfg.hidden_size, f"model.layers.{i}"
    specs = [TensorSpec(f"{p}.operator_norm.weight", (h,)), TensorSpec(f"{p}.ffn_norm.weight", (h,))]
    if i in cfg.attention_layers:
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        specs += [
            TensorSpec(f"{p}.self_attn.q_proj.weight", (nq * d, h), quantizable=True),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (nkv * d, h), quantizable=True),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (nkv * d, h), quantizable=True),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (h, nq * d), quantizable=True),
            TensorSpec(f"{p}.self_attn.q_norm.weight", (d,)),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (d,)),
        ]
    else:
        specs += [
            TensorSpec(f"{p}.conv.in_proj.weight", (3 * h, h), quantizable=True),
            TensorSpec(f"{p}.conv.conv.weight", (h, 1, cfg.conv_kernel_size)),
            TensorSpec(f"{p}.conv.out_proj.weight", (h, h), quantizable=True),
        ]
    e, inter, shared = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    specs += [
        TensorSpec(f"{p}.moe.gate.weight", (e, h)),
        TensorSpec(f"{p}.moe.w1", (e, h, inter), quantizable=True),
        TensorSpec(f"{p}.moe.w3", (e, h, inter), quantizable=True),
        TensorSpec(f"{p}.moe.w2", (e, inter, h), quantizable=True),
        TensorSpec(f"{p}.moe.sw1.weight", (shared, h), quantizable=True),
        TensorSpec(f"{p}.moe.sw3.weight", (shared, h), quantizable=True),
        TensorSpec(f"{p}.moe.sw2.weight", (h, shared), quantizable=True),
    ]
    return specs


def hybrid_tensor_specs(cfg: DynquantHybridConfig) -> list[TensorSpec]:
    """Every stored tensor (the tied lm_head is not stored), quantizable ones marked."""
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size),
                        quantizable=True)]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i)
    specs.append(TensorSpec("model.norm.weight", (cfg.hidden_size,)))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    return specs
