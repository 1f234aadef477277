"""The main job on the bundled default: the reference hybrid model's size/quality frontier.

Measure once; allocate at 2.5, 3.0, 3.25, 3.5 and 4.25 bits; quantize each; evaluate each
against the base and against uniform widths; print the table, save a size-vs-KL plot and the
3.25 checkpoint, and end with a sample from the 3.25 model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.table import Table

from dynquant.format.planner import WidthChoice
from dynquant.format.summary import console as summary_console
from dynquant.format.summary import module_type
from dynquant.numerics.compute_dtype import describe, resolve_dtype
from dynquant.pipeline.report.frontier import FrontierPoint, plot_frontier, size_quality_frontier
from dynquant.pipeline.report.generate import generate_text

ROOT = Path(__file__).resolve().parents[4]
DEMO_MODEL = ROOT / "models" / "hybrid-ref"
CALIB = ROOT / "data" / "calibration.txt"
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 8192
SAMPLE_PROMPT = "Once upon a time, there was a little"
# A hand-made mixed allocation (benchmarks, tests): attention 8, expert banks 3, others 4.
DEMO_BITS_BY_TYPE = {"self_attn": 8, "moe.w": 3}


def demo_widths(modules: list[str]) -> dict[str, WidthChoice]:
    widths: dict[str, WidthChoice] = {}
    for name in modules:
        kind = module_type(name)
        widths[name] = next((b for k, b in DEMO_BITS_BY_TYPE.items() if kind.startswith(k)), 4)
    return widths


def _table(points: list[FrontierPoint]) -> Table:
    t = Table(title=f"hybrid-ref on held-out text ({points[0].result.tokens:,} tokens), "
              f"base PPL {points[0].result.ppl_base:.2f}", title_justify="left")
    for col in ("budget", "allocation", "file MiB", "avg bits", "PPL", "mean KL", "top-1",
                "KL vs uniform"):
        t.add_column(col, justify="right")
    for p in points:
        r, u = p.result, p.uniform_result
        t.add_row(f"{p.budget}", "sensitivity", f"{p.total_nbytes / 2**20:.2f}",
                  f"{p.average_bits:.3f}", f"{r.ppl_model:.2f}", f"{r.kl_mean:.4f}",
                  f"{r.top1_agreement:.3f}", f"{r.kl_mean / u.kl_mean:.2f}x")
        t.add_row("", f"uniform {p.uniform_bits}", f"{p.uniform_total_nbytes / 2**20:.2f}",
                  f"{p.uniform_average_bits:.3f}", f"{u.ppl_model:.2f}", f"{u.kl_mean:.4f}",
                  f"{u.top1_agreement:.3f}", "", end_section=True)
    return t


def run_demo(output: str | Path, dtype: str | None = None) -> None:
    console = summary_console()
    resolved = resolve_dtype(dtype)
    console.print(describe(resolved))
    out = Path(output).resolve()
    work = out / "work"
    start = time.perf_counter()
    with console.status("starting") as status:
        points = size_quality_frontier(DEMO_MODEL, CALIB, HELDOUT, work,
                                       max_tokens=EVAL_TOKENS, on_step=status.update,
                                       dtype=resolved)
    console.print(_table(points))
    plot = out / "size_vs_kl.png"
    plot_frontier(points, plot, "hybrid-ref: size vs KL")
    keep = out / "hybrid-ref-3.25"
    if keep.exists():
        shutil.rmtree(keep)
    shutil.copytree(next(p.checkpoint for p in points if p.budget == 3.25), keep)
    shutil.rmtree(work)
    console.print(f"\nsample from the 3.25-bit model ({keep.name}):", style="bold")
    generate_text(keep, SAMPLE_PROMPT, max_new_tokens=40, dtype=resolved)
    console.print(f"\ndone in {time.perf_counter() - start:.0f} s. outputs: {out} "
                  f"(table above, {plot.name}, {keep.name}/)")
