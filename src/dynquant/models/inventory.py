"""Which tensors of a transformers model are quantizable, read off a meta-device instance.

Rules (what an HQQ / llama.cpp user expects): the input embedding, every ``nn.Linear`` weight and
every 3-D fused expert tensor are quantizable; norms, routers (2-D parameters of non-Linear
modules, or Linear layers named ``gate``/``router`` that score experts), biases, conv kernels and
buffers stay dense. An untied lm_head is quantizable (``modules_to_not_convert`` keeps it dense, as
it does any module); a tied one is not stored.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from dynquant.format.planner import TensorSpec

ROUTER_NAMES = ("gate", "router")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_router(name: str, module: nn.Module, config: PretrainedConfig) -> bool:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return (name.rsplit(".", 1)[-1] in ROUTER_NAMES and isinstance(module, nn.Linear)
            and experts is not None and module.out_features == experts)


def classify(model: nn.Module, config: PretrainedConfig, lm_head_quantized: bool = True
             ) -> list[TensorSpec]:
    """Every parameter of ``model`` (tied duplicates once), quantizable ones marked."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    specs = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # a tied lm_head shares the embedding's parameter: stored once
            seen.add(id(param))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if module is head and module is not embed:
                quantizable = lm_head_quantized and p_name == "weight"
            elif module is embed or (isinstance(module, nn.Linear) and p_name == "weight"):
                quantizable = not _is_router(mod_name, module, config)
            elif isinstance(module, nn.Conv1d | nn.Conv2d):
                quantizable = False
            else:
                quantizable = param.ndim == 3  # fused expert banks [E, out, in]
            specs.append(TensorSpec(name, tuple(param.shape), _dtype_name(param.dtype),
                                    quantizable))
    return specs


def meta_model(config: PretrainedConfig) -> nn.Module:
    """An instance without storage: shapes and module types only, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def transformers_specs(config: PretrainedConfig, lm_head_quantized: bool = True
                       ) -> list[TensorSpec]:
    return classify(meta_model(config), config, lm_head_quantized)
