"""Mapping a transformers model's parameter names to the tensors its checkpoint stores.

transformers (v5) fuses per-expert weights into 3-D banks in memory (``experts.gate_up_proj``
[E, 2I, H]) while checkpoints keep one tensor per expert (``experts.3.gate_proj.weight``), and
renames some modules (Mixtral's ``block_sparse_moe`` -> ``mlp``). We read transformers' own
conversion mapping for the model and assemble each bank from its experts, one bank at a time,
so a quantization never needs the whole model in memory.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from dynquant.errors import ModelError

SUPPORTED_OPERATIONS = {("MergeModulelist", 0), ("Concatenate", 1)}


def conversion_transforms(model: nn.Module) -> list:
    """transformers' weight transforms for ``model`` (empty when it stores its own layout)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers: checkpoints are stored as modelled
        return []
    return list(get_model_conversion_mapping(model, add_legacy=False) or [])


class DiskLayout:
    """Which stored tensors make up each model parameter."""

    def __init__(self, stored: list[str], transforms: list) -> None:
        self.direct: dict[str, str] = {}
        # model name -> one {expert index: stored name} per source pattern
        self.merged: dict[str, list[dict[int, str]]] = {}
        converters = [t for t in transforms if type(t).__name__ == "WeightConverter"]
        renamings = [t for t in transforms if type(t).__name__ == "WeightRenaming"]
        for conv in converters:
            ops = {(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations}
            if not ops <= SUPPORTED_OPERATIONS:
                raise ModelError(f"unsupported checkpoint conversion {sorted(ops)}",
                                 field="conversion")
        for name in stored:
            renamed = name
            for ren in renamings:
                for src, dst in zip(ren.source_patterns, ren.target_patterns, strict=True):
                    renamed = re.sub(src, dst, renamed)
            if not self._add_merged(name, renamed, converters):
                self.direct[renamed] = name

    def _add_merged(self, stored: str, renamed: str, converters: list) -> bool:
        for conv in converters:
            for i, pattern in enumerate(conv.source_patterns):
                rx = re.escape(pattern).replace(r"\*", r"(\d+)")
                m = re.search(rx + "$", renamed)
                if m:
                    target = renamed[: m.start()] + conv.target_patterns[0]
                    slots = self.merged.setdefault(
                        target, [defaultdict(str) for _ in conv.source_patterns])
                    slots[i][int(m.group(1))] = stored
                    return True
        return False

    def names(self) -> set[str]:
        return set(self.direct) | set(self.merged)

    def assemble(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """The model parameter ``name`` built from stored tensors, or None if not stored."""
        if name in self.direct:
            return read(self.direct[name])
        if name not in self.merged:
            return None
        parts = []
        for slot in self.merged[name]:
            experts = sorted(slot)
            if experts != list(range(len(experts))):
                raise ModelError(f"experts {experts} are not 0..{len(experts) - 1}", module=name)
            parts.append(torch.stack([read(slot[e]) for e in experts]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
