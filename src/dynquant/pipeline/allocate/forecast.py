"""What a budget predicts, said before anything is written.

From a maps document alone (no weights): the predicted KL (nats per token) of the allocation at a
budget, of neighbouring budgets, and, when the prediction is large, the smallest budget on a
quarter-bit grid that predicts a small loss. Calibrated maps predict KL in nats per token (the
prediction tracks the measured KL, BENCHMARKS.md "Allocation pays"); data-free maps have no loss
scale, so they get no warning, only the note that they cannot predict one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dynquant.pipeline.allocate.allocation import (
    Allocation,
    AllocationError,
    Constraints,
    ModuleChoices,
    allocate_widths,
    reachable_range,
)
from dynquant.pipeline.allocate.maps import COMPENSATED, maps_codes, maps_modules

LARGE_LOSS = 0.1  # nats per token: beyond it a model visibly degrades (PPL up by ~10 %)
STEP = 0.25  # bits between the budgets compared


@dataclass
class Forecast:
    budget: float
    average_bits: float
    predicted_kl: float | None  # nats per token; None for data-free maps
    neighbours: dict[str, float] = field(default_factory=dict)  # budget -> predicted KL
    advice: tuple[float, float] | None = None  # (budget, its predicted KL) under LARGE_LOSS
    unchecked: bool = False  # gptq codes forecast by the modules' sum alone (no measure check)
    # tuned codes forecast by a check of gptq codes at the same widths: a bound from above
    # (tuned codes measure at or below gptq's, BENCHMARKS.md "Tuned scales")
    bound: bool = False

    @property
    def large(self) -> bool:
        return self.predicted_kl is not None and self.predicted_kl > LARGE_LOSS

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["advice"] = None if self.advice is None else {"budget": self.advice[0],
                                                           "predicted_kl": self.advice[1]}
        doc["large_loss"] = self.large
        return doc

    def lines(self) -> list[str]:
        """One line of numbers, and one warning line when the loss is large."""
        if self.predicted_kl is None:
            return [f"{self.budget} bits: data-free sensitivities predict no loss in nats "
                    "(calibrate for a prediction)"]
        near = ", ".join(f"{b}: {kl:.3g}" for b, kl in self.neighbours.items())
        out = [f"predicted KL {'at most ' if self.bound else ''}{self.predicted_kl:.3g} "
               f"nats/token at {self.budget} bits" + (f" (neighbours {near})" if near else "")
               + ("; a sum over modules, unchecked (dynquant measure checks it)"
                  if self.unchecked else "")
               + ("; the forecast of gptq codes at these widths, checked: tuned codes come "
                  "at or below it" if self.bound else "")]
        if self.large:
            out.append(warning_line(f"({self.predicted_kl:.3g} nats/token > {LARGE_LOSS})",
                                    self.advice))
        return out


def warning_line(what: str, advice: tuple[float, float] | None) -> str:
    """The one-line warning: what is large, and the smallest budget that predicts less."""
    hint = (f"; {advice[0]} bits predicts {advice[1]:.3g}" if advice
            else f"; no reachable budget predicts less than {LARGE_LOSS} (pin the sensitive "
            "modules wider or calibrate on more text)")
    return f"warning: expect a large loss {what}{hint}"


def predicts_kl(maps: dict) -> bool:
    """Whether a maps document's predicted error is a KL in nats per token."""
    return maps.get("method") in ("fisher", "kl-exact")


def calibrated_kl(maps: dict, predicted: float, codes: str | None = None) -> float:
    """The allocator's predicted KL (a sum S over modules) scaled by the measure's check
    (``forecast_check``: checkpoints of those codes quantized and measured on held-out windows,
    ``pipeline/measure/forecast_check.py``) when it was made for ``codes`` (default: the maps'
    own). Each point's ratio r = measured / predicted holds at its predicted KL P; between two
    points log r is interpolated in log S, above the largest P its r holds, and below the
    smallest the smallest's r holds too (Gemma-3's 4-bit embedding measures more over its
    estimate than the 3-bit one, SmolLM2's gptq codes less); a check of one point, with no
    trend measured, takes r ** (S / P) below it (the modules' errors interact less the smaller
    they are). r is kept within [1/e, e], and a point's scaled forecast at most a larger
    point's, so that the forecast still grows with the sum (the advice's bisection needs
    that)."""
    points = check_points(_check_for(maps, codes))
    if not points or predicted <= 0:
        return predicted
    ratios: list[tuple[float, float]] = []
    for p, m in points:  # no point forecasts more than a larger one: the forecast grows with S
        r = min(math.e, max(1 / math.e, m / p))
        ratios.append((p, r if not ratios else min(r, ratios[-1][0] * ratios[-1][1] / p)))
    top, r_top = ratios[0]
    if predicted >= top:
        return predicted * r_top
    if len(ratios) == 1:
        return predicted * r_top ** (predicted / top)
    for (hi, r_hi), (lo, r_lo) in itertools.pairwise(ratios):
        if predicted >= lo:
            t = math.log(hi / predicted) / math.log(hi / lo)
            return predicted * r_hi ** (1 - t) * r_lo ** t
    return predicted * ratios[-1][1]


def check_points(check: dict | None) -> list[tuple[float, float]]:
    """A forecast check's (predicted, measured) KL per point, largest predicted first, points
    with nothing to scale by left out (maps.json before the check had points: one, flat)."""
    if check is None:
        return []
    points = check.get("points", [check])
    pairs = {(p["predicted_kl"], p["measured_kl"]) for p in points
             if p["predicted_kl"] > 0 and p["measured_kl"] > 0}
    return sorted(pairs, reverse=True)


def _unchecked(maps: dict, codes: str | None) -> bool:
    """Whether a forecast of gptq codes is the modules' sum alone (no check for them)."""
    return (codes or maps_codes(maps)) in COMPENSATED and _check_for(maps, codes) is None


def _check_for(maps: dict, codes: str | None) -> dict | None:
    """The maps' forecast check when it was made for ``codes`` (default: the maps' own), or for
    gptq codes when they are tuned (:func:`bounded`)."""
    check = maps.get("forecast_check")
    codes = codes or maps_codes(maps)
    return check if check and (check["codes"] == codes or bounded(maps, codes)) else None


def bounded(maps: dict, codes: str | None = None) -> bool:
    """Whether the forecast of ``codes`` (default: the maps' own) is a bound from above: tuned
    codes forecast from a check of gptq codes. The tuning starts from gptq's codes and keeps
    what lowers each block's output error; a check of the tuned codes themselves costs ~4x
    (``measure --check-codes tuned``)."""
    check = maps.get("forecast_check")
    return bool(check) and (codes or maps_codes(maps)) == "tuned" and check["codes"] == "gptq"


def forecast(maps: dict, modules: Sequence[ModuleChoices], budget: float,
             constraints: Constraints | None = None, alloc: Allocation | None = None,
             codes: str | None = None) -> Forecast:
    """The forecast at ``budget`` (an allocation that cannot be made raises AllocationError)
    for the ``codes`` ``modules`` were priced for (default: the maps' own); ``alloc``: the
    allocation at ``budget`` when the caller has made it already."""
    alloc = alloc or allocate_widths(modules, budget, constraints)
    if not predicts_kl(maps):
        return Forecast(budget, alloc.average_bits, None)
    lo, hi = reachable_range(modules, constraints)

    def kl_at(b: float) -> float | None:
        return _forecast_kl(maps, modules, b, constraints, codes)

    neighbours = {}
    for b in (budget - STEP, budget + STEP):
        kl = kl_at(round(b, 4)) if lo <= b <= hi else None
        if kl is not None:
            neighbours[str(round(b, 4))] = kl
    result = Forecast(budget, alloc.average_bits,
                      calibrated_kl(maps, alloc.predicted_error, codes), neighbours,
                      unchecked=_unchecked(maps, codes), bound=bounded(maps, codes))
    if result.large:
        result.advice = _advice(budget, hi, kl_at)
    return result


def _advice(budget: float, highest: float, kl_at) -> tuple[float, float] | None:
    """The smallest budget on the quarter-bit grid above ``budget`` predicting under
    LARGE_LOSS (predicted KL falls with the budget, so a bisection over the grid finds it)."""
    grid = [k * STEP for k in range(math.floor(budget / STEP) + 1,
                                    math.floor(highest / STEP) + 1)]
    found = None
    lo, hi = 0, len(grid) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        kl = kl_at(grid[mid])
        if kl is not None and kl <= LARGE_LOSS:
            found, hi = (grid[mid], kl), mid - 1
        else:
            lo = mid + 1
    return found


def measure_summary(maps: dict) -> dict:
    """Every budget of a maps document with its predicted KL, and one piece of advice: the
    smallest quarter-bit budget predicting under LARGE_LOSS when any budget predicts more."""
    kl = predicts_kl(maps)
    budgets = {}
    for budget, a in maps["allocations"].items():
        if "error" in a:
            budgets[budget] = {"error": a["error"]}
            continue
        predicted = calibrated_kl(maps, a["predicted_error"]) if kl else a["predicted_error"]
        budgets[budget] = {"average_bits": a["average_bits"], "packed_nbytes": a["packed_nbytes"],
                           "predicted_kl" if kl else "predicted_error": predicted,
                           "large_loss": kl and predicted > LARGE_LOSS}
    large = [float(b) for b, v in budgets.items() if v.get("large_loss")]
    advice = None
    if large:
        modules = maps_modules(maps)
        found = _advice(max(large), reachable_range(modules)[1],
                        lambda b: _forecast_kl(maps, modules, b))
        advice = None if found is None else {"budget": found[0], "predicted_kl": found[1]}
    return {"method": maps["method"], "calibration": maps.get("calibration"),
            "budgets": budgets, "advice": advice, "unchecked": kl and _unchecked(maps, None),
            "bound": kl and bounded(maps)}


def _forecast_kl(maps: dict, modules: Sequence[ModuleChoices], budget: float,
                 constraints: Constraints | None = None, codes: str | None = None
                 ) -> float | None:
    """The forecast KL of the allocation at ``budget`` (None: it cannot be made)."""
    try:
        predicted = allocate_widths(modules, budget, constraints).predicted_error
    except AllocationError:
        return None
    return calibrated_kl(maps, predicted, codes)


def summary_lines(summary: dict) -> list[str]:
    out = []
    for budget, v in summary["budgets"].items():
        if "error" in v:
            out.append(f"budget {budget}: {v['error']}")
        elif "predicted_kl" in v:
            out.append(f"budget {budget}: {v['average_bits']} bits, {v['packed_nbytes']:,} packed "
                       f"bytes, predicted KL {v['predicted_kl']:.4g} nats/token")
        else:
            out.append(f"budget {budget}: {v['average_bits']} bits, {v['packed_nbytes']:,} packed "
                       f"bytes, predicted error {v['predicted_error']:.4g} (data-free, relative)")
    if summary.get("unchecked"):
        out.append("predicted KL: a sum over modules for gptq codes, unchecked (measure without "
                   "--no-forecast-check checks it)")
    if summary.get("bound"):
        out.append("predicted KL: gptq codes' forecast at each allocation, checked; the tuned "
                   "codes quantize writes come at or below it")
    large = [b for b, v in summary["budgets"].items() if v.get("large_loss")]
    if large:
        advice = summary["advice"]
        out.append(warning_line(
            f"at {', '.join(large)} bits (predicted KL > {LARGE_LOSS} nats/token)",
            None if advice is None else (advice["budget"], advice["predicted_kl"])))
    return out
