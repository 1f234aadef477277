"""The maps document (``maps.json``, schema ``dynquant_maps_v1``) that ``measure`` writes and
``allocate``, ``forecast`` and ``quantize`` read: per module, its elements, sensitivity and
candidate widths with their exact bytes and errors (docs/pipeline.md)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from dynquant.errors import DynquantError
from dynquant.format.validate import load_metadata
from dynquant.pipeline.allocate.allocation import Candidate, ModuleChoices

MAPS_SCHEMA = "dynquant_maps_v1"
# codes priced by the Linears' gptq ratios: gptq's, and tuned ones (gptq's codes with tuned
# scales, priced as gptq's: their own ratio is not measured)
COMPENSATED = ("gptq", "tuned")


def maps_codes(maps: dict) -> str:
    """The codes ``quantize`` writes from a maps document by default (``--quantizer auto``):
    tuned when it was measured on text, else round-to-nearest."""
    return "tuned" if maps.get("quantizer") == "gptq" or maps.get("method") in (
        "fisher", "kl-exact") else "rtn"


def maps_modules(maps: dict, codes: str | None = None) -> list[ModuleChoices]:
    """The allocator's view of a maps document, for the codes that will be written (``codes``,
    default :func:`maps_codes`): errors of rtn-priced candidates, times a Linear's pooled ratio
    (:func:`pooled_ratio`) when they will be gptq codes, a head's at each width its own."""
    codes = codes or maps_codes(maps)
    median = linear_ratio(maps)
    trend = width_trend(maps)

    def factor(m: dict, c: dict) -> float:
        if codes not in COMPENSATED:
            return 1.0
        if "gptq_ratio" in c:  # a head: its compensated codes' KL, capped at its rounded codes'
            return min(1.0, c["gptq_ratio"])
        return pooled_ratio(m, median) * (trend.get(c["bits"], 1.0) if "gptq_ratio" in m
                                          else 1.0)

    return [ModuleChoices(name, m["elements"], m["sensitivity"],
                          [Candidate(c["bits"], c["group_size"], c["nbytes"],
                                     c["error"] * factor(m, c)) for c in m["candidates"]])
            for name, m in sorted(maps["modules"].items())]


def pooled_ratio(module: dict, median: float) -> float:
    """The factor on a Linear's rtn-priced errors for gptq codes: the geometric mean of its own
    measured ``gptq_ratio`` and the Linears' median (:func:`linear_ratio`); 1 for a module
    without a ratio (an expert bank, an untied input embedding). A Linear's own ratio, taken on
    its own output error at the probe width, ranks the modules only in part: on SmolLM2, widths
    priced by it alone measured worse at 4.25 bits, priced by the median alone worse at 3.25,
    pooled close to the better of the two at each (BENCHMARKS.md "Error-compensating codes")."""
    return math.sqrt(module["gptq_ratio"] * median) if "gptq_ratio" in module else 1.0


def linear_ratio(maps: dict) -> float:
    """The median of the Linears' measured ``gptq_ratio`` (1 when none was measured)."""
    ratios = [m["gptq_ratio"] for m in maps["modules"].values() if "gptq_ratio" in m]
    return statistics.median(ratios) if ratios else 1.0


def width_trend(maps: dict) -> dict[int, float]:
    """Per candidate width, the median over the Linears of their ``gptq_width_ratios`` at that
    width over their ``gptq_ratio`` (at the probe width): how much of compensation's gain holds
    at each width (SmolLM2: 0.86x the 3-bit ratio at 2 bits, 1.14x at 4, 0.89x at 8). A
    trend, not each Linear's own ratio at each width: those priced the allocation no better
    than one width's (docs/pipeline.md). Empty when no Linear has them."""
    rows = [m for m in maps["modules"].values()
            if m.get("gptq_width_ratios") and m.get("gptq_ratio", 0) > 0]
    widths = {int(b) for m in rows for b in m["gptq_width_ratios"]}
    return {b: statistics.median(m["gptq_width_ratios"][str(b)] / m["gptq_ratio"] for m in rows
                                 if str(b) in m["gptq_width_ratios"]) for b in sorted(widths)}


def load_maps(path: str | Path) -> dict:
    doc = load_metadata(str(path))
    if not isinstance(doc, dict) or doc.get("schema") != MAPS_SCHEMA:
        raise DynquantError(f"not a {MAPS_SCHEMA} document", file=str(path), field="schema")
    return doc


def split_maps_arg(arg: str) -> tuple[str, float | None]:
    path, sep, budget = arg.rpartition(":")
    if sep and path.endswith(".json"):
        try:
            return path, float(budget)
        except ValueError:
            pass
    return arg, None


def is_maps(path: str) -> bool:
    doc = load_metadata(split_maps_arg(path)[0])
    return isinstance(doc, dict) and doc.get("schema") == MAPS_SCHEMA
