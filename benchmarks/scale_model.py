"""A model with a 7 B model's layer shapes, built from its config class: the scale benchmarks'
model (``benchmarks/scale.py``). Llama with Qwen2-7B's shapes (hidden 3,584, MLP 18,944, 28
query / 4 KV heads of 128), random bf16 weights, N decoder layers, SmolLM2's vocabulary size
(49,152) with an untied head; the tokenizer is the reference model's (its ids are a subset of
the vocabulary: random weights do not care which words they see).

    python -m benchmarks.scale_model OUT [--layers N]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).parents[1]
TOKENIZER_FROM = ROOT / "models" / "llama-ref"


def seven_b_layer_config(layers: int = 1) -> LlamaConfig:
    return LlamaConfig(vocab_size=49_152, hidden_size=3_584, intermediate_size=18_944,
                       num_hidden_layers=layers, num_attention_heads=28, num_key_value_heads=4,
                       head_dim=128, max_position_embeddings=4_096, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)


def save_scale_model(out: Path, layers: int = 1, seed: int = 0) -> Path:
    """The 7B-shaped model with ``layers`` decoder layers, saved in bf16 shards of 2 GB with the
    reference tokenizer; weights drawn N(0, 0.02) as transformers initialises them."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(seven_b_layer_config(layers),
                                                 dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, max_shard_size="2GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args()
    save_scale_model(args.out, args.layers)


if __name__ == "__main__":
    main()
