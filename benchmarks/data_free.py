"""Data-free vs calibrated sensitivities, and the size/quality frontier with its knee.

For each quality model (both reference models, and the real pretrained model when prepared):
measure once data-free (``--no-calib``: priors by role and depth) and once with the new
defaults (Fisher on the English text dynquant ships, no ``--calib``); allocate every budget
with each; quantize and evaluate against the unquantized model on held-out text. The calibrated
sensitivities are also allocated at exactly each data-free checkpoint's size, so the ratio
compares equal bytes. Targets: data-free KL <= 2x the calibrated at 3.25 bits, <= 1.5x at 4.25.
The knee of the calibrated frontier (Kneedle on bits vs log KL) is marked, with the warning
threshold's budget (the smallest whose predicted KL is under 0.1 nats per token); plots
``MODEL_data_free_vs_calibrated.png`` go to ``out/bench/`` (or the folder given).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks.common import figure, machine, quality_models
from dynquant.pipeline.allocate.forecast import LARGE_LOSS, forecast
from dynquant.pipeline.allocate.maps import load_maps, maps_modules
from dynquant.pipeline.report.frontier import knee, size_quality_frontier

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384
BUDGETS = (2.5, 3.0, 3.25, 3.5, 4.25, 5.0)


def main(plots: Path | None = None) -> None:
    print(f"# data-free vs calibrated (bundled text) on held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        with tempfile.TemporaryDirectory() as tmp:
            free = size_quality_frontier(model_dir, None, HELDOUT, Path(tmp) / "free",
                                         budgets=BUDGETS, method="weight", uniform=False,
                                         max_tokens=EVAL_TOKENS)
            calibrated = size_quality_frontier(model_dir, None, HELDOUT, Path(tmp) / "cal",
                                               budgets=BUDGETS, uniform=False,
                                               max_tokens=EVAL_TOKENS)
            matched = size_quality_frontier(model_dir, None, HELDOUT, Path(tmp) / "cal",
                                            budgets=[p.average_bits for p in free],
                                            uniform=False, max_tokens=EVAL_TOKENS,
                                            maps_path=Path(tmp) / "cal" / "maps.json")
            maps = load_maps(Path(tmp) / "cal" / "maps.json")
            advice = forecast(maps, maps_modules(maps), min(BUDGETS)).advice
        base_ppl = calibrated[0].result.ppl_base
        figure(f"{name}: float PPL", base_ppl)
        for f, m, c in zip(free, matched, calibrated, strict=True):
            tag = f"{name} @{f.budget}"
            figure(f"{tag}: data-free {f.average_bits} bits, KL / PPL",
                   f.result.kl_mean, f"/ {f.result.ppl_model:.2f}")
            figure(f"{tag}: calibrated at equal bytes ({m.average_bits} bits), KL / PPL",
                   m.result.kl_mean, f"/ {m.result.ppl_model:.2f}")
            figure(f"{tag}: KL ratio data-free / calibrated (equal bytes)",
                   f.result.kl_mean / m.result.kl_mean, "x")
            figure(f"{tag}: calibrated at the budget ({c.average_bits} bits): predicted / "
                   f"measured KL", c.predicted_kl, f"/ {c.result.kl_mean:.4g}")
        bits = [c.average_bits for c in calibrated]
        at = knee(bits, [c.result.kl_mean for c in calibrated])
        figure(f"{name}: knee of the calibrated frontier (bits)", bits[at])
        if advice is not None:  # the quarter-bit budget the warning would name
            figure(f"{name}: smallest budget predicting < {LARGE_LOSS} nats", advice[0],
                   f"(predicted {advice[1]:.3g})")
        if plots is not None:
            plot(free, calibrated, at, plots / f"{name}_data_free_vs_calibrated.png", name)


def plot(free, calibrated, at: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for points, label, style in ((free, "data-free (measured)", "s--"),
                                 (calibrated, "calibrated (measured)", "o-")):
        ax.plot([p.average_bits for p in points], [p.result.kl_mean for p in points], style,
                label=label)
    ax.plot([p.average_bits for p in calibrated], [p.predicted_kl for p in calibrated], ":",
            label="calibrated (predicted)")
    k = calibrated[at]
    ax.annotate("knee", (k.average_bits, k.result.kl_mean), textcoords="offset points",
                xytext=(6, 10), arrowprops={"arrowstyle": "->"})
    ax.axhline(LARGE_LOSS, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("average bits per weight")
    ax.set_ylabel("mean KL(base || quantized), nats/token")
    ax.set_title(f"{title}: data-free vs calibrated")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    # the plots go beside `make bench`'s outputs unless a folder is given
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "out" / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    main(folder)
