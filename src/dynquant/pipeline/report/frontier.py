"""The size/quality frontier: one measurement, many budgets, each against uniform widths.

Measure a model once (KL sensitivities on calibration text), allocate at every budget with the
widths priced for round-to-nearest codes, write those codes, and evaluate each checkpoint
against the unquantized model on held-out text; uniform widths at the same or the next larger
size are evaluated beside it. Used by the demo and the benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from dynquant.format.widths import DEFAULT_GROUP_SIZE, width
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.allocate.allocation import allocate_widths, uniform_widths
from dynquant.pipeline.allocate.maps import load_maps, maps_modules
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.evaluate import EvalResult, evaluate_many, text_windows
from dynquant.runtime.any_model import load_any
from dynquant.runtime.loader import load

BUDGETS = (2.5, 3.0, 3.25, 3.5, 4.25)


@dataclass
class FrontierPoint:
    budget: float
    checkpoint: Path
    total_nbytes: int
    average_bits: float
    predicted_kl: float
    result: EvalResult
    # uniform widths of the same or the next larger size (None when not asked for)
    uniform_bits: int | None = None
    uniform_average_bits: float | None = None
    uniform_total_nbytes: int | None = None
    uniform_result: EvalResult | None = None


def uniform_bits_for(budget: float, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """The smallest uniform width at least as large as ``budget`` (scale overhead counted)."""
    return next(b for b in (2, 3, 4, 8) if width(b, group_size).bits_per_weight >= budget)


def size_quality_frontier(model_dir: str | Path, calib: str | Path | None, heldout: str | Path,
                          out_dir: str | Path, budgets: Sequence[float] = BUDGETS,
                          max_tokens: int | None = None, ctx: int = 512,
                          on_step=None, dtype: str | None = None, method: str | None = None,
                          maps_path: str | Path | None = None,
                          uniform: bool = True) -> list[FrontierPoint]:
    """Every budget's sensitivity checkpoint (kept in ``out_dir``) and (with ``uniform``) its
    uniform comparison, evaluated in the compute dtype ``dtype`` (None/"auto": the CPU's).
    Sensitivities by ``method`` (measure's default when None) on ``calib`` (None: the bundled
    text; ignored by the data-free method), or from an earlier measurement ``maps_path``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(str(model_dir))
    note = on_step or (lambda _msg: None)
    if maps_path is None:
        note("measuring sensitivities")
        maps_path = out / "maps.json"
        texts = [str(calib)] if calib is not None and method != "weight" else []
        maps = measure(source, MeasureOptions.of(calib=texts, budgets=budgets, method=method),
                       maps_path, progress=False)
    else:
        maps_path, maps = Path(maps_path), load_maps(maps_path)
    # the checkpoints below are round-to-nearest codes (``quantize_model``'s default), so the
    # widths are priced for them, not for the compensated codes a calibrated maps defaults to
    modules = maps_modules(maps, "rtn")
    importance = load_file(maps_path.parent / maps["stats"]) if maps["stats"] else None
    docs, allocs = {}, {}
    for budget in budgets:
        note(f"budget {budget}: allocate and quantize")
        allocs[budget] = allocate_widths(modules, budget)
        docs[f"budget-{budget}"] = quantize_model(
            source, allocs[budget].widths, out / f"budget-{budget}", importance=importance,
            overwrite=True, allocator="sensitivity", widths_from=f"maps.json [{budget}]",
            stats=maps["stats"], progress=False)
    for ubits in sorted({uniform_bits_for(b) for b in budgets}) if uniform else ():
        note(f"uniform {ubits}-bit: quantize")
        u = uniform_widths(modules, ubits, DEFAULT_GROUP_SIZE)
        docs[f"uniform-{ubits}"] = quantize_model(
            source, u.widths, out / f"uniform-{ubits}", importance=importance, overwrite=True,
            allocator="uniform", progress=False)
    note("evaluating every checkpoint against the base")
    results = evaluate_checkpoints(source.directory, out, list(docs), heldout, ctx, max_tokens, dtype)
    points = []
    for budget in budgets:
        key, ukey = f"budget-{budget}", f"uniform-{uniform_bits_for(budget)}"
        acc = docs[key]["accounting"]
        point = FrontierPoint(budget, out / key, acc["total_nbytes"], acc["average_bits"],
                              allocs[budget].predicted_error, results[key])
        if uniform:
            uacc = docs[ukey]["accounting"]
            point.uniform_bits, point.uniform_result = uniform_bits_for(budget), results[ukey]
            point.uniform_average_bits = uacc["average_bits"]
            point.uniform_total_nbytes = uacc["total_nbytes"]
        points.append(point)
    return points


def knee(bits: Sequence[float], kl: Sequence[float]) -> int:
    """The index of the frontier's knee: the point furthest below the straight line joining
    the ends of (bits, log KL), each axis scaled to [0, 1] (the Kneedle rule): past it, more
    bits buy much less KL than before it."""
    logs = [math.log(max(k, 1e-12)) for k in kl]
    x0, x1, y0, y1 = bits[0], bits[-1], logs[0], logs[-1]
    if len(bits) < 3 or x1 == x0 or y1 == y0:
        return len(bits) - 1
    gaps = [((b - x0) / (x1 - x0)) - ((y0 - y) / (y0 - y1)) for b, y in zip(bits, logs,
                                                                           strict=True)]
    return min(range(len(bits)), key=lambda i: gaps[i])


def evaluate_checkpoints(base_dir: Path, out: Path, names: list[str], heldout: str | Path,
                         ctx: int, max_tokens: int | None, dtype: str | None
                         ) -> dict[str, EvalResult]:
    """Each checkpoint ``out / NAME`` against the base model on the held-out text."""
    windows = text_windows(load_tokenizer(base_dir), Path(heldout).read_text(encoding="utf-8"),
                           ctx, max_tokens)
    models = {name: load(out / name, dtype=dtype) for name in names}
    return evaluate_many(models, load_any(base_dir, dtype), windows, progress=False)


def plot_frontier(points: list[FrontierPoint], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot([p.total_nbytes / 2**20 for p in points], [p.result.kl_mean for p in points],
            "o-", label="dynquant sensitivity allocation")
    seen = {p.uniform_bits: p for p in points}
    ax.plot([p.uniform_total_nbytes / 2**20 for p in seen.values()],
            [p.uniform_result.kl_mean for p in seen.values()], "s--",
            label="uniform widths")
    for p in points:
        ax.annotate(f"{p.budget}", (p.total_nbytes / 2**20, p.result.kl_mean),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint size (MiB)")
    ax.set_ylabel("mean KL(base || quantized), nats/token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
