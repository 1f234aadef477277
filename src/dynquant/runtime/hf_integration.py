"""``AutoModelForCausalLM.from_pretrained(ckpt)`` for dynquant checkpoints, after ``import dynquant``.

Registered through transformers' public API (``register_quantization_config`` /
``register_quantizer``). Before the weights load, quantized modules become packed modules whose
buffers (``M.qweight``, ``M.scales``, ``M.offsets``) are exactly the checkpoint's tensor names;
after loading, a tied lm_head is pointed at the packed embedding and 4-bit Linears are converted
to the int4 kernel's layout. The checkpoint folder is validated first, as ``dynquant.load`` does:
a broken checkpoint is a ``CheckpointError``, never a half-loaded model.

The compute dtype: ``dtype="auto"`` (or no dtype) picks bfloat16 only where the CPU has native bf16
dot products, float32 elsewhere (``numerics/compute_dtype.py``); an explicit ``torch.bfloat16`` or
``torch.float32`` is used as given.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from dynquant.format import metadata as md
from dynquant.format.layout import LayerLayout
from dynquant.format.validate import validate_checkpoint
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.runtime.activations import use_activations
from dynquant.runtime.decode_threads import one_thread_decode
from dynquant.runtime.experts import register_experts_implementation, use_packed_experts
from dynquant.runtime.native_decode import use_native_decode
from dynquant.runtime.packed_modules import QuantEmbedding, QuantLinear, TiedQuantHead

_registered = False


class DynquantConfig(QuantizationConfigMixin):
    """The ``quantization_config`` block of a dynquant checkpoint (the seed's fields)."""

    def __init__(self, modules: dict | None = None, group_size: int = 128,
                 lm_head_quantized: bool = False, modules_to_not_convert: list | None = None,
                 checkpoint_format: str = md.CHECKPOINT_FORMAT,
                 schema_version: int = md.SCHEMA_VERSION, version: str | None = None,
                 symmetric: bool = False, **kwargs: Any) -> None:
        self.quant_method = md.QUANT_METHOD
        self.checkpoint_format = checkpoint_format
        self.schema_version = schema_version
        self.version = version or md.core_version()
        self.group_size = group_size
        self.symmetric = symmetric
        self.lm_head_quantized = lm_head_quantized
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.modules = dict(modules or {})

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "checkpoint_format": self.checkpoint_format,
                "schema_version": self.schema_version, "version": self.version,
                "group_size": self.group_size, "symmetric": self.symmetric,
                "lm_head_quantized": self.lm_head_quantized,
                "modules_to_not_convert": self.modules_to_not_convert, "modules": self.modules}


def _layout_for(model: nn.Module, name: str, entry: dict, group_size: int) -> LayerLayout:
    parent_name, _, attr = name.rpartition(".")
    target = getattr(model.get_submodule(parent_name) if parent_name else model, attr)
    shape = tuple(target.weight.shape if isinstance(target, nn.Module) else target.shape)
    return LayerLayout.create(shape, entry["bits"], entry.get("group_size", group_size),
                              module=name)


def _requested_dtype() -> object:
    """What the caller of ``from_pretrained`` asked for. transformers hands the quantizer only its
    resolution of the request, where ``"auto"`` has already become the config's dtype, so the
    request itself is read from ``from_pretrained``'s frame (``dtype``, else ``torch_dtype``);
    "auto" when that frame is not found."""
    frame = inspect.currentframe()
    while frame is not None:
        local = frame.f_locals
        if frame.f_code.co_name == "from_pretrained" and "dtype" in local and "torch_dtype" in local:
            return local["dtype"] if local["dtype"] is not None else local["torch_dtype"]
        frame = frame.f_back
    return "auto"


class DynquantHfQuantizer(HfQuantizer):
    """Loads pre-quantized dynquant checkpoints into packed modules (no calibration, CPU)."""

    requires_calibration = True
    quantization_config: DynquantConfig
    compute_dtype: torch.dtype | None = None

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """None or "auto" -> the CPU's compute dtype; bfloat16 / float32 as asked."""
        requested = _requested_dtype()
        explicit = requested not in (None, "auto") and not isinstance(requested, dict)
        self.compute_dtype = resolve_dtype(dtype if explicit else None)
        return self.compute_dtype

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        from dynquant.runtime.loader import install_packed_modules

        files = kwargs.get("checkpoint_files") or []
        for folder in sorted({str(Path(f).parent) for f in files}):
            problems = validate_checkpoint(folder)
            if problems:
                raise problems[0]
        qc = self.quantization_config
        layouts = {name: _layout_for(model, name, entry, qc.group_size)
                   for name, entry in qc.modules.items()}
        install_packed_modules(model, layouts, self.compute_dtype or resolve_dtype(None))
        embed = model.get_input_embeddings()
        if isinstance(embed, QuantEmbedding) and getattr(model.config, "tie_word_embeddings",
                                                         False):
            # The head is computed from the packed embedding: there is no weight to tie.
            model.lm_head = TiedQuantHead(embed)
            model.all_tied_weights_keys = {}
        use_packed_experts(model)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.prepare()
        use_activations(model)  # "auto": $DYNQUANT_ACTIVATIONS, else the default
        use_native_decode(model)
        return one_thread_decode(model, self.compute_dtype or resolve_dtype(None))

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        return False  # the checkpoint is already packed: tensors load as they are

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register_with_transformers() -> None:
    global _registered
    if _registered:
        return
    register_quantization_config(md.QUANT_METHOD)(DynquantConfig)
    register_quantizer(md.QUANT_METHOD)(DynquantHfQuantizer)
    register_experts_implementation()
    _registered = True
