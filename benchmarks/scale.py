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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import figure, machine
from benchmarks.scale_model import save_scale_model, seven_b_layer_config

LABELS = {("calibration pass", 1): "calibration pass: X^T X, 48 windows",
          ("calibration pass", 2): "calibration pass: statistics, 8 windows",
          ("Fisher pass", 1): "Fisher pass: the blocks",
          ("measuring", 1): "measuring (candidates, each Linear's gptq ratio)",
          ("quantizing", 1): "quantizing (the rest, writing)"}
STARTED = re.compile(r"^dynquant: (?P<stage>.+): started, ")
DONE = re.compile(r"^dynquant: (?P<stage>.+): done, [^,]*, (?P<s>\d+) s")


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
    """Multiply-adds of one decoder layer's necessary arithmetic over ``tokens``: ``forward``
    its products; ``moments`` the second moments of its four distinct inputs (q/k/v share one,
    gate/up another) as symmetric updates; ``gptq`` the sequential pass (the forwards of each
    group's partial run and of the block's output, the moments, one inverse factor per
    distinct input, Cholesky and triangular inverse n^3/6 each, and the compensation,
    rows x inputs^2 / 2 per Linear); ``ratios`` the measure's gptq ratios (a factor per Linear,
    four widths compensated on 256 rows each). Attention's score products are left out."""
    c = seven_b_layer_config()
    h, m, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    qkv, o, mlp = h * (h + 2 * kv), h * h, 3 * h * m
    forward = tokens * (qkv + o + mlp)
    moments = tokens * (3 * h * h + m * m) / 2
    partial = tokens * (3 * qkv + 2 * o + 2 * h * m)
    factors = (3 * h ** 3 + m ** 3) / 3
    compensate = ((h + 2 * kv) * h * h + h * h * h + 2 * m * h * h + h * m * m) / 2
    ratios = (6 * h ** 3 + m ** 3) / 3 + 4 * 256 * (6 * h * h + m * m) / 2
    return {"forward": forward, "moments": moments,
            "gptq": forward + partial + moments + factors + compensate, "ratios": ratios}


@dataclass
class Stage:
    name: str
    seconds: int = 0
    peak_rss: int = 0  # bytes, the process's resident set while the stage ran


def _rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) << 10


def run(model: Path, out: Path, budget: float) -> tuple[float, int, list[Stage]]:
    """(wall seconds, peak RSS bytes, stages with their seconds and peak RSS) of the calibrated
    quantize, its resident set sampled every 0.2 s."""
    cmd = [sys.executable, "-m", "dynquant", "quantize", str(model), "--budget", str(budget),
           "-o", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stages: list[Stage] = []
    current: list[Stage] = []  # the stages running now (a measure's stages nest in quantize's)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            rss = _rss(proc.pid)
            peak[0] = max(peak[0], rss)
            for stage in list(current):
                stage.peak_rss = max(stage.peak_rss, rss)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if (m := STARTED.match(line)) is not None:
            current.append(Stage(m["stage"]))
            stages.append(current[-1])
        elif (m := DONE.match(line)) is not None:
            done = next((st for st in current if st.name == m["stage"]), None)
            if done is not None:
                done.seconds = int(m["s"])
                current.remove(done)
    if proc.wait() != 0:
        sys.exit("".join(said))
    sampler.join()
    return time.perf_counter() - start, peak[0], stages


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
    print("| stage | seconds | work (GMAC) | rate (GMAC/s) | of the GEMM peak | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    seen: dict[str, int] = {}
    for stage in stages:
        seen[stage.name] = seen.get(stage.name, 0) + 1
        mac = None
        if stage.name == "calibration pass":  # first X^T X's 48 windows, then the statistics' 8
            mac = args.layers * (moments["forward"] + moments["moments"]
                                 if seen[stage.name] == 1 else stats["forward"])
        elif stage.name == "measuring":
            mac = args.layers * moments["ratios"]
        elif stage.name == "gptq, block by block":
            mac = args.layers * moments["gptq"]
        label = LABELS.get((stage.name, seen[stage.name]), stage.name)
        if stage.seconds == 0:  # a stage with nothing to do (no head variants)
            continue
        held = f"{stage.peak_rss / 2**30:.1f}"
        if mac is None:
            print(f"| {label} | {stage.seconds} | | | | {held} |")
        else:
            rate = mac / max(stage.seconds, 1)
            print(f"| {label} | {stage.seconds} | {mac / 1e9:,.0f} | {rate / 1e9:.0f} | "
                  f"{rate / peak:.0%} | {held} |")
    figure("whole quantize", wall, "s")
    figure("peak RSS", rss / 2**30, "GiB")
    figure("model on disk (bf16)", dense / 2**30, "GiB")


if __name__ == "__main__":
    main()
