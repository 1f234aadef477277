"""A decoder block's group scales and offsets tuned against the float block (``--quantizer
tuned``): GPTQ's codes, then their scales and offsets moved to lower the block's output error.

Within the sequential pass (``sequential_gptq.py``), once a block's tensors have their GPTQ
codes: every calibration window's output of the *float* block on the *float* model's hidden
states is the target, and the block with its codes, run on the quantized model's hidden states
(what it will see), is fitted to it. So each block also absorbs what the blocks before it got
wrong (AutoRound's and EfficientQAT's block-wise reconstruction). Adam, one window a step in a
seeded order, the step size falling linearly to zero; every quantized tensor of the block at
once (a bank's every expert: each sees the tokens routed to it). The tuned scales are kept only
where they lower the block's error over all windows (at 8 bits a bf16 scale's step can be
larger than the error it tunes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from dynquant.freed_memory import reusing_freed_memory
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.numerics.tuned_scales import TunableScales
from dynquant.pipeline.calibrate.block_stream import BlockStream, first_output


@dataclass(frozen=True)
class ScaleTuning:
    """How a block's scales are tuned (part of the codes' identity: the resume digest)."""

    steps: int = 100  # one calibration window each
    # Adam's step on the scale and offset factors (relative to the scale) of 3-bit codes;
    # ``lr * 7 / max_code`` at other widths, so that the top code moves about as far in
    # quantization steps at every width
    lr: float = 3e-3
    seed: int = 0


def block_error(outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """Mean squared difference over every window (float64 sum: any order, same value)."""
    total = sum(float((o - t).double().pow(2).sum()) for o, t in zip(outputs, targets,
                                                                       strict=True))
    return total / sum(t.numel() for t in targets)


def tune_block(stream: BlockStream, index: int, codes: dict[str, QuantizedTensor],
               hidden: list[torch.Tensor], targets: list[torch.Tensor], tuning: ScaleTuning,
               say: Callable[[str], None] = lambda _: None) -> dict[str, QuantizedTensor]:
    """Block ``index``'s ``codes`` (parameter path inside the block -> codes) with scales and
    offsets fitted so that the block on ``hidden`` gives ``targets``."""
    block = stream.blocks[index]
    params = {name: block.get_parameter(name) for name in codes}
    tunables = {name: TunableScales(qt) for name, qt in codes.items()}
    opt = torch.optim.Adam([{"params": list(t.parameters()), "width": 7 / t.max_code}
                            for t in tunables.values()], lr=tuning.lr)
    gen = torch.Generator().manual_seed(tuning.seed * 1_000_003 + index)
    order = torch.randint(len(hidden), (tuning.steps,), generator=gen).tolist()
    with reusing_freed_memory():  # each step frees and makes the same large tensors
        for step, k in enumerate(order):
            for group in opt.param_groups:
                group["lr"] = tuning.lr * group["width"] * (1 - step / tuning.steps)
            weights = {name: _shaped(t(), params[name]) for name, t in tunables.items()}
            args, kwargs = stream.calls[index][k]
            out = first_output(functional_call(block, weights, (hidden[k].to(stream.dtype),
                                                                 *args), kwargs))
            loss = (out.float() - targets[k]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 10 == 0:
                say(f"tuning scales, step {step}/{tuning.steps}")
    return {name: t.codes() for name, t in tunables.items()}


def _shaped(w_hat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    return w_hat.reshape(param.shape).to(param.dtype)
