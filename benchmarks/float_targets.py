"""GPTQ's codes fitted to the float model's outputs (GPTAQ, ``quantize --quantizer gptq
--float-targets A``, GPTQModel's ``v2``) against GPTQ's own, at the same widths: one calibrated
measure on the bundled text (``quantize --budget``'s own) gives the widths, every fraction A
writes them (equal bytes); each row's codes' write time and mean KL against the float model on
16,384 held-out tokens.

    python -m benchmarks float_targets [--model smollm2|gemma3-270m] [--settings a3.25 a4.25]
        [--fractions 0.25 0.5 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.common import figure, machine, prepared_real_model
from benchmarks.gptq_quality import EVAL_TOKENS, GPTQ_SEQS, HELDOUT, gptq_windows
from benchmarks.tuned_quality import _widths
from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.frontier import evaluate_checkpoints


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2", help="a prepared real model's name")
    parser.add_argument("--settings", nargs="+", default=["a3.25", "a4.25"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.25, 0.5, 1.0])
    args = parser.parse_args()
    model_dir = prepared_real_model(args.model)
    print(f"# {args.model}: GPTQ / GPTAQ at fractions {args.fractions}, same widths; "
          f"{GPTQ_SEQS} x 256 calibration tokens of the bundled text, KL on {EVAL_TOKENS} "
          f"held-out tokens; {machine()}")
    source = resolve_model(str(model_dir))
    ids = gptq_windows(model_dir)
    fractions = [0.0, *args.fractions]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="dynquant-float-targets-") as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        maps = measure(source, MeasureOptions(budgets=[]), out / "maps.json", progress=False)
        figure(f"{args.model}: calibrated measure", time.perf_counter() - start, "s")
        importance = load_file(out / maps["stats"])
        for setting in args.settings:
            widths = _widths(maps, setting)
            cal = SequentialCalibration(ids)
            for fraction in fractions:
                chooser = CodeChooser("gptq", importance,
                                      sequential=replace(cal, float_targets=fraction))
                tag = f"{setting}-{fraction}"
                start = time.perf_counter()
                doc = quantize_model(source, widths, out / tag, overwrite=True, progress=False,
                                     chooser=chooser)
                seconds = time.perf_counter() - start
                figure(f"{args.model} {setting} fraction {fraction}: codes' write time",
                       seconds, "s")
                rows[setting, fraction] = (doc["accounting"]["total_nbytes"], seconds)
        results = evaluate_checkpoints(model_dir, out, [f"{s}-{f}" for s, f in rows], HELDOUT,
                                       512, EVAL_TOKENS, None)
    kls = {s: {f: results[f"{s}-{f}"].kl_mean for f in fractions} for s in args.settings}
    for setting, kl in kls.items():
        for f in fractions[1:]:
            figure(f"{args.model} {setting}: KL fraction {f} / GPTQ", kl[f] / kl[0.0], "x")
    print(f"\n| {args.model} | MiB | KL: GPTQ / " + " / ".join(f"A = {f:g}" for f in fractions[1:])
          + " | / GPTQ | codes' s |")
    print("|---|---|---|---|---|")
    for setting, kl in kls.items():
        print(f"| {setting} | {rows[setting, 0.0][0] / 2**20:.2f} | "
              + " / ".join(f"{kl[f]:.4f}" for f in fractions) + " | "
              + " / ".join(f"{kl[f] / kl[0.0]:.2f}x" for f in fractions[1:]) + " | "
              + " / ".join(f"{rows[setting, f][1]:.0f}" for f in fractions) + " |")


if __name__ == "__main__":
    main()
