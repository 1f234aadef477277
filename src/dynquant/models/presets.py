"""Built-in architecture presets: ``seed`` (the seed checkpoint's model) and small test sizes."""

from __future__ import annotations

from dynquant.errors import ModelError
from dynquant.models.hybrid.configuration import DynquantHybridConfig

PRESETS: dict[str, dict] = {
    # The seed's architecture: 1.69 B parameters, dense tensors 998,912 bytes in bf16.
    "seed": {},
    # A few MB: fast enough for unit tests, odd sizes included (not multiples of 128).
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, attention_layers=[1, 3],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=96, shared_intermediate_size=80),
    # Dimensions that are multiples of 128: every module quantizes without padding.
    "small": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, attention_layers=[3],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=256, shared_intermediate_size=256),
}


def preset_config(name: str) -> DynquantHybridConfig:
    if name not in PRESETS:
        raise ModelError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}", file=name)
    return DynquantHybridConfig(**PRESETS[name])
