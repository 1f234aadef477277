"""Error-compensating (GPTQ) vs round-to-nearest codes at the same widths (issue 13).

For each quality model: one calibrated measure on the bundled text with the input second
moments (``--second-moments``), the sensitivity allocation at each budget, then the same widths
quantized twice: round-to-nearest with the clip search (today's default) and GPTQ (each Linear
compensated through its X^T X; embeddings and expert banks stay round-to-nearest). Equal bytes
by construction. Mean KL against the unquantized model on held-out text, and the quantize time.
Targets (issue 13): GPTQ <= 0.6x RTN at 3.25 and 4.25 bits, <= 0.5x at 2.5.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.common import figure, machine, quality_models
from dynquant.models.sources import resolve_model
from dynquant.pipeline.allocate import allocate_widths
from dynquant.pipeline.code_chooser import CodeChooser, SecondMoments
from dynquant.pipeline.frontier import evaluate_checkpoints
from dynquant.pipeline.measure import MeasureOptions, maps_modules, measure
from dynquant.pipeline.quantize import quantize_model

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384
BUDGETS = (2.5, 3.25, 4.25)


def main() -> None:
    print(f"# GPTQ vs round-to-nearest at equal widths, held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        source = resolve_model(str(model_dir))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            maps = measure(source, MeasureOptions(budgets=[], second_moments=True),
                           out / "maps.json", progress=False)
            importance = load_file(out / maps["stats"])
            moments = SecondMoments(out / "maps.moments")
            names = []
            for budget in BUDGETS:
                widths = allocate_widths(maps_modules(maps), budget).widths
                for quantizer in ("rtn", "gptq"):
                    tag = f"{quantizer}-{budget}"
                    start = time.perf_counter()
                    quantize_model(source, widths, out / tag, overwrite=True, progress=False,
                                   chooser=CodeChooser(quantizer, importance, moments))
                    figure(f"{name} @{budget}: {quantizer} quantize time", time.perf_counter()
                           - start, "s")
                    names.append(tag)
            results = evaluate_checkpoints(Path(model_dir), out, names, HELDOUT, 512,
                                           EVAL_TOKENS, None)
        for budget in BUDGETS:
            rtn, gptq = results[f"rtn-{budget}"], results[f"gptq-{budget}"]
            figure(f"{name} @{budget}: rtn KL / PPL", rtn.kl_mean, f"/ {rtn.ppl_model:.2f}")
            figure(f"{name} @{budget}: gptq KL / PPL", gptq.kl_mean, f"/ {gptq.ppl_model:.2f}")
            figure(f"{name} @{budget}: KL gptq / rtn", gptq.kl_mean / rtn.kl_mean, "x")


if __name__ == "__main__":
    main()
