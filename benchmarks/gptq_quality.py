"""Error-compensating (GPTQ) vs round-to-nearest codes at the same widths (issue 13).

For each quality model: one calibrated measure on the bundled text with the input second
moments (``--second-moments``), the sensitivity allocation at each budget, then the same widths
quantized twice: round-to-nearest with the clip search (today's default) and GPTQ (each Linear
compensated through its X^T X; embeddings and expert banks stay round-to-nearest). Equal bytes
by construction. Mean KL against the unquantized model on held-out text, and the quantize time.
Three variants: today's pipeline (round-to-nearest, widths priced with it), GPTQ codes in those
widths, and GPTQ with the widths priced by compensated output errors (``--quantizer gptq``).
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


# (codes, widths priced with): today's pipeline, GPTQ codes in today's widths, and GPTQ with
# the allocator pricing every candidate by its compensated output error
VARIANTS = (("rtn", "rtn"), ("gptq", "rtn"), ("gptq", "gptq"))


def main() -> None:
    print(f"# GPTQ vs round-to-nearest, held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        source = resolve_model(str(model_dir))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            maps = {}
            for pricing in ("gptq", "rtn"):  # gptq first: it writes the second moments
                start = time.perf_counter()
                maps[pricing] = measure(source, MeasureOptions(budgets=[], quantizer=pricing),
                                        out / f"{pricing}.json", progress=False)
                figure(f"{name}: measure priced with {pricing}", time.perf_counter() - start,
                       "s")
            moments = SecondMoments(out / "gptq.moments")
            names = []
            for budget in BUDGETS:
                for codes, pricing in VARIANTS:
                    widths = allocate_widths(maps_modules(maps[pricing]), budget).widths
                    importance = load_file(out / maps[pricing]["stats"])
                    tag = f"{codes}-{budget}-priced-{pricing}"
                    start = time.perf_counter()
                    quantize_model(source, widths, out / tag, overwrite=True, progress=False,
                                   chooser=CodeChooser(codes, importance, moments))
                    figure(f"{name} @{budget}: {tag} quantize time",
                           time.perf_counter() - start, "s")
                    names.append(tag)
            results = evaluate_checkpoints(Path(model_dir), out, names, HELDOUT, 512,
                                           EVAL_TOKENS, None)
        for budget in BUDGETS:
            rtn = results[f"rtn-{budget}-priced-rtn"]
            for codes, pricing in VARIANTS:
                r = results[f"{codes}-{budget}-priced-{pricing}"]
                figure(f"{name} @{budget}: {codes} codes, widths priced with {pricing}: KL / "
                       f"PPL", r.kl_mean, f"/ {r.ppl_model:.2f}")
                if codes == "gptq":
                    figure(f"{name} @{budget}: KL {codes} (priced {pricing}) / rtn",
                           r.kl_mean / rtn.kl_mean, "x")


if __name__ == "__main__":
    main()
