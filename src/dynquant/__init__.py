"""dynquant: sensitivity-driven mixed-precision group-wise quantization for language models.

The public names below are imported on first use (PEP 562), so that ``import dynquant`` and the
commands that need no model (``dynquant validate``, ``inspect``) do not import torch and
transformers. Registration with transformers' Auto classes happens when transformers is imported
(``autoregister.py``): after ``import dynquant``, ``AutoModelForCausalLM.from_pretrained`` loads
dynquant checkpoints.
"""

from __future__ import annotations

import importlib
from typing import Any

from dynquant.blas_kernels import choose_blas_kernels
from dynquant.openmp import set_short_spin

set_short_spin()  # before anything imports torch (dynquant/openmp.py)
choose_blas_kernels()  # before numpy, scipy or torch run a product (dynquant/blas_kernels.py)

from dynquant.autoregister import register_when_transformers_loads  # noqa: E402
from dynquant.errors import (  # noqa: E402
    CheckpointError,
    DynquantError,
    ModelError,
    QuantizationError,
)
from dynquant.version import package_version  # noqa: E402

__version__ = package_version()

_LAZY = {
    "allocate": "dynquant.api",
    "measure": "dynquant.api",
    "quantize": "dynquant.api",
    "Checkpoint": "dynquant.checkpoint",
    "CheckpointWriter": "dynquant.checkpoint",
    "open_checkpoint": "dynquant.checkpoint",
    "write_checkpoint": "dynquant.checkpoint",
    "TensorSpec": "dynquant.format.planner",
    "plan_document": "dynquant.format.planner",
    "validate_checkpoint": "dynquant.format.validate",
    "validate_metadata": "dynquant.format.validate",
    "QuantizedTensor": "dynquant.numerics.quantizer",
    "quantize_tensor": "dynquant.numerics.quantizer",
    "EvalResult": "dynquant.pipeline.report.evaluate",
    "evaluate": "dynquant.pipeline.report.evaluate",
    "load": "dynquant.runtime.loader",
    "load_dequantized": "dynquant.runtime.loader",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dynquant' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


register_when_transformers_loads()

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "DynquantError",
    "EvalResult",
    "ModelError",
    "QuantizationError",
    "QuantizedTensor",
    "TensorSpec",
    "__version__",
    "allocate",
    "evaluate",
    "load",
    "load_dequantized",
    "measure",
    "open_checkpoint",
    "plan_document",
    "quantize",
    "quantize_tensor",
    "validate_checkpoint",
    "validate_metadata",
    "write_checkpoint",
]
