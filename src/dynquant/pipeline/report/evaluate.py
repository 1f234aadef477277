"""How much worse: perplexity of two models and KL(base || model) over every predicted token.

Streamed: the text is cut into windows of ``ctx`` predicted tokens; each window's logits are
reduced to per-token figures at once, so no logit matrix of the whole text is ever held.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from dynquant.errors import ModelError
from dynquant.models.sources import model_folder
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.divergence import log_probs, token_kl
from dynquant.pipeline.execute.progress import StageProgress
from dynquant.runtime.any_model import load_any


@dataclass
class EvalResult:
    """The figures of one comparison (KL in nats per token)."""

    tokens: int
    ctx: int
    ppl_model: float
    ppl_base: float
    delta_ppl: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    top1_agreement: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def text_windows(tokenizer, text: str, ctx: int, max_tokens: int | None = None,
                 spread: bool = False) -> torch.Tensor:
    """The text's evaluation windows, ``(windows, ctx + 1)`` token ids (each window's last id is
    the next one's first: ``ctx`` predictions a window). ``max_tokens`` keeps the first windows,
    or with ``spread`` windows evenly spaced over the whole text (first and last included), a
    sample of every part of a text that joins several sources."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if len(ids) < ctx + 1:
        raise ModelError(f"the text has {len(ids)} tokens, fewer than one context of {ctx} + 1",
                         field="text")
    windows = ids.unfold(0, ctx + 1, ctx)
    keep = len(windows) if max_tokens is None else min(len(windows), max(1, max_tokens // ctx))
    if spread:
        return windows[torch.linspace(0, len(windows) - 1, keep).round().long()]
    return windows[:keep]


def _window_figures(logits_m: torch.Tensor, logits_b: torch.Tensor, target: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lm, lb = log_probs(logits_m), log_probs(logits_b)
    kl = token_kl(lb, lm).clamp_min(0.0)
    nll_m = -lm.gather(-1, target[:, None])[:, 0]
    nll_b = -lb.gather(-1, target[:, None])[:, 0]
    agree = (lm.argmax(-1) == lb.argmax(-1)).float()
    return kl, nll_m, nll_b, agree


class _Tally:
    """Running figures of one model against the base."""

    def __init__(self) -> None:
        self.kls: list[torch.Tensor] = []
        self.nll_m = self.nll_b = self.agree = 0.0

    def add(self, logits_m: torch.Tensor, logits_b: torch.Tensor, target: torch.Tensor) -> None:
        kl, m, b, a = _window_figures(logits_m, logits_b, target)
        self.kls.append(kl)
        self.nll_m += m.double().sum().item()
        self.nll_b += b.double().sum().item()
        self.agree += a.sum().item()

    def result(self, ctx: int) -> EvalResult:
        kl = torch.cat(self.kls)
        n = kl.numel()
        ppl_m = float(torch.tensor(self.nll_m / n).exp())
        ppl_b = float(torch.tensor(self.nll_b / n).exp())
        return EvalResult(
            tokens=n, ctx=ctx, ppl_model=ppl_m, ppl_base=ppl_b, delta_ppl=ppl_m - ppl_b,
            kl_mean=float(kl.double().mean()), kl_median=float(kl.median()),
            kl_p99=float(torch.quantile(kl.double(), 0.99)), top1_agreement=self.agree / n)


def evaluate_many(models: dict[str, nn.Module], base: nn.Module, windows: torch.Tensor,
                  progress: bool = True) -> dict[str, EvalResult]:
    """Compare several models against one base on ``text_windows``; the base runs once per
    window."""
    tallies = {name: _Tally() for name in models}
    with torch.no_grad(), StageProgress(enabled=progress) as bar:
        task = bar.add_task("evaluating", total=len(windows))
        for x in windows:
            inp, target = x[None, :-1], x[1:]
            logits_b = base(inp).logits[0]
            for name, model in models.items():
                tallies[name].add(model(inp).logits[0], logits_b, target)
            bar.advance(task)
    return {name: t.result(windows.shape[1] - 1) for name, t in tallies.items()}


def evaluate_models(model: nn.Module, base: nn.Module, windows: torch.Tensor,
                    progress: bool = True) -> EvalResult:
    """Compare ``model`` against ``base`` on ``text_windows``."""
    return evaluate_many({"model": model}, base, windows, progress)["model"]


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


def evaluate(model: str | Path, base: str | Path, text: str | Path, ctx: int = 512,
             max_tokens: int | None = None, progress: bool = True,
             dtype: str | torch.dtype | None = None, activations: str | None = None,
             spread: bool = False) -> EvalResult:
    """``dynquant eval``: MODEL and BASE may each be a dynquant checkpoint or a model folder; both
    run in the compute dtype ``dtype`` (None/"auto": the CPU's); MODEL's products with
    ``activations`` (int8: every token as decode computes it; BASE, the reference, always
    float32), so a checkpoint against itself measures what int8 activations cost."""
    model, base = model_folder(model), model_folder(base)  # hub names from the local cache
    text_path = Path(text)
    if not text_path.is_file():
        raise ModelError("no such text file", file=str(text_path))
    tok_m, tok_b = load_tokenizer(model), load_tokenizer(base)
    if not _same_tokenizer(tok_m, tok_b):
        raise ModelError(f"MODEL and BASE use different tokenizers ({model} vs {base})",
                         field="tokenizer")
    windows = text_windows(tok_m, text_path.read_text(encoding="utf-8"), ctx, max_tokens, spread)
    return evaluate_models(load_any(model, dtype, activations), load_any(base, dtype, "float"),
                           windows, progress)
