"""Calibration text and statistics: token windows, and per-input-column mean squared activations.

The statistics (``stats.safetensors``: module -> [in_features] float32) weight the quantizer's
error by how strongly each input column is driven (the importance in quantize_tensor); expert
banks add their routed-token counts and per-expert input statistics.
"""

from __future__ import annotations

import hashlib
from importlib import resources
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


DEFAULT_TEXT = "calibration_default.txt"  # in the package's data folder (data/README.md)
BUNDLED_TEXT = f"dynquant:{DEFAULT_TEXT}"  # its name in calibration records


def default_calibration() -> Path:
    """The generic English text dynquant ships for calibration without ``--calib``."""
    return Path(str(resources.files("dynquant.data").joinpath(DEFAULT_TEXT)))


def calibration_record(files: list[str | Path], seqs: int, length: int) -> dict:
    """What a measurement calibrated on, for maps.json and the checkpoint's provenance: the
    texts (by file name; the bundled one as ``dynquant:calibration_default.txt``), the SHA-256
    of their joined text, and the token windows taken from it."""
    bundled = default_calibration()
    names = [BUNDLED_TEXT if Path(f) == bundled else Path(f).name for f in files]
    digest = hashlib.sha256("\n\n".join(read_calibration(files)).encode()).hexdigest()
    return {"texts": names, "sha256": digest, "sequences": seqs, "tokens_per_sequence": length}


SYNTHETIC_SEED = 0


def synthetic_ids(vocab_size: int, seqs: int, length: int) -> torch.Tensor:
    """Uniform random token ids [seqs, length], seeded: the data-free path's input. No text,
    yet the model's own structure (which channels its norms and outlier features drive) shows
    in the per-column statistics it gives the quantizer."""
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    return torch.randint(0, vocab_size, (seqs, length), generator=gen)


def synthetic_record(seqs: int, length: int) -> dict:
    return {"synthetic": f"uniform random token ids, seed {SYNTHETIC_SEED}", "sequences": seqs,
            "tokens_per_sequence": length}


def calibration_ids(tokenizer, files: list[str | Path], seqs: int, length: int) -> torch.Tensor:
    """``seqs`` windows of ``length`` tokens, evenly spread over the text: [seqs, length]."""
    texts = read_calibration(files)
    ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"], dtype=torch.long)
    if len(ids) < length:
        raise ModelError(f"calibration text has {len(ids)} tokens, fewer than one sequence of "
                         f"{length}", file=str(files[0]))
    starts = torch.linspace(0, len(ids) - length, seqs).long().unique()
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


class InputStatistics:
    """Forward hooks that gather, per quantizable Linear, the mean squared input of each column
    (the quantizer's importance) and optionally the input second-moment matrix X^T X; and per
    expert bank, the tokens routed to each expert and each expert's mean squared input.

    The same hooks serve a whole-model run and the block-streamed one (``block_stream.py``):
    they only see module inputs, whichever way the model runs."""

    def __init__(self, model: nn.Module, modules: set[str], second_moments: bool = False) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.moments: dict[str, torch.Tensor] = {}
        self.routed: dict[str, torch.Tensor] = {}
        self.second = second_moments
        self.hooks = []
        for name, module in model.named_modules():
            if name in modules and isinstance(module, nn.Linear):
                self.hooks.append(module.register_forward_hook(self._linear(name)))
            banks = [f"{name}.{p}" for p, t in module.named_parameters(recurse=False)
                     if t.ndim == 3 and f"{name}.{p}" in modules]
            if banks:
                self.hooks.append(module.register_forward_hook(self._bank(name, module)))

    def _linear(self, name: str):
        def fn(_module, inputs, _output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            self.sums[name] = self.sums.get(name, 0) + x.square().sum(0)
            self.counts[name] = self.counts.get(name, 0) + x.shape[0]
            if self.second:
                self.moments[name] = self.moments.get(name, 0) + x.T @ x
        return fn

    def _bank(self, name: str, module: nn.Module):
        def fn(_module, inputs, _output):
            routing = expert_routing(module, inputs)
            if routing is None:
                return
            x, experts = routing
            count = torch.bincount(experts.reshape(-1), minlength=_experts(module))
            sq = torch.zeros(len(count), x.shape[-1]).index_add_(
                0, experts.reshape(-1), x.square().repeat_interleave(experts.shape[-1], 0))
            key = f"{name}.routed_tokens"
            self.routed[key] = self.routed.get(key, 0) + count
            self.sums[f"{name}.expert_inputs"] = self.sums.get(f"{name}.expert_inputs", 0) + sq
        return fn

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def partial(self) -> dict[str, dict]:
        """The raw sums so far (a shard of the calibration sequences), for ``add``."""
        return {"sums": self.sums, "counts": self.counts, "moments": self.moments,
                "routed": self.routed}

    def add(self, part: dict[str, dict]) -> None:
        """Fold a shard's raw sums into these. Shards folded in the same order give the same
        bits however they were computed (0 + x is x: one shard is exactly the hooks' sums)."""
        for key in ("sums", "counts", "moments", "routed"):
            mine = getattr(self, key)
            for name, value in part[key].items():
                mine[name] = mine.get(name, 0) + value

    def result(self) -> dict[str, torch.Tensor]:
        """module -> [in] mean squares; ``BANKS.routed_tokens`` -> [E] counts (float32) and
        ``BANKS.expert_inputs`` -> [E, in] per-expert mean squares of the routed tokens."""
        out = {}
        for name, total in self.sums.items():
            if name.endswith(".expert_inputs"):
                tokens = self.routed[name.removesuffix(".expert_inputs") + ".routed_tokens"]
                out[name] = total / tokens.clamp(min=1)[:, None]
            else:
                out[name] = total / self.counts[name]
        out.update({k: v.float() for k, v in self.routed.items()})
        return {k: out[k].contiguous() for k in sorted(out)}

    def second_moments(self) -> dict[str, torch.Tensor]:
        """module -> X^T X / tokens [in, in] (empty unless asked for)."""
        return {k: (v / self.counts[k]).contiguous() for k, v in sorted(self.moments.items())}


def _experts(module: nn.Module) -> int:
    return next(p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3)


def expert_routing(module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens [N, H] float32, routed experts [N, k]) of an expert-bank module's call: a
    transformers experts module (called with hidden states and top-k indices) or the reference
    hybrid model's MoE block (routes with its own ``gate``)."""
    if len(inputs) >= 2 and inputs[1].dtype in (torch.int64, torch.int32):
        x, experts = inputs[0], inputs[1]
    elif hasattr(module, "gate") and hasattr(module, "top_k"):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        experts = module.gate(x).float().topk(module.top_k, dim=-1).indices
    else:
        return None
    x = x.detach().float().reshape(-1, x.shape[-1])
    return x, experts.reshape(x.shape[0], -1).long()


def collect_stats(model: nn.Module, ids: torch.Tensor, modules: set[str]
                  ) -> dict[str, torch.Tensor]:
    """Input statistics (``InputStatistics.result``) of a whole model run on ``ids``."""
    stats = InputStatistics(model, modules)
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None])
    finally:
        stats.remove()
    return stats.result()


# 3-D expert parameters [E, out, in] whose input is the tokens routed to the expert (the
# transformers names); the others (down projections, the reference model's [E, in, out] banks)
# read activations no hook sees, and stay unweighted.
FIRST_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj")


def importance_of(stats: dict[str, torch.Tensor], module: str, shape: tuple[int, ...]
                  ) -> torch.Tensor | None:
    """The quantizer's importance for ``module`` of ``shape``: its column statistics, or for an
    expert bank's first projection each expert's own routed inputs ([E, in]; an expert no
    calibration token reached takes the bank's token-weighted mean)."""
    if module in stats:
        return stats[module]
    owner, _, leaf = module.rpartition(".")
    per, tokens = stats.get(f"{owner}.expert_inputs"), stats.get(f"{owner}.routed_tokens")
    if (per is None or tokens is None or leaf not in FIRST_PROJECTIONS or len(shape) != 3
            or tuple(per.shape) != (shape[0], shape[-1])):
        return None
    mean = (per * tokens[:, None]).sum(0) / tokens.sum().clamp(min=1)
    return torch.where(tokens[:, None] > 0, per, mean)


def save_stats(stats: dict[str, torch.Tensor], path: Path) -> None:
    save_file(stats, str(path), metadata={"format": "dynquant-stats"})
