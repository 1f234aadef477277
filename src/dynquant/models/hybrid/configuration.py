"""Configuration of the reference hybrid architecture, the seed checkpoint's model family."""

from __future__ import annotations

from transformers import PretrainedConfig


class DynquantHybridConfig(PretrainedConfig):
    """Short-convolution and attention layers, each followed by a MoE block with a shared expert.

    Defaults are the seed's dimensions (1.69 B parameters): 24 layers, hidden 1024, attention at
    layers 3, 7, ..., 23 (16 heads of 64, 4 KV heads), 16 routed experts of width 1152 plus a
    shared expert of width 1152, vocabulary 151936, tied embeddings.
    """

    model_type = "dynquant_hybrid"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        attention_layers: list[int] | None = None,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 4,
        head_dim: int = 64,
        conv_kernel_size: int = 3,
        num_experts: int = 16,
        num_experts_per_tok: int = 4,
        moe_intermediate_size: int = 1152,
        shared_intermediate_size: int = 1152,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 1_000_000.0,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.attention_layers = (
            list(attention_layers) if attention_layers is not None
            else list(range(3, num_hidden_layers, 4))
        )
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.conv_kernel_size = conv_kernel_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_intermediate_size = shared_intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        # LFM2-style layer types: transformers' DynamicCache keeps conv state for "conv" layers.
        self.layer_types = ["full_attention" if i in self.attention_layers else "conv"
                            for i in range(num_hidden_layers)]
        kwargs.pop("layer_types", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
