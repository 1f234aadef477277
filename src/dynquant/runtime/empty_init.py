"""Build a model without allocating its parameters (buffers stay real and small).

Like accelerate's ``init_empty_weights``: parameters are created on the meta device, so a model
skeleton costs no memory; buffers (rotary frequencies, masks) are computed for real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original
