"""The calibrated default at a 7 B model's layer shapes: `dynquant quantize --budget 4.25` (the
bundled text, GPTQ codes) of the scale model (``benchmarks/scale_model.py``, N decoder layers),
each stage's seconds and the work it does against this machine's float32 GEMM peak, and the
whole run's wall time and peak RSS.

    python -m benchmarks scale [--layers N] [--budget B]

Stage seconds come from the progress lines (a stage's "done" line); the arithmetic per stage
is counted from the model's shapes (multiply-adds; X^T X as symmetric updates counts half).
llama.cpp's imatrix + quantize of the same model needs its tools and a GGUF conversion of the
model, which this benchmark does not build: its row is measured by hand (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import figure, machine
from benchmarks.scale_model import save_scale_model, seven_b_layer_config

DONE = re.compile(r"^dynquant: (?P<stage>.+): done, .*?, (?P<s>\d+) s$")


def gemm_peak() -> float:
    """float32 GEMM multiply-adds per second on this process's threads (best of 3)."""
    n = 3072
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return n ** 3 / best


def layer_work(tokens: int) -> dict[str, float]:
    """Multiply-adds of one decoder layer over ``tokens``: the forward's products, and the
    second moments of its four distinct inputs (q/k/v share one, gate/up another)."""
    c = seven_b_layer_config()
    h, m, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    forward = tokens * (h * (h + 2 * kv) + h * h + 3 * h * m)
    moments = tokens * (3 * h * h + m * m) / 2
    return {"forward": forward, "moments": moments}


def run(model: Path, out: Path, budget: float) -> tuple[float, int, list[tuple[str, int]]]:
    """(wall seconds, peak RSS bytes, [(stage, seconds)]) of the calibrated quantize."""
    cmd = ["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, "-m", "dynquant", "quantize",
           str(model), "--budget", str(budget), "-o", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    stages = [(m["stage"], int(m["s"])) for line in proc.stderr.splitlines()
              if (m := DONE.match(line))]
    rss = int(next(ln for ln in proc.stderr.splitlines()
                   if ln.startswith("maxrss_kb=")).split("=")[1]) * 1024
    return wall, rss, stages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--budget", type=float, default=4.25)
    args = parser.parse_args()
    print(f"# 7B-shaped Llama (hidden 3,584, MLP 18,944, 28/4 heads, vocabulary 49,152), "
          f"{args.layers} layer(s), random bf16 weights; {machine()}")
    peak = gemm_peak()
    figure("float32 GEMM peak", peak / 1e9, "GMAC/s")
    with tempfile.TemporaryDirectory(prefix="dynquant-scale-") as tmp:
        model = save_scale_model(Path(tmp) / "model", args.layers)
        wall, rss, stages = run(model, Path(tmp) / "q", args.budget)
        dense = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    # the passes whose arithmetic is counted: 48 windows of 256 for X^T X, 8 for the statistics
    moments, stats = layer_work(48 * 256), layer_work(8 * 256)
    print("| stage | seconds | work (GMAC) | rate (GMAC/s) | of the GEMM peak |")
    print("|---|---|---|---|---|")
    seen: dict[str, int] = {}
    for stage, seconds in stages:
        seen[stage] = seen.get(stage, 0) + 1
        mac = None
        if stage == "calibration pass" and seen[stage] == 1:
            mac = args.layers * (moments["forward"] + moments["moments"])
        elif stage == "calibration pass" and seen[stage] == 2:
            mac = args.layers * stats["forward"]
        label = stage if seen[stage] == 1 else f"{stage} ({seen[stage]})"
        if mac is None:
            print(f"| {label} | {seconds} | | | |")
        else:
            rate = mac / max(seconds, 1)
            print(f"| {label} | {seconds} | {mac / 1e9:,.0f} | {rate / 1e9:.0f} | "
                  f"{rate / peak:.0%} |")
    figure("whole quantize", wall, "s")
    figure("peak RSS", rss / 2**30, "GiB")
    figure("model on disk (bf16)", dense / 2**30, "GiB")


if __name__ == "__main__":
    main()
