"""Tiny random instances of every supported family, built from config classes (no downloads).

Odd sizes on purpose: hidden 64 (< group size) and intermediate 172 (not a multiple of 128).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dynquant.models.presets import preset_config
from dynquant.models.registration import register
from scripts.bpe_tokenizer import train_bpe_tokenizer

COMMON = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def family_configs() -> dict:
    register()
    return {
        "llama": LlamaConfig(**COMMON, intermediate_size=172, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**COMMON, intermediate_size=172, head_dim=16,
                             tie_word_embeddings=True),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, intermediate_size=172, moe_intermediate_size=96,
                                    num_experts=4, num_experts_per_tok=2, head_dim=16),
        "mixtral": MixtralConfig(**COMMON, intermediate_size=172, num_local_experts=4,
                                 num_experts_per_tok=2),
        "olmoe": OlmoeConfig(**COMMON, intermediate_size=172, num_experts=4,
                             num_experts_per_tok=2),
        "lfm2": Lfm2Config(**COMMON, intermediate_size=172, block_auto_adjust_ff_dim=False,
                           layer_types=["conv", "full_attention"]),
        "lfm2_moe": Lfm2MoeConfig(**COMMON, intermediate_size=172, moe_intermediate_size=96,
                                  num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                  layer_types=["conv", "full_attention"]),
        "dynquant_hybrid": preset_config("tiny"),
        # a scaled tied embedding, (1 + w) norms, sliding and full attention layers
        "gemma3": Gemma3TextConfig(**COMMON, intermediate_size=172, head_dim=16,
                                   layer_types=["sliding_attention", "full_attention"],
                                   sliding_window=8, tie_word_embeddings=True),
    }


def save_tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    """A random model of ``family`` saved with save_pretrained (bf16 safetensors)."""
    torch.manual_seed(seed)
    config = family_configs()[family]
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # some families initialise experts to zero; give every weight signal
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


TOKENIZER_TEXT = (
    "Once upon a time there was a little fox who lived in the forest. Every morning the fox "
    "went to the river to drink, and every evening it came home to sleep under the old oak. "
    "One day the fox met a rabbit, and the two became friends. They played in the grass and "
    "told each other stories about the stars, the moon and the wide, wide sea. "
) * 4


def save_tiny_tokenizer(out: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer trained on a short text, saved for transformers."""
    train_bpe_tokenizer([TOKENIZER_TEXT], vocab_size, out)
