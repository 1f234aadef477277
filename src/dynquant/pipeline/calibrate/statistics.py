"""Input statistics: per-input-column mean squared activations of every quantizable Linear.

The statistics (``stats.safetensors``: module -> [in_features] float32) weight the quantizer's
error by how strongly each input column is driven (the importance in quantize_tensor); expert
banks add their routed-token counts and per-expert input statistics.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dynquant.numerics.float32_sums import add_product, product_input
from dynquant.numerics.gram import GramAccumulator
from dynquant.pipeline.calibrate.bank_products import BankProducts


class InputStatistics:
    """Forward hooks that gather, per quantizable Linear, the mean squared input of each column
    (the quantizer's importance) and optionally the input second-moment matrix X^T X; and per
    expert bank, the tokens routed to each expert, each expert's mean squared input and
    optionally its own X^T X, from the products each expert's routed tokens go through
    (``BankProducts``, entered for the forward of the module that owns the banks: up and down
    projections alike, whatever the routing code).

    The same hooks serve a whole-model run and the block-streamed one (``block_stream.py``):
    they only see module inputs, whichever way the model runs."""

    def __init__(self, model: nn.Module, modules: set[str], second_moments: bool = False) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.moments: dict[str, GramAccumulator | torch.Tensor] = {}  # Linear | bank
        self.routed: dict[str, torch.Tensor] = {}
        self.second = second_moments
        self._last: tuple[torch.Tensor, str] | None = None  # the last input, its reader
        self.hooks = []
        self._active: list[BankProducts] = []
        for name, module in model.named_modules():
            if name in modules and isinstance(module, nn.Linear):
                self.hooks.append(module.register_forward_hook(self._linear(name)))
            banks = [p for p, t in module.named_parameters(recurse=False)
                     if t.ndim == 3 and f"{name}.{p}" in modules]
            if banks:
                self._watch(module, name, banks)

    def _linear(self, name: str):
        def fn(_module, inputs, _output):
            self.observe(name, inputs[0])
        return fn

    def observe(self, name: str, source: torch.Tensor, second: bool = True) -> None:
        """Linear ``name``'s input ``source`` [..., in]: its squares summed (and its X^T X, when
        the statistics gather second moments and ``second``)."""
        x = source.detach().float().reshape(-1, source.shape[-1])
        self.sums[name] = self.sums.get(name, 0) + x.square().sum(0)
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        if self.second and second:
            self._gram(name, source)

    def _gram(self, name: str, source: torch.Tensor) -> None:
        """Add x^T x to ``name``'s moments (``source`` as it is: a bf16 pass's inputs are
        multiplied as bf16); Linears that read the same input (q/k/v, gate/up) share one
        accumulator (summed once, by the first of them)."""
        if self._last is not None and self._last[0] is source:
            self.moments[name] = self.moments[self._last[1]]
            return
        self._last = (source, name)
        if name not in self.moments:
            self.moments[name] = GramAccumulator(source.shape[-1])
        self.moments[name].add(source)

    def _watch(self, module: nn.Module, name: str, banks: list[str]) -> None:
        """The banks' products seen for the duration of ``module``'s forward (the banks looked
        up then: a streamed run puts new parameters in place for each block)."""
        def enter(_module, _inputs):
            watched = {f"{name}.{p}": module.get_parameter(p) for p in banks}
            mode = BankProducts(watched, self._expert)
            mode.__enter__()
            self._active.append(mode)

        def leave(_module, _inputs, _output):
            self._active.pop().__exit__(None, None, None)

        self.hooks.append(module.register_forward_pre_hook(enter))
        self.hooks.append(module.register_forward_hook(leave, always_call=True))

    def _expert(self, bank: str, expert: int, x: torch.Tensor, rows: bool) -> None:
        """One expert's product: its routed tokens ``x`` [tokens, in]."""
        x = product_input(x.detach().reshape(-1, x.shape[-1]))
        tokens = f"{bank}.routed_tokens"
        if tokens not in self.routed:
            experts = self._active[-1].banks[bank].shape[0]
            self.routed[tokens] = torch.zeros(experts, dtype=torch.long)
            self.sums[_expert_key(bank, rows)] = torch.zeros(experts, x.shape[1])
            if self.second:
                self.moments[bank] = torch.zeros(experts, x.shape[1], x.shape[1])
        self.routed[tokens][expert] += x.shape[0]
        self.sums[_expert_key(bank, rows)][expert] += x.float().square().sum(0)
        if self.second:  # summed into in place, as sequential GPTQ's moments always were
            add_product(self.moments[bank][expert], x.T, x)

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
        for key in ("sums", "counts", "routed"):
            mine = getattr(self, key)
            for name, value in part[key].items():
                mine[name] = mine.get(name, 0) + value
        folded: dict[int, str] = {}  # a shared accumulator is folded once
        for name, value in part["moments"].items():
            if id(value) in folded:
                self.moments[name] = self.moments[folded[id(value)]]
                continue
            folded[id(value)] = name
            if name not in self.moments:
                self.moments[name] = value
            elif isinstance(value, GramAccumulator):
                self.moments[name].add_sum(value)
            else:
                self.moments[name] = self.moments[name] + value

    def result(self) -> dict[str, torch.Tensor]:
        """module -> [in] mean squares; per expert bank ``BANK.routed_tokens`` -> [E] counts
        (float32) and ``BANK.expert_inputs`` -> [E, in] each expert's mean squares of its
        routed inputs (``BANK.expert_row_inputs`` for a bank used as ``x @ bank[e]``, whose
        inputs run along its rows, not along the format's groups)."""
        out = {}
        for name, total in self.sums.items():
            bank = _bank_of(name)
            if bank is not None:
                out[name] = total / self.routed[f"{bank}.routed_tokens"].clamp(min=1)[:, None]
            else:
                out[name] = total / self.counts[name]
        out.update({k: v.float() for k, v in self.routed.items()})
        return {k: out[k].contiguous() for k in sorted(out)}

    def second_moments(self) -> dict[str, torch.Tensor]:
        """module -> X^T X / tokens [in, in]; bank -> [E, in, in], each expert's over its own
        routed tokens (empty unless asked for). Read once: the sums are consumed."""
        out = {}
        readers: dict[int, int] = {}  # an accumulator's readers (q/k/v share one)
        for v in self.moments.values():
            readers[id(v)] = readers.get(id(v), 0) + 1
        for k, v in sorted(self.moments.items()):
            if isinstance(v, GramAccumulator):  # one reader's sum is consumed in place
                out[k] = v.mean(self.counts[k], consume=readers[id(v)] == 1)
            else:
                out[k] = v / self.routed[f"{k}.routed_tokens"].clamp(min=1)[:, None, None]
        return {k: v.contiguous() for k, v in out.items()}


_EXPERT_SUFFIXES = (".expert_inputs", ".expert_row_inputs")


def _expert_key(bank: str, rows: bool) -> str:
    return f"{bank}{_EXPERT_SUFFIXES[rows]}"


def _bank_of(key: str) -> str | None:
    return next((key.removesuffix(s) for s in _EXPERT_SUFFIXES if key.endswith(s)), None)


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


# Stats files written before each bank had its own statistics kept them per owner module, for
# the first projections only (the transformers names); still read.
FIRST_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj")


def importance_of(stats: dict[str, torch.Tensor], module: str, shape: tuple[int, ...]
                  ) -> torch.Tensor | None:
    """The quantizer's importance for ``module`` of ``shape``: its column statistics, or for an
    expert bank whose inputs run along its last axis (``[E, out, in]``) each expert's own
    routed inputs ([E, in]; an expert no calibration token reached takes the bank's
    token-weighted mean). None for a bank used as ``x @ bank[e]``: its inputs run along its
    rows, and the clip search weighs the columns of a group."""
    if module in stats:
        return stats[module]
    per, tokens = stats.get(f"{module}.expert_inputs"), stats.get(f"{module}.routed_tokens")
    owner, _, leaf = module.rpartition(".")
    if per is None and leaf in FIRST_PROJECTIONS:
        per, tokens = stats.get(f"{owner}.expert_inputs"), stats.get(f"{owner}.routed_tokens")
    if (per is None or tokens is None or len(shape) != 3
            or tuple(per.shape) != (shape[0], shape[-1])):
        return None
    mean = (per * tokens[:, None]).sum(0) / tokens.sum().clamp(min=1)
    return torch.where(tokens[:, None] > 0, per, mean)


def save_stats(stats: dict[str, torch.Tensor], path: Path) -> None:
    save_file(stats, str(path), metadata={"format": "dynquant-stats"})
