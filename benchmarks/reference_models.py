"""Both reference models on the held-out text: perplexity, and KL / delta PPL of uniform 2, 3, 4
and 8-bit dynquant quantizations (group size 128, no calibration)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import figure, machine, quality_models
from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.report.evaluate import evaluate

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384  # of the held-out text: enough for the 135 M real model, all of the rest


def main() -> None:
    print(f"# reference models, uniform widths, held-out text, {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in quality_models(ROOT).items():
            source = resolve_model(str(model_dir))
            modules = [s.module for s in source.tensor_specs() if s.quantizable]
            for bits in (2, 3, 4, 8):
                ck = Path(tmp) / f"{name}-{bits}"
                quantize_model(source, {m: bits for m in modules}, ck, progress=False)
                r = evaluate(ck, source.directory, HELDOUT, progress=False,
                             max_tokens=EVAL_TOKENS)
                if bits == 2:
                    figure(f"{name}: base perplexity ({r.tokens} tokens)", r.ppl_base)
                figure(f"{name} uniform {bits}-bit: mean KL", r.kl_mean)
                figure(f"{name} uniform {bits}-bit: delta PPL", r.delta_ppl)
                figure(f"{name} uniform {bits}-bit: top-1 agreement", r.top1_agreement)


if __name__ == "__main__":
    main()
