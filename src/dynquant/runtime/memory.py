"""How many bytes of weights a loaded model keeps resident."""

from __future__ import annotations

from torch import nn

from dynquant.runtime.packed_modules import QuantLinear


def resident_weight_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and kernel-layout copy the model holds (each once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if isinstance(module, QuantLinear) and module._int4 is not None:
            tensors += list(module._int4)
        for t in tensors:
            if t.data_ptr() in seen or t.numel() == 0:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
