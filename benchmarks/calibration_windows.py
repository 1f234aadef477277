"""How many calibration windows the GPTQ passes need: quality against cost on the real model.

Two passes take windows of 256 tokens of the bundled text by the dozen: the measure's X^T X for
each Linear's gptq ratio (``--moment-seqs``) and the sequential GPTQ pass that writes the codes
(``--gptq-seqs``); both cost in proportion to their windows (at a 7B model's shapes the largest
stages of the calibrated default: BENCHMARKS.md "Scale"). For each count: the allocation at 3.25
and 4.25 bits from a measure with that many moment windows, the checkpoint's GPTQ codes from
that many windows, the quantize's seconds, and KL on 16,384 held-out tokens.

    python -m benchmarks calibration_windows [--counts 16 24 48] [--gptq-windows N]
        [--model smollm2|gemma3-270m]

``--gptq-windows N``: the codes from N windows whatever the count, so that only the measure's
moment windows vary (8, the statistics pass's own windows: no X^T X pass of its own).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common import figure, machine, prepared_real_model
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.allocate.allocation import allocate_widths
from dynquant.pipeline.allocate.maps import maps_modules
from dynquant.pipeline.calibrate.text import calibration_ids, default_calibration
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.frontier import evaluate_checkpoints

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384
BUDGETS = (3.25, 4.25)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", type=int, nargs="+", default=[16, 24, 48])
    parser.add_argument("--gptq-windows", type=int)
    parser.add_argument("--model", default="smollm2", help="a prepared real model's name")
    args = parser.parse_args()
    model_dir = prepared_real_model(args.model)
    print(f"# {args.model}, bundled calibration text, windows of 256 tokens; {machine()}")
    source = resolve_model(str(model_dir))
    tok = load_tokenizer(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dynquant-windows-") as tmp:
        out = Path(tmp)
        for count in args.counts:
            start = time.perf_counter()
            maps = measure(source, MeasureOptions(budgets=[], moment_seqs=count),
                           out / f"maps{count}.json", progress=False)
            figure(f"measure with {count} moment windows", time.perf_counter() - start, "s")
            ids = calibration_ids(tok, [str(default_calibration())],
                                  args.gptq_windows or count, 256)
            chooser = CodeChooser("gptq", sequential=SequentialCalibration(ids))
            for budget in BUDGETS:
                widths = dict(allocate_widths(maps_modules(maps, "gptq"), budget).widths)
                tag = f"w{count}-{budget}"
                start = time.perf_counter()
                quantize_model(source, widths, out / tag, progress=False, chooser=chooser)
                rows.append((count, budget, tag, time.perf_counter() - start))
        kls = evaluate_checkpoints(model_dir, out, [r[2] for r in rows], HELDOUT, 512,
                                   EVAL_TOKENS, None)
    gptq = "" if args.gptq_windows is None else f" (codes from {args.gptq_windows})"
    print(f"| moment windows{gptq} | budget | quantize s | KL |")
    print("|---|---|---|---|")
    for count, budget, tag, seconds in rows:
        print(f"| {count} | {budget} | {seconds:.0f} | {kls[tag].kl_mean:.4f} |")


if __name__ == "__main__":
    main()
