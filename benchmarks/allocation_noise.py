"""How much of an allocation is the Fisher estimate's noise: the calibrated measure (its default
settings, no forecast check) with the label draws' seed varied, at 2 and at 8 draws a sequence
(``--fisher-draws``); each measure's widths at each budget written as GPTQ codes (the cheapest
calibrated codes; the allocation is priced for them as for the default's) and scored as
``dynquant eval --max-tokens 16384 --spread`` scores a checkpoint on the held-out text. Per
(draws, budget): every seed's KL, their mean and spread, and the tied embedding's width (at
SmolLM2's 3.25 bits the choice that moves KL most).

    python -m benchmarks allocation_noise [--model smollm2|gemma3-270m] [--budgets 3.25 4.25]
        [--draws 2 8] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.common import figure, machine, prepared_real_model
from benchmarks.gptq_quality import GPTQ_SEQS, HELDOUT, gptq_windows
from benchmarks.gptq_quality import _widths as widths_of
from dynquant.models.sources import resolve_model
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure import run as measure_run
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.report.evaluate import evaluate

EVAL_TOKENS = 16384


def seeded_measure(source, draws: int, seed: int, out: Path) -> dict:
    """The default calibrated measure with ``draws`` label draws drawn from ``seed`` (the
    measure itself always draws from seed 0)."""
    real = measure_run.fisher_kl
    measure_run.fisher_kl = functools.partial(real, seed=seed)
    try:
        return measure_run.measure(source, MeasureOptions(budgets=[], fisher_draws=draws), out,
                                   progress=False)
    finally:
        measure_run.fisher_kl = real


def embedding_width(widths: dict) -> str:
    """The input embedding's (a tied one's) width, or '-' when it is not quantized."""
    choice = widths.get("model.embed_tokens")
    if choice is None:
        return "-"
    return str(choice[0] if isinstance(choice, tuple) else choice)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2", help="a prepared real model's name")
    parser.add_argument("--budgets", nargs="+", type=float, default=[3.25, 4.25])
    parser.add_argument("--draws", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    model_dir = prepared_real_model(args.model)
    print(f"# {args.model}: the measure's widths by label draws and their seed, written as GPTQ "
          f"codes ({GPTQ_SEQS} x 256 tokens of the bundled text); KL as `dynquant eval "
          f"--max-tokens {EVAL_TOKENS} --spread`; {machine()}")
    source = resolve_model(str(model_dir))
    ids = gptq_windows(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dynquant-noise-") as tmp:
        out = Path(tmp)
        for draws in args.draws:
            for seed in args.seeds:
                start = time.perf_counter()
                maps_path = out / f"d{draws}-s{seed}" / "maps.json"
                maps_path.parent.mkdir()
                maps = seeded_measure(source, draws, seed, maps_path)
                figure(f"measure, {draws} draws, seed {seed}", time.perf_counter() - start, "s")
                importance = load_file(maps_path.parent / maps["stats"])
                for budget in args.budgets:
                    widths = widths_of(maps, "allocated", budget)
                    chooser = CodeChooser("gptq", importance, sequential=SequentialCalibration(ids))
                    tag = f"d{draws}-s{seed}-{budget}"
                    quantize_model(source, widths, out / tag, progress=False, chooser=chooser)
                    kl = evaluate(out / tag, model_dir, HELDOUT, 512, EVAL_TOKENS,
                                  progress=False, dtype=resolve_dtype("auto"),
                                  activations="auto", spread=True).kl_mean
                    figure(f"{draws} draws, seed {seed}, {budget} bits: KL", kl)
                    rows.append((draws, budget, seed, kl, embedding_width(widths)))
    print(f"\n| {args.model}, budget | draws | KL by seed ({', '.join(map(str, args.seeds))}) | "
          f"mean | (max - min) / mean | embedding's bits by seed |")
    print("|---|---|---|---|---|---|")
    for budget in args.budgets:
        for draws in args.draws:
            mine = [r for r in rows if r[0] == draws and r[1] == budget]
            kls = [r[3] for r in mine]
            mean = statistics.mean(kls)
            print(f"| {budget} | {draws} | {' / '.join(f'{k:.4f}' for k in kls)} | {mean:.4f} | "
                  f"{(max(kls) - min(kls)) / mean:.0%} | {' / '.join(r[4] for r in mine)} |")


if __name__ == "__main__":
    main()
