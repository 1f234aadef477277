"""The calibrated default at a 7 B model's layer shapes: `dynquant quantize --budget 4.25` (the
bundled text, the default codes of a 7 B model: GPTQ's with each block's scales tuned, the
measure's passes and the codes' pass (its forwards and the tuning's steps) in bfloat16 where
this CPU multiplies it natively, the rounding's step 3e-3, groups of 128; no end-to-end scales, which a
7 B model's default leaves out: ``--e2e-steps 40`` measures them) of
the scale model (``benchmarks/scale_model.py``, N
decoder layers), each stage's seconds and the work it does against this machine's float32 GEMM
peak, and the whole run's wall time and peak RSS.

    python -m benchmarks scale [--layers N] [--budget B] [--dense-head] [--no-llama-cpp]
        [--tune-rounding STEP] [--codes-dtype float32] [--measure-dtype float32]
        [--tune-dtype bfloat16] [--e2e-steps N] [--quantizer gptq]

Stage seconds come from the progress lines (a stage's "done" line; the tuning's share of the
gptq stage from the first block's "tuning scales, step N" lines, which a log says every 10 s);
the arithmetic per stage is counted from the model's shapes (multiply-adds; X^T X as symmetric
updates counts half).
Beside it, llama.cpp on the same weights as its users run it: ``convert_hf_to_gguf.py`` to f16,
``llama-imatrix`` on the same text (4 chunks of 512 tokens, its usual short run) and
``llama-quantize Q4_K_M`` with that matrix, on the same threads (its programs built from source
by ``scripts/install_llama_cpp.py --tools``; the GGUF takes the real model's tokenizer, whose
vocabulary is the scale model's: ``make real-model``). ``--no-llama-cpp`` leaves it out.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.calibrated_cost import (
    FISHER_FORWARDS,
    MOMENT_WINDOWS,
    SEVEN_B,
    STAT_WINDOWS,
    WINDOW,
    WINDOWS,
    block_work,
    end_to_end_work,
    head_work,
    print_cost_model,
    quantized_weights,
    tuning_work,
)
from benchmarks.common import figure, machine
from benchmarks.scale_model import save_scale_model
from dynquant.numerics.compute_dtype import size_dtype
from dynquant.numerics.gptq import ordered_factor
from dynquant.pipeline.calibrate.text import default_calibration
from dynquant.pipeline.codes.tuned_scales import (
    ScaleTuning,
    check_windows,
    default_float_targets,
    default_rounding,
)
from dynquant.pipeline.measure.options import default_group_sizes
from scripts.install_llama_cpp import install_tools
from scripts.prepare_real_model import real_model

SEVEN_B_LAYERS = 28  # Qwen2-7B's decoder layers: the model whose default the benchmark runs
LLAMA_TOOLS = Path.home() / ".cache" / "dynquant" / "llama-cpp-tools"

LABELS = {("calibration pass", 1): "calibration pass: statistics, 8 windows",
          ("calibration pass", 2): "calibration pass: X^T X, 16 windows, and each Linear's "
                                   "gptq ratio from it",
          ("Fisher pass", 1): "Fisher pass: the blocks",
          ("measuring", 1): "measuring (candidates)",
          ("quantizing", 1): "quantizing (the rest, writing)"}
# the rate each stage's seconds measure (calibrated_cost.project's keys)
KEYS = {("calibration pass", 1): "stats", ("calibration pass", 2): "pass",
        ("Fisher pass: head", 1): "fisher_head", ("Fisher pass", 1): "fisher",
        ("gptq, block by block", 1): "gptq", ("end-to-end scales", 1): "e2e"}
STARTED = re.compile(r"^dynquant: (?P<stage>.+): started, ")
DONE = re.compile(r"^dynquant: (?P<stage>.+): done, [^,]*, (?P<s>\d+) s")
TUNING = re.compile(r"^dynquant: (?P<stage>.+): running, [^,]*, (?P<s>\d+) s \(block 1: "
                    r"tuning scales, step (?P<step>\d+)/")


def factor_rate(n: int = 6144) -> float:
    """Multiply-adds per second of GPTQ's inverse factor (Cholesky + triangular inverse,
    n^3/3) of an n-wide second-moment matrix, as the driver computes it."""
    x = torch.randn(2 * n, n)
    h = x.T @ x / (2 * n)
    start = time.perf_counter()
    ordered_factor(h)
    return n ** 3 / 3 / (time.perf_counter() - start)


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


@dataclass
class Stage:
    name: str
    seconds: int = 0
    peak_rss: int = 0  # bytes, the process's resident set while the stage ran
    # (seconds into the stage, tuning step) from its lines while a block's scales were tuned
    tuning: list[tuple[int, int]] = field(default_factory=list)

    def tuning_step_seconds(self) -> float | None:
        """Seconds per tuning step, between the first block's first and last lines of it."""
        if len(self.tuning) < 2 or self.tuning[-1][1] <= self.tuning[0][1]:
            return None
        (s0, k0), (s1, k1) = self.tuning[0], self.tuning[-1]
        return (s1 - s0) / (k1 - k0)


def _rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    rss = [ln for ln in status.splitlines() if ln.startswith("VmRSS:")]
    return int(rss[0].split()[1]) << 10 if rss else 0  # none once the process has exited


class PeakRss:
    """A child process's peak resident set, sampled every 0.2 s (and each open stage's)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.peak, self.current = proc, 0, []
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.proc.poll() is None:
            rss = _rss(self.proc.pid)
            self.peak = max(self.peak, rss)
            for stage in list(self.current):
                stage.peak_rss = max(stage.peak_rss, rss)
            time.sleep(0.2)

    def join(self) -> int:
        self.thread.join()
        return self.peak


def run(model: Path, out: Path, budget: float, extra: list[str]
        ) -> tuple[float, int, list[Stage]]:
    """(wall seconds, peak RSS bytes, stages with their seconds and peak RSS) of the calibrated
    quantize."""
    cmd = [sys.executable, "-m", "dynquant", "quantize", str(model), "--budget", str(budget),
           "-o", str(out), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stages: list[Stage] = []
    rss = PeakRss(proc)
    current = rss.current  # the stages running now (a measure's stages nest in quantize's)
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if (m := STARTED.match(line)) is not None:
            current.append(Stage(m["stage"]))
            stages.append(current[-1])
        elif (m := TUNING.match(line)) is not None:
            at = next((st for st in current if st.name == m["stage"]), None)
            if at is not None:
                at.tuning.append((int(m["s"]), int(m["step"])))
        elif (m := DONE.match(line)) is not None:
            done = next((st for st in current if st.name == m["stage"]), None)
            if done is not None:
                done.seconds = int(m["s"])
                current.remove(done)
    if proc.wait() != 0:
        sys.exit("".join(said))
    return time.perf_counter() - start, rss.join(), stages


def timed(cmd: list, env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command, which must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    rss = PeakRss(proc)
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{err[-4000:]}")
    return time.perf_counter() - start, rss.join()


def llama_tools() -> tuple[Path, Path]:
    """llama.cpp's programs (built once) and its source folder (the converter)."""
    bin_dir = install_tools(LLAMA_TOOLS, avx2_only=False)
    return bin_dir, bin_dir.parents[1]


def with_libraries(bin_dir: Path) -> dict:
    return {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}  # its shared libraries beside it


def convert_command(model: Path, work: Path, f16: Path) -> tuple[list, dict]:
    """llama.cpp's converter of ``model`` to an f16 GGUF, and its environment; the model's files
    are linked into ``work/hf`` with the real model's tokenizer (one the converter knows)."""
    _, source = llama_tools()
    real = real_model()
    if real is None:
        sys.exit("the GGUF conversion takes the real model's tokenizer: run make real-model")
    hf = work / "hf"
    hf.mkdir()
    for f in model.iterdir():
        if not f.name.startswith("tokenizer"):
            (hf / f.name).symlink_to(f)
    for f in real.glob("tokenizer*.json"):
        (hf / f.name).symlink_to(f)
    return ([sys.executable, source / "convert_hf_to_gguf.py", hf, "--outtype", "f16",
             "--outfile", f16], {**os.environ, "PYTHONPATH": str(source / "gguf-py")})


def llama_cpp(model: Path, work: Path, threads: int) -> list[tuple[str, float, int]]:
    """llama.cpp's steps on the model: (step, seconds, peak RSS bytes) each."""
    bin_dir, _ = llama_tools()
    f16, imatrix, q4 = work / "model-f16.gguf", work / "imatrix.gguf", work / "model-q4_k_m.gguf"
    libs = with_libraries(bin_dir)
    steps = [("convert_hf_to_gguf.py (f16)", *convert_command(model, work, f16)),
             ("llama-imatrix, 4 x 512 tokens",
              [bin_dir / "llama-imatrix", "-m", f16, "-f", default_calibration(), "-o", imatrix,
               "-c", "512", "--chunks", "4", "-t", threads], libs),
             ("llama-quantize Q4_K_M --imatrix",
              [bin_dir / "llama-quantize", "--imatrix", imatrix, f16, q4, "Q4_K_M", threads],
              libs)]
    return [(name, *timed(cmd, env)) for name, cmd, env in steps]


def seven_b_weights() -> int:
    """A 7 B model's quantized weights: what its size-dependent defaults are decided by."""
    return quantized_weights(replace(SEVEN_B, layers=SEVEN_B_LAYERS))


def seven_b_dtype() -> str:
    """The dtype of the measure's passes and of the codes' pass that quantize gives a 7 B model
    on this CPU (``size_dtype``): the one-layer model is below the size where the default takes
    bfloat16."""
    return size_dtype(seven_b_weights())


def seven_b_group_sizes() -> str:
    """The group sizes a 7 B model's measure prices (``default_group_sizes``), which the
    one-layer model's size would not: quantize's ``--group-sizes`` argument."""
    return ",".join(str(g) for g in default_group_sizes(seven_b_weights()))


def seven_b_rounding() -> str:
    """The rounding's step that quantize's tuned codes take for a 7 B model
    (``default_rounding``), which the one-layer model's own size would not."""
    return str(default_rounding(seven_b_weights()))


def seven_b_float_targets() -> str:
    """GPTAQ's fraction that quantize's tuned codes take for a 7 B model
    (``default_float_targets``: none), which the one-layer model's own size would not."""
    return str(default_float_targets("tuned", seven_b_weights(), 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--budget", type=float, default=4.25)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--dense-head", action="store_true",
                        help="keep the output head dense (--not-convert lm_head)")
    parser.add_argument("--tune-rounding", metavar="STEP", default=seven_b_rounding(),
                        help="quantize's --tune-rounding (default: a 7 B model's default)")
    parser.add_argument("--codes-dtype", choices=("float32", "bfloat16"),
                        help="quantize's --codes-dtype (default: a 7 B model's default on this "
                        "CPU, bfloat16 where it multiplies bf16 natively)")
    parser.add_argument("--measure-dtype", choices=("float32", "bfloat16"),
                        help="quantize's --dtype, the measure's passes' (default: a 7 B "
                        "model's default on this CPU)")
    parser.add_argument("--tune-dtype", choices=("float32", "bfloat16"),
                        help="quantize's --tune-dtype (default: the codes' pass's)")
    parser.add_argument("--quantizer", choices=("auto", "gptq"), default="auto",
                        help="quantize's --quantizer (default auto: tuned codes; gptq leaves "
                        "the tuning out)")
    parser.add_argument("--e2e-steps", metavar="N", default="0",
                        help="quantize's --e2e-steps (default 0: a 7 B model's default, past "
                        "the end-to-end pass's weights; 40 gives the cost model its rate)")
    args = parser.parse_args()
    print(f"# 7B-shaped Llama (hidden 3,584, MLP 18,944, 28/4 heads, vocabulary 49,152), "
          f"{args.layers} layer(s), random bf16 weights; {machine()}")
    peak = gemm_peak()
    figure("float32 GEMM peak", peak / 1e9, "GMAC/s")
    with tempfile.TemporaryDirectory(prefix="dynquant-scale-") as tmp:
        model = save_scale_model(Path(tmp) / "model", args.layers)
        tuning = [] if args.quantizer == "gptq" else [
            "--tune-rounding", args.tune_rounding, "--e2e-steps", args.e2e_steps,
            "--float-targets", seven_b_float_targets()] + (
            [] if args.tune_dtype is None else ["--tune-dtype", args.tune_dtype])
        extra = (["--not-convert", "lm_head"] if args.dense_head else []) + [
            "--quantizer", args.quantizer, "--group-sizes", seven_b_group_sizes(), *tuning,
            "--codes-dtype", args.codes_dtype or seven_b_dtype(),
            "--dtype", args.measure_dtype or seven_b_dtype()]
        wall, rss, stages = run(model, Path(tmp) / "q", args.budget, extra)
        dense = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        theirs = [] if args.no_llama_cpp else llama_cpp(model, Path(tmp),
                                                        torch.get_num_threads())
    big, small = block_work(SEVEN_B, WINDOWS * WINDOW), block_work(SEVEN_B, STAT_WINDOWS * WINDOW)
    measured = block_work(SEVEN_B, MOMENT_WINDOWS * WINDOW)  # the measure's X^T X windows
    factor = factor_rate()
    figure("inverse factor (n = 6,144)", factor / 1e9, "GMAC/s")
    gptq_stage = next((st for st in stages if st.name == "gptq, block by block"), None)
    step_s = None if gptq_stage is None else gptq_stage.tuning_step_seconds()
    tune_s = 0.0 if step_s is None else args.layers * ScaleTuning().steps * step_s
    # with tuned codes, the GPTQ codes' outputs on the check windows only, and the block's
    # outputs twice on every window (the float block's targets, the tuned codes' outputs)
    outputs = (2 + len(check_windows(WINDOWS)) / WINDOWS) if tune_s else 1
    work = {"pass": measured["forward"] + measured["moments"] + big["ratios"],
            "stats": small["forward"], "fisher": FISHER_FORWARDS * small["forward"],
            "gptq": sum(big[k] for k in ("partial", "moments", "factors", "compensate"))
            + outputs * big["forward"],
            # (the whole model's, not a layer's: the head's products are in every step)
            "e2e": end_to_end_work(replace(SEVEN_B, layers=args.layers)) / args.layers}
    print("| stage | seconds | work (GMAC) | rate (GMAC/s) | of the GEMM peak | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    seen: dict[str, int] = {}
    took: dict[str, int] = {}
    for stage in stages:
        seen[stage.name] = seen.get(stage.name, 0) + 1
        key = KEYS.get((stage.name, seen[stage.name]))
        mac = None if key is None or key == "fisher_head" else args.layers * work[key]
        label = LABELS.get((stage.name, seen[stage.name]), stage.name)
        if stage.seconds == 0:  # a stage with nothing to do (no head variants)
            continue
        held = f"{stage.peak_rss / 2**30:.1f}"
        seconds = stage.seconds - (tune_s if key == "gptq" else 0)
        if key is not None:
            took[key] = took.get(key, 0) + seconds
        if key == "gptq" and tune_s:
            mac_t = args.layers * tuning_work(SEVEN_B)
            what = "scales" if not float(args.tune_rounding) else "scales and rounding"
            print(f"| tuning the block's {what} ({ScaleTuning().steps} steps of "
                  f"{WINDOW} tokens, forward + backward) | {tune_s:.0f} | {mac_t / 1e9:,.0f} | "
                  f"{mac_t / tune_s / 1e9:.0f} | {mac_t / tune_s / peak:.0%} | {held} |")
            label += ": the rest (GPTQ, and the tuned codes' outputs)"
        if mac is None:
            print(f"| {label} | {seconds:.0f} | | | | {held} |")
        else:
            rate = mac / max(seconds, 1)
            print(f"| {label} | {seconds:.0f} | {mac / 1e9:,.0f} | {rate / 1e9:.0f} | "
                  f"{rate / peak:.0%} | {held} |")
    figure("whole quantize", wall, "s")
    figure("peak RSS", rss / 2**30, "GiB")
    figure("model on disk (bf16)", dense / 2**30, "GiB")
    if theirs:
        print("\n| llama.cpp step | seconds | peak RSS GiB |\n|---|---|---|")
        for name, seconds, peak_rss in theirs:
            print(f"| {name} | {seconds:.0f} | {peak_rss / 2**30:.1f} |")
        calibrated = sum(seconds for _, seconds, _ in theirs[1:])
        figure("llama.cpp imatrix + Q4_K_M", calibrated, "s")
        figure("dynquant / llama.cpp (imatrix + Q4_K_M)", wall / calibrated, "x")
    # per-worker rates for the cost model: the gptq pass's own factors taken out at the
    # factor's rate (the driver's), the rest at the pass's
    factor_s = args.layers * big["factors"] / factor
    rates = {k: args.layers * work[k] / max(took[k], 1) for k in work
             if k != "gptq" and k in took}
    rates["gptq"] = (args.layers * (work["gptq"] - big["factors"])
                     / max(took["gptq"] - factor_s, 1))
    rates["fisher_head"] = head_work(SEVEN_B)["logits"] / max(took.get("fisher_head", 0), 1)
    rates["factor"] = factor
    if tune_s:
        rates["tune"] = args.layers * tuning_work(SEVEN_B) / tune_s
    print("\nper-worker rates (GMAC/s): " + ", ".join(f"{k} {v / 1e9:.1f}"
                                                   for k, v in rates.items()))
    print_cost_model(rates)


if __name__ == "__main__":
    main()
