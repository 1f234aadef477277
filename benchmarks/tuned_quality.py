"""Codes against codes in the same format and bytes: round-to-nearest, sequential GPTQ, GPTQ
with each block's scales and offsets tuned against the float block (``--tune-rounding 0``), the
same with each weight's rounding tuned too (``--quantizer tuned``, the default codes; the
tuned rows start from GPTAQ's codes at a small model's default fraction, ``--float-targets``), the same
fitted on the block's plain squared error (``--tune-error plain``; the default weighs each
channel by the gain of the norm that reads it), and those with their scales then tuned end to
end against the float model's distributions (``--e2e-steps``).

One calibrated measure on the bundled text (``quantize --budget``'s own, rtn-priced with each
Linear's gptq ratio) gives the widths, uniform and allocated; every code kind writes the same
widths (equal bytes). Each row: the codes' write time (the measure, the same for every kind, is
shown once), and mean KL against the float model on 16,384 held-out tokens.

    python -m benchmarks tuned_quality [--model smollm2|gemma3-270m] [--settings u3 a3.25 ...]
        [--steps 100] [--rounding 3e-3] [--e2e-steps 100] [--kinds rtn gptq scales tuned ...]
        [--float-targets 0.5] [--codes-dtype bfloat16] [--measure-dtype bfloat16]

Targets: tuned <= 0.6x GPTQ's KL at 3.25 and 4.25 bits (SmolLM2; Gemma-3-270M at 4.25), no
budget worse at 5.5; tuned's quantize (measure + codes) <= 3x GPTQ's.
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
from benchmarks.gptq_quality import _widths as widths_of
from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.end_to_end import EndToEndTuning
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.tuned_scales import TUNED_FLOAT_TARGETS, ScaleTuning
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.frontier import evaluate_checkpoints

KINDS = ("rtn", "gptq", "scales", "tuned", "plain", "e2e")
TITLES = {"rtn": "RTN", "gptq": "GPTQ", "scales": "tuned scales alone",
          "tuned": "tuned scales and rounding", "plain": "the same on the plain error",
          "e2e": "then end to end"}


def _widths(maps: dict, setting: str) -> dict:
    """``u3``: uniform 3 bits; ``a3.25``: allocated at 3.25 bits (for the maps' default codes,
    priced as gptq's)."""
    if setting.startswith("u"):
        return widths_of(maps, "uniform", int(setting[1:]))
    return widths_of(maps, "allocated", float(setting[1:]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2", help="a prepared real model's name")
    parser.add_argument("--settings", nargs="+", default=["u3", "a3.25", "a4.25", "a5.5"])
    parser.add_argument("--steps", type=int, default=ScaleTuning.steps)
    parser.add_argument("--e2e-steps", type=int, default=100, help="0: no end-to-end row")
    parser.add_argument("--rounding", type=float, default=ScaleTuning().rounding_size,
                        help="the rounding's step of the tuned rows (0: the scales alone, and "
                        "no scales-alone row)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS,
                        default=[k for k in KINDS if k != "plain"],
                        help="the rows besides rtn, gptq and tuned (the default codes), which "
                        "always run: scales (alone), plain (tuned on the plain error), e2e")
    parser.add_argument("--float-targets", type=float, default=TUNED_FLOAT_TARGETS,
                        help="GPTAQ's fraction the tuned rows start from (default: a small "
                        "model's; 0: GPTQ's codes); the gptq row is GPTQ's own")
    parser.add_argument("--codes-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the codes' pass's dtype (a model past 2 G weights gets bfloat16 "
                        "on a CPU with native bf16 products)")
    parser.add_argument("--measure-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the measure's passes' dtype (quantize's --dtype)")
    args = parser.parse_args()
    model_dir = prepared_real_model(args.model)
    print(f"# {args.model}: {' / '.join(TITLES[k] for k in KINDS if k in args.kinds)} "
          f"({args.steps} steps a block, rounding step {args.rounding}, from GPTAQ at "
          f"{args.float_targets}, a {args.codes_dtype} "
          f"pass, a {args.measure_dtype} measure), same widths; "
          f"{GPTQ_SEQS} x 256 calibration tokens of the bundled text, KL on {EVAL_TOKENS} "
          f"held-out tokens; {machine()}")
    source = resolve_model(str(model_dir))
    ids = gptq_windows(model_dir)
    rows, names = [], []
    with tempfile.TemporaryDirectory(prefix="dynquant-tuned-") as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        maps = measure(source, MeasureOptions(budgets=[], dtype=args.measure_dtype),
                       out / "maps.json", progress=False)
        measured = time.perf_counter() - start
        figure(f"{args.model}: calibrated measure", measured, "s")
        importance = load_file(out / maps["stats"])
        for setting in args.settings:
            widths = _widths(maps, setting)
            cal = SequentialCalibration(ids, dtype=args.codes_dtype)
            tuning = ScaleTuning(steps=args.steps, rounding=args.rounding)
            choosers = {"rtn": CodeChooser("rtn", importance),
                        "gptq": CodeChooser("gptq", importance, sequential=cal)}
            cal = replace(cal, float_targets=args.float_targets)  # the tuned rows' start
            if args.rounding and "scales" in args.kinds:
                choosers["scales"] = CodeChooser("tuned", importance, sequential=replace(
                    cal, tuning=replace(tuning, rounding=0.0)))
            choosers["tuned"] = CodeChooser("tuned", importance,
                                            sequential=replace(cal, tuning=tuning))
            if "plain" in args.kinds:
                choosers["plain"] = CodeChooser("tuned", importance, sequential=replace(
                    cal, tuning=replace(tuning, error="plain")))
            if args.e2e_steps and "e2e" in args.kinds:
                choosers["e2e"] = CodeChooser("tuned", importance, sequential=replace(
                    cal, tuning=tuning, end_to_end=EndToEndTuning(steps=args.e2e_steps)))
            for codes, chooser in choosers.items():
                tag = f"{codes}-{setting}"
                start = time.perf_counter()
                doc = quantize_model(source, widths, out / tag, overwrite=True, progress=False,
                                     chooser=chooser)
                seconds = time.perf_counter() - start
                figure(f"{args.model} {setting}: {codes} codes' write time", seconds, "s")
                rows.append({"setting": setting, "codes": codes, "tag": tag, "seconds": seconds,
                             "nbytes": doc["accounting"]["total_nbytes"]})
                names.append(tag)
        results = evaluate_checkpoints(model_dir, out, names, HELDOUT, 512, EVAL_TOKENS, None)
    by = {(r["setting"], r["codes"]): r | {"kl": results[r["tag"]].kl_mean} for r in rows}
    kinds = list(choosers)
    for setting in args.settings:
        for kind in kinds[2:]:
            figure(f"{args.model} {setting}: KL {kind} / gptq",
                   by[(setting, kind)]["kl"] / by[(setting, "gptq")]["kl"], "x")
    print(f"\n| {args.model} | MiB | KL: {' / '.join(kinds)} | / GPTQ: {' / '.join(kinds[2:])} | "
          f"codes' s: {' / '.join(kinds)} | quantize / GPTQ's: {' / '.join(kinds[2:])} (with "
          f"the {measured:.0f} s measure) |")
    print("|---|---|---|---|---|---|")
    for setting in args.settings:
        row = [by[(setting, c)] for c in kinds]
        gptq = row[1]
        kls = " / ".join(f"{r['kl']:.4f}" for r in row)
        ratios = " / ".join(f"{r['kl'] / gptq['kl']:.2f}x" for r in row[2:])
        times = " / ".join(f"{r['seconds']:.0f}" for r in row)
        costs = " / ".join(f"{(measured + r['seconds']) / (measured + gptq['seconds']):.2f}x"
                           for r in row[2:])
        print(f"| {setting} | {gptq['nbytes'] / 2**20:.2f} | {kls} | {ratios} | {times} | "
              f"{costs} |")


if __name__ == "__main__":
    main()
