"""Sequential error-compensating quantization: GPTQ as its authors and GPTQModel run it.

The calibration sequences stream through the model one decoder block at a time (``BlockStream``),
each block's input being the output of the blocks *already quantized*. Inside a block the
Linear modules are taken in the order the forward reaches them, in groups that read the same
input (q/k/v, then o, then gate/up, then down): each group's input second moments X^T X are
gathered with every earlier group already holding its quantized weights, so the compensation of
a module also absorbs the error of everything before it. The block's other quantized tensors
(convolutions, expert banks) are rounded to nearest first, with the calibration importance.

Each finished module goes straight into the quantization's resume store, which the writer then
reads; a killed run resumes at the first unfinished group (finished blocks run once more, from
their stored codes, to give the next block its input). Cost per block: one forward per group,
stopped at the group's last module, and one whole forward for the block's output.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.progress import Progress
from torch import nn

from dynquant.checkpoint.resume import ResumeStore
from dynquant.format.planner import TensorSpec
from dynquant.numerics.gptq import gptq_quantize
from dynquant.numerics.quantizer import QuantizedTensor
from dynquant.pipeline.block_stream import BlockStream

Choice = Callable[[str], tuple[int, int]]  # module -> (bits, group size)
Rounder = Callable[[TensorSpec, torch.Tensor, int, int], QuantizedTensor]


@dataclass(frozen=True)
class SequentialCalibration:
    """The token windows the sequential pass streams (the calibration text's, tokenized)."""

    ids: torch.Tensor  # [sequences, length]

    def digest(self) -> str:
        return hashlib.sha256(self.ids.numpy().tobytes()).hexdigest()


class _GroupDone(Exception):
    """Raised after the group's last module has seen its input: the rest of the block waits."""


def sequential_gptq(stream: BlockStream, specs: list[TensorSpec], quantized: set[str],
                    choice: Choice, rounder: Rounder, store: ResumeStore,
                    progress: bool = False) -> int:
    """Quantize the ``quantized`` modules inside the decoder blocks into ``store`` (index =
    the tensor's position in ``specs``); returns how many were compensated."""
    index = {s.module: i for i, s in enumerate(specs) if s.module in quantized}
    compensated = 0
    hidden = stream.record()
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("gptq, block by block", total=len(stream.blocks))
        for b, block in enumerate(stream.blocks):
            prefix = stream.block_prefix(b) + "."
            mine = [s for s in specs if s.module in index and s.module.startswith(prefix)]
            stream.materialize(block, prefix[:-1])
            try:
                linears = {s.module: block.get_submodule(s.module[len(prefix):]) for s in mine
                           if _is_linear(block, s.module[len(prefix):], s)}
                groups = _groups(stream, b, hidden[0], linears)
                reached = {m for g in groups for m in g}
                for s in mine:  # the rest first, to nearest: their errors feed the groups
                    if s.module not in reached:
                        qt = _finished(store, index[s.module]) or rounder(
                            s, _param(block, s, prefix).data, *choice(s.module))
                        _keep(store, index[s.module], s, qt, _param(block, s, prefix))
                for group in groups:
                    compensated += _quantize_group(stream, b, hidden, group, linears, specs,
                                                   index, choice, store)
                hidden = stream.run_block(b, hidden)
            finally:
                stream.release(block)
            bar.advance(task)
    return compensated


def _quantize_group(stream: BlockStream, b: int, hidden: list[torch.Tensor], group: list[str],
                    linears: dict[str, nn.Linear], specs: list[TensorSpec], index: dict,
                    choice: Choice, store: ResumeStore) -> int:
    done = {m: _finished(store, index[m]) for m in group}
    moments = None if all(done.values()) else _group_moments(stream, b, hidden, group, linears)
    for m in group:
        weight = linears[m].weight
        qt = done[m] or gptq_quantize(weight.data.float(), moments[m], *choice(m))
        _keep(store, index[m], specs[index[m]], qt, weight)
    return sum(1 for m in group if done[m] is None)


def _keep(store: ResumeStore, i: int, spec: TensorSpec, qt: QuantizedTensor,
          param: nn.Parameter) -> None:
    """Store the codes (unless they came from the store) and run the block with them."""
    if store.load(i) is None:
        store.save_quantized(i, spec.module, qt)
    param.data = qt.dequantize(torch.float32).reshape(param.shape).to(param.dtype)


def _finished(store: ResumeStore, i: int) -> QuantizedTensor | None:
    saved = store.load(i)
    if saved is None or saved[0] != "quantized":
        return None
    _, _, meta, loaders = saved
    q, s, o = (loaders[n]() for n in loaders)
    return QuantizedTensor(q, s, o, meta.logical_shape, meta.bits, meta.group_size,
                           meta.clipped_fraction, meta.clip_improvement)


def _is_linear(block: nn.Module, rel: str, spec: TensorSpec) -> bool:
    """A plain Linear whose weight is this tensor (2-D, [out, in], as stored)."""
    try:
        mod = block.get_submodule(rel)
    except AttributeError:
        return False
    return (isinstance(mod, nn.Linear) and spec.name.endswith(".weight")
            and tuple(mod.weight.shape) == tuple(spec.shape))


def _param(block: nn.Module, spec: TensorSpec, prefix: str) -> nn.Parameter:
    return block.get_parameter(spec.name[len(prefix):])


def _groups(stream: BlockStream, b: int, first: torch.Tensor, linears: dict[str, nn.Linear]
            ) -> list[list[str]]:
    """The Linears in the order the block's forward reaches them, grouped by shared input
    (those it never reaches are left out: they round to nearest)."""
    seen: list[tuple[str, tuple]] = []
    alive: list[torch.Tensor] = []  # no input freed and its memory reused by a later one

    def hook(name):
        def fn(_mod, inputs):
            x = inputs[0]
            alive.append(x)
            seen.append((name, (x.data_ptr(), tuple(x.shape), tuple(x.stride()))))
        return fn

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    args, kwargs = stream.args[b][0]
    try:
        with torch.no_grad():
            stream.blocks[b](first.to(stream.dtype), *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    groups: dict[tuple, list[str]] = {}
    for name, key in seen:
        if all(name not in g for g in groups.values()):
            groups.setdefault(key, []).append(name)
    return list(groups.values())


def _group_moments(stream: BlockStream, b: int, hidden: list[torch.Tensor], group: list[str],
                   linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """X^T X / tokens of the input the modules of ``group`` share, over every calibration
    chunk, the block run only as far as that input."""
    width = linears[group[0]].in_features
    total, count = torch.zeros(width, width), 0

    def hook(_mod, inputs):
        nonlocal count
        x = inputs[0].detach().float().reshape(-1, width)
        total.addmm_(x.T, x)
        count += x.shape[0]
        raise _GroupDone

    handle = linears[group[0]].register_forward_pre_hook(hook)
    block = stream.blocks[b]
    try:
        with torch.no_grad():
            for h, (args, kwargs) in zip(hidden, stream.args[b], strict=True):
                with contextlib.suppress(_GroupDone):
                    block(h.to(stream.dtype), *args, **kwargs)
    finally:
        handle.remove()
    moments = total / max(count, 1)
    return dict.fromkeys(group, moments)
