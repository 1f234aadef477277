"""The main job on the bundled default (until the full demo exists: a built-in model, packed).

Quantizes the ``small`` preset of the reference hybrid architecture (random weights) with mixed
widths, checks that the exact plan matched the bytes written, validates the checkpoint and prints
its summary.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from dynquant.format.planner import WidthChoice
from dynquant.format.summary import module_type, render_summary
from dynquant.format.validate import validate_checkpoint
from dynquant.models.sources import resolve_model
from dynquant.pipeline.quantize import quantize_model

DEMO_PRESET = "small"
# A hand-made mixed allocation: attention at 8 bits, expert banks at 3, everything else at 4.
DEMO_BITS_BY_TYPE = {"self_attn": 8, "moe.w": 3}


def demo_widths(modules: list[str]) -> dict[str, WidthChoice]:
    widths: dict[str, WidthChoice] = {}
    for name in modules:
        kind = module_type(name)
        widths[name] = next((b for k, b in DEMO_BITS_BY_TYPE.items() if kind.startswith(k)), 4)
    return widths


def run_demo(output: str | Path) -> None:
    console = Console()
    source = resolve_model(DEMO_PRESET)
    modules = [s.module for s in source.tensor_specs() if s.quantizable]
    out = Path(output) / f"{DEMO_PRESET}-mixed"
    start = time.perf_counter()
    doc = quantize_model(source, demo_widths(modules), out, random_init=True, overwrite=True)
    seconds = time.perf_counter() - start
    problems = validate_checkpoint(str(out))
    render_summary(doc, f"{DEMO_PRESET} preset (random weights), mixed widths")
    console.print(f"quantized in {seconds:.1f} s; predicted bytes = written bytes: "
                  f"{doc['provenance']['predicted_nbytes'] == doc['accounting']['total_nbytes']}; "
                  f"validation: {problems if problems else 'ok'}")
    console.print(f"outputs: {out.resolve()}")
