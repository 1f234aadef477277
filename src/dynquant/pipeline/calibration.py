"""Calibration text and statistics: token windows, and per-input-column mean squared activations.

The statistics (``stats.safetensors``: module -> [in_features] float32) weight the quantizer's
error by how strongly each input column is driven (the importance in quantize_tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dynquant.errors import ModelError


def read_calibration(files: list[str | Path]) -> list[str]:
    """The texts of the calibration files; a missing or empty file is an error."""
    texts = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ModelError("no such calibration file", file=str(path))
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ModelError("the calibration file is empty", file=str(path))
        texts.append(text)
    return texts


def calibration_ids(tokenizer, files: list[str | Path], seqs: int, length: int) -> torch.Tensor:
    """``seqs`` windows of ``length`` tokens, evenly spread over the text: [seqs, length]."""
    texts = read_calibration(files)
    ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"], dtype=torch.long)
    if len(ids) < length:
        raise ModelError(f"calibration text has {len(ids)} tokens, fewer than one sequence of "
                         f"{length}", file=str(files[0]))
    starts = torch.linspace(0, len(ids) - length, seqs).long().unique()
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


def collect_stats(model: nn.Module, ids: torch.Tensor, modules: set[str]
                  ) -> dict[str, torch.Tensor]:
    """Mean squared input activation per column of every Linear named in ``modules``."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hook(name: str):
        def fn(_module, inputs, _output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.square().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return fn

    for name, module in model.named_modules():
        if name in modules and isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None])
    finally:
        for h in hooks:
            h.remove()
    return {name: (sums[name] / counts[name]).contiguous() for name in sorted(sums)}


def save_stats(stats: dict[str, torch.Tensor], path: Path) -> None:
    save_file(stats, str(path), metadata={"format": "dynquant-stats"})
