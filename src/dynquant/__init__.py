"""dynquant: sensitivity-driven mixed-precision group-wise quantization for language models."""

__version__ = "0.1.0"

from dynquant.api import allocate, measure, quantize
from dynquant.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint, write_checkpoint
from dynquant.errors import CheckpointError, DynquantError, ModelError, QuantizationError
from dynquant.format.planner import TensorSpec, plan_document
from dynquant.format.validate import validate_checkpoint, validate_metadata
from dynquant.models.registration import register as _register_models
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor
from dynquant.pipeline.evaluate import EvalResult, evaluate
from dynquant.runtime.hf_integration import register_with_transformers as _register_hf
from dynquant.runtime.loader import load, load_dequantized

# After `import dynquant`, transformers' Auto classes know the reference architecture and
# AutoModelForCausalLM.from_pretrained loads dynquant checkpoints.
_register_models()
_register_hf()

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
