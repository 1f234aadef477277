"""``dynquant.load``: a dynquant checkpoint -> a ready transformers model with packed modules."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dynquant.checkpoint.reader import Checkpoint, open_checkpoint
from dynquant.errors import CheckpointError
from dynquant.models.embedding_scale import embedding_scale
from dynquant.models.registration import register
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.runtime.activations import use_activations
from dynquant.runtime.decode_threads import one_thread_decode
from dynquant.runtime.empty_init import parameters_on_meta
from dynquant.runtime.experts import use_packed_experts
from dynquant.runtime.native_decode import supports as supports_native_decode
from dynquant.runtime.native_decode import use_native_decode
from dynquant.runtime.packed_modules import (
    PackedWeight,
    QuantEmbedding,
    QuantExpertBank,
    QuantLinear,
    TiedQuantHead,
)
from dynquant.runtime.stored_linear import StoredLinear


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def packed_module_for(model: nn.Module, name: str, ck_layout, dtype: torch.dtype
                      ) -> tuple[nn.Module, str, PackedWeight]:
    """Which packed module replaces quantized module ``name``, and where it goes. Models that
    decode natively (``runtime/native_decode.py``) keep the format's codes in every Linear:
    the int4 kernel's layout serves only transformers' bf16 forward."""
    parent, attr = _parent(model, name)
    target = getattr(parent, attr, None)
    if isinstance(target, nn.Linear):
        bias = None if target.bias is None else torch.empty_like(target.bias, device="meta")
        return parent, attr, QuantLinear(ck_layout, bias, dtype,
                                         use_int4=not supports_native_decode(model.config))
    if isinstance(target, nn.Embedding):
        return parent, attr, QuantEmbedding(ck_layout, dtype, target.padding_idx,
                                            embedding_scale(target))
    if isinstance(target, nn.Parameter) and target.ndim == 3:
        return parent, attr, QuantExpertBank(ck_layout, dtype)
    raise CheckpointError(f"the model has no Linear, Embedding or 3-D parameter here "
                          f"(found {type(target).__name__})", module=name)


def install_packed_modules(model: nn.Module, layouts: dict, dtype: torch.dtype
                           ) -> dict[str, PackedWeight]:
    """Replace every quantized module (name -> LayerLayout) with its packed module."""
    packed = {}
    for name, layout in layouts.items():
        parent, attr, module = packed_module_for(model, name, layout, dtype)
        if attr in parent._parameters:
            del parent._parameters[attr]
        setattr(parent, attr, module)
        packed[name] = module
    return packed


def _load_tensors(model: nn.Module, ck: Checkpoint, packed: dict[str, PackedWeight],
                  dtype: torch.dtype, stored: set[str] = frozenset()) -> None:
    state = {}
    for name in packed:
        for part in ("qweight", "scales", "offsets"):
            state[f"{name}.{part}"] = ck.tensor(f"{name}.{part}")
    state.update(_dense_state(ck, dtype, stored))
    _assign_state(model, ck, state)


def install_stored_linears(model: nn.Module, ck: Checkpoint, dtype: torch.dtype) -> set[str]:
    """Dense Linears whose weight the file stores in bfloat16 become ``StoredLinear`` (held as
    stored) when the model computes in float32; their weights' names. Tied heads keep the
    embedding's weight."""
    if dtype != torch.float32:
        return set()
    stored = set()
    for name in ck.dense_names():
        module_name, _, part = name.rpartition(".")
        if part != "weight" or module_name in ck.tied or ck.tensor(name).dtype != torch.bfloat16:
            continue
        parent, attr = _parent(model, module_name)
        target = getattr(parent, attr, None)
        if type(target) is nn.Linear:
            setattr(parent, attr, StoredLinear(target.in_features, target.out_features,
                                               target.bias is not None))
            stored.add(name)
    return stored


def _assign_state(model: nn.Module, ck: Checkpoint, state: dict[str, torch.Tensor]) -> None:
    """Assign ``state`` to the model; a tensor the model does not have is an error."""
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise CheckpointError(f"tensors the model does not have: {unexpected[:5]}",
                              file=str(ck.path))


def _dense_state(ck: Checkpoint, dtype: torch.dtype, stored: set[str] = frozenset()
                 ) -> dict[str, torch.Tensor]:
    """The checkpoint's dense tensors, floats in the compute dtype except ``stored`` (kept as
    the file holds them)."""
    return {name: t.to(dtype) if t.is_floating_point() and name not in stored else t
            for name, t in ((n, ck.tensor(n)) for n in ck.dense_names())}


def _tie_head(model: nn.Module, ck: Checkpoint, dtype: torch.dtype) -> None:
    if "lm_head" not in ck.tied:
        return
    embed = model.get_input_embeddings()
    if isinstance(embed, QuantEmbedding):
        model.lm_head = TiedQuantHead(embed)
    else:
        model.lm_head.weight = embed.weight


def _check_materialised(model: nn.Module, ck: Checkpoint) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise CheckpointError("tensor missing from the checkpoint", file=str(ck.path),
                                  module=name)


def model_config(path: Path) -> PretrainedConfig:
    register()
    config = AutoConfig.from_pretrained(str(path))
    # The checkpoint is loaded by dynquant itself, not by a transformers quantizer.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def empty_model(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The model's skeleton: parameters on the meta device, real buffers."""
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        # Expert banks are indexed one expert at a time (``bank[e]``): the eager path does that;
        # load() then selects the packed pairs path for decode (runtime/experts.py).
        model.set_experts_implementation("eager")
    return model


def load(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None,
         activations: str | None = None) -> nn.Module:
    """A ready model (eval mode) whose quantizable modules are packed modules.

    ``dtype``: the compute dtype (``"bfloat16"``, ``"float32"``, a torch dtype); ``None`` or
    ``"auto"`` picks bfloat16 only where the CPU has native bf16 dot products
    (``numerics/compute_dtype.py``). ``activations``: ``"int8"``, ``"float"`` or ``"auto"`` (int8
    from 4 bits, int16 below, where the CPU has VNNI or AVX2) for the decode products
    (``runtime/activations.py``; ``None``: ``$DYNQUANT_ACTIVATIONS``, else ``"auto"``)."""
    from dynquant.openmp import warn_if_too_late

    warn_if_too_late()
    dtype = resolve_dtype(dtype)
    ck = open_checkpoint(path)
    config = model_config(Path(path))
    model = empty_model(config, dtype)
    packed = install_packed_modules(model, ck.layers, dtype)
    stored = install_stored_linears(model, ck, dtype)
    _load_tensors(model, ck, packed, dtype, stored)
    _tie_head(model, ck, dtype)
    _check_materialised(model, ck)
    for module in packed.values():
        if isinstance(module, QuantLinear):
            module.prepare()
    use_packed_experts(model)
    use_activations(model, activations)
    if device == "cpu":
        use_native_decode(model)
        one_thread_decode(model, dtype)
    return model.to(device).eval()


def load_dequantized(path: str | Path, dtype: str | torch.dtype | None = None) -> nn.Module:
    """The float model holding the checkpoint's dequantized weights: the reference that the packed
    model is held to (and how other tools' outputs are evaluated). ``dtype`` as for :func:`load`."""
    dtype = resolve_dtype(dtype)
    ck = open_checkpoint(path)
    config = model_config(Path(path))
    model = empty_model(config, dtype)
    state = {}
    for name in ck.layers:
        parent, attr = _parent(model, name)
        key = name if isinstance(getattr(parent, attr), nn.Parameter) else f"{name}.weight"
        state[key] = ck.dequantize(name, dtype)
    state.update(_dense_state(ck, dtype))
    _assign_state(model, ck, state)
    if "lm_head" in ck.tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    _check_materialised(model, ck)
    return model.eval()
