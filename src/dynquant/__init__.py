"""dynquant: sensitivity-driven mixed-precision group-wise quantization for language models."""

__version__ = "0.1.0"

from dynquant.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint, write_checkpoint
from dynquant.errors import CheckpointError, DynquantError, ModelError, QuantizationError
from dynquant.format.planner import TensorSpec, plan_document
from dynquant.format.validate import validate_checkpoint, validate_metadata
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "DynquantError",
    "ModelError",
    "QuantizationError",
    "QuantizedTensor",
    "TensorSpec",
    "__version__",
    "open_checkpoint",
    "plan_document",
    "quantize_tensor",
    "validate_checkpoint",
    "validate_metadata",
    "write_checkpoint",
]
