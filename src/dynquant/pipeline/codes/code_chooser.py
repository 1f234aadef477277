"""How a module's codes are chosen when a checkpoint is written.

``rtn``: round-to-nearest with the per-group clip search, its error weighted by the calibration
statistics (the column mean squares) when there are any. ``tuned``: sequential GPTQ's codes with
each block's scales and offsets tuned against the float block (``tuned_scales.py``; where it is
not sequential, as gptq). ``gptq``: error-compensating
quantization (``numerics/gptq.py``) of the 2-D Linears, two ways:

- sequential (what ``quantize --quantizer gptq`` writes; ``sequential`` set): the calibration
  windows stream through the blocks as they are quantized, each module compensated against the
  inputs the quantized model before it gives (``pipeline/codes/sequential_gptq.py``);
- from stored second moments (what ``measure --quantizer gptq`` prices candidates with;
  ``moments`` set): X^T X / n of the *float* model's inputs, written by the calibration pass
  (``MAPS_STEM.moments/block_NNN.safetensors``), each module on its own.

Untied input embeddings and modules without moments round to nearest (the sequential pass
also compensates the output head, a tied embedding included).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from dynquant.errors import DynquantError
from dynquant.format.planner import TensorSpec
from dynquant.numerics.gptq import gptq_quantize, ordered_factor, output_error
from dynquant.numerics.quantizer import QuantizedTensor, quantize_tensor, relative_error
from dynquant.pipeline.calibrate.priors import block_index
from dynquant.pipeline.calibrate.statistics import importance_of
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration

QUANTIZERS = ("rtn", "gptq", "tuned")
SEQUENTIAL = ("gptq", "tuned")  # codes of the sequential pass over calibration windows


def check_quantizer(name: str) -> None:
    if name not in QUANTIZERS:
        raise DynquantError(f"unknown quantizer {name!r} (one of {', '.join(QUANTIZERS)})",
                            field="quantizer")


class SecondMoments:
    """X^T X / n per Linear, read from the per-block files when a module asks for its own."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise DynquantError("gptq needs the input second moments of a calibrated measure "
                                "(dynquant measure --quantizer gptq or --second-moments)",
                                file=str(directory))
        self.directory = directory

    def get(self, module: str) -> torch.Tensor | None:
        block = block_index(module)
        path = None if block is None else self.directory / f"block_{block:03d}.safetensors"
        if path is None or not path.is_file():
            return None
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(module) if module in f.keys() else None  # noqa: SIM118

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in sorted(self.directory.glob("block_*.safetensors")):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
        return h.hexdigest()


class GivenMoments:
    """One module's second moments, handed over with its job (a worker on another machine
    cannot read the driver's files)."""

    def __init__(self, module: str, hessian: torch.Tensor) -> None:
        self.module, self.hessian = module, hessian

    def get(self, module: str) -> torch.Tensor | None:
        return self.hessian if module == self.module else None


@dataclass
class CodeChooser:
    quantizer: str = "rtn"
    importance: Mapping[str, torch.Tensor] = field(default_factory=dict)
    moments: SecondMoments | GivenMoments | None = None
    sequential: SequentialCalibration | None = None
    _cached: tuple[str, torch.Tensor] | None = field(default=None, repr=False)

    def quantize(self, spec: TensorSpec, tensor: torch.Tensor, bits: int, group_size: int
                 ) -> QuantizedTensor:
        """The codes alone (what ``quantize`` writes: no error is computed)."""
        return self._codes(spec, tensor, bits, group_size)[0]

    def quantize_with_error(self, spec: TensorSpec, tensor: torch.Tensor, bits: int,
                            group_size: int, weighted: bool = True
                            ) -> tuple[QuantizedTensor, float]:
        """The codes, and the error the allocator prices them at: for a compensated module the
        relative output error over its calibration inputs, else the relative weight error,
        weighted per input column by the statistics (unless ``weighted`` is False)."""
        qt, hessian, cols = self._codes(spec, tensor, bits, group_size)
        if hessian is not None:
            return qt, output_error(tensor, qt, hessian)
        return qt, relative_error(tensor, qt, cols if weighted else None)

    def _codes(self, spec: TensorSpec, tensor: torch.Tensor, bits: int, group_size: int
               ) -> tuple[QuantizedTensor, torch.Tensor | None, torch.Tensor | None]:
        """(codes, the second moments they were compensated with or None, the column
        importance they were rounded with or None)."""
        hessian = (self.moments.get(spec.module)
                   if self.quantizer in SEQUENTIAL and self.moments is not None
                   and tensor.ndim == 2
                   else None)
        if hessian is not None:
            return (gptq_quantize(tensor.float(), hessian, bits, group_size,
                                  factor=self._factor(spec.module, hessian)), hessian, None)
        cols = importance_of(dict(self.importance), spec.module, spec.shape)
        return quantize_tensor(tensor, bits, group_size, importance=cols), None, cols

    def _factor(self, module: str, hessian: torch.Tensor) -> torch.Tensor:
        """The inverse factor of the last module asked for: a measure quantizes each module at
        every candidate width in a row, with the same second moments."""
        if self._cached is None or self._cached[0] != module:
            self._cached = (module, ordered_factor(hessian))
        return self._cached[1]

    def digest(self) -> str:
        """What decides the codes besides the weights and widths (for resuming)."""
        h = hashlib.sha256(self.quantizer.encode())
        for name in sorted(self.importance):
            h.update(name.encode())
            h.update(self.importance[name].float().numpy().tobytes())
        if self.moments is not None:
            h.update(self.moments.digest().encode())
        if self.sequential is not None:
            h.update(self.sequential.digest().encode())
        return h.hexdigest()
