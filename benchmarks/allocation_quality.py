"""Does the allocation pay? Sensitivity allocation vs uniform widths on the trained reference
models and the real pretrained model, by mean KL against the unquantized model on held-out text.

For each budget: dynquant's sensitivity allocation at that budget, and uniform widths at the same
or the next larger size (uniform 3-bit is 3.25 bits per weight where every input width is a
multiple of 128; the real model's 576-wide inputs are padded to 640, so its uniform checkpoints
are larger); then the allocation at exactly each uniform checkpoint's size. Also predicted vs
measured KL and their rank correlation. Saves a size-vs-KL plot per model when given a folder.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from scipy.stats import spearmanr

from benchmarks.common import figure, machine, quality_models
from dynquant.pipeline.report.frontier import plot_frontier, size_quality_frontier

ROOT = Path(__file__).parents[1]
CALIB, HELDOUT = ROOT / "data" / "calibration.txt", ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384  # of the held-out text: enough for the 135 M real model, all of the rest


def main(plots: Path | None = None) -> None:
    print(f"# allocation quality on held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        with tempfile.TemporaryDirectory() as tmp:
            points = size_quality_frontier(model_dir, CALIB, HELDOUT, tmp,
                                           max_tokens=EVAL_TOKENS)
            # the same measurement allocated at exactly each uniform checkpoint's size
            uniform = {p.uniform_average_bits: p for p in points}
            matched = size_quality_frontier(model_dir, CALIB, HELDOUT, tmp,
                                            budgets=sorted(uniform), max_tokens=EVAL_TOKENS,
                                            maps_path=Path(tmp) / "maps.json")
        for p in points:
            r, u = p.result, p.uniform_result
            tag = f"{name} @{p.budget}"
            figure(f"{tag}: sensitivity {p.average_bits} bits, mean KL", r.kl_mean)
            figure(f"{tag}: uniform {p.uniform_bits}-bit ({p.uniform_average_bits} bits), "
                   f"mean KL", u.kl_mean)
            figure(f"{tag}: KL ratio sensitivity / uniform", r.kl_mean / u.kl_mean, "x")
            figure(f"{tag}: delta PPL sensitivity", r.delta_ppl)
            figure(f"{tag}: delta PPL uniform", u.delta_ppl)
            figure(f"{tag}: predicted KL", p.predicted_kl)
        for m in matched:
            u = uniform[m.budget]
            figure(f"{name} at uniform {u.uniform_bits}-bit's size ({m.average_bits} bits): "
                   f"KL sensitivity / uniform", m.result.kl_mean / u.uniform_result.kl_mean, "x")
        rho = spearmanr([p.predicted_kl for p in points],
                        [p.result.kl_mean for p in points]).statistic
        figure(f"{name}: rank correlation predicted vs measured KL", rho)
        if plots is not None:
            plot_frontier(points, plots / f"{name}_size_vs_kl.png", f"{name}: size vs KL")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
