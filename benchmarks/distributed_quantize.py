"""Local executor vs Ray: `dynquant quantize --budget 3.25` of the 885 M-parameter 4-shard Llama.

Each run is a child process (the driver); it reports its own wall time and its own peak RSS
(RUSAGE_SELF: Ray's raylet, object store and workers are other processes). While it runs, the
RSS of its whole process tree is sampled (the cluster's memory beside the driver's). The two
checkpoints must be byte-identical. Then one worker's throughput (one thread, as a Ray task
gets) for the two per-tensor jobs, and the cost model of docs/distributed.md from it.

    python -m benchmarks.distributed_quantize [--repeat N] [--workers W]

``--calibrated``: instead, the calibrated default on the real SmolLM2-135M-Instruct (`quantize
--budget 3.25 --quantizer gptq` on the bundled text: Fisher measure, sequential GPTQ codes),
local against `--ray`, the same checks (no worker rates or cost model: those are
``calibrated_cost``'s).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import figure, machine, real_model
from benchmarks.quantize_memory import LLAMA_885M, save_sharded

DRIVER = """
import resource, sys, time
from dynquant.cli import main
start = time.perf_counter()
code = main({args!r})
print("wall", time.perf_counter() - start, flush=True)
print("driver_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
sys.exit(code)
"""


def _tree_rss(pid: int) -> int:
    """The summed RSS of ``pid`` and its descendants, read from /proc (Linux)."""
    parent, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name
            parent[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * page
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [c for c, p in parent.items() if p in frontier and c not in tree]
        tree.update(children)
        frontier = children
    return sum(rss.get(p, 0) for p in tree)


def run_driver(args: list[str]) -> dict:
    """Wall time and peak RSS of the driver, and the peak RSS of its process tree."""
    # through GNU time, a tiny process that forks the driver: a driver forked straight from
    # this process would inherit this process's peak RSS (kept across exec)
    proc = subprocess.Popen(["/usr/bin/time", "-f", "", sys.executable, "-c",
                             DRIVER.format(args=args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"driver failed ({proc.returncode}): {err[-2000:]}")
    values = dict(line.split() for line in out.splitlines() if line.startswith(("wall", "driver")))
    return {"wall": float(values["wall"]), "driver_rss": int(values["driver_maxrss"]),
            "tree_rss": peak[0]}


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def worker_throughput(src: Path) -> dict[str, float]:
    """Weights per second of one worker (one thread) for the two per-tensor jobs, on one
    decoder block's tensors (read from the shards, page cache warm)."""
    from dynquant.models.sources import resolve_model
    from dynquant.pipeline.calibrate.weights import WeightsAt
    from dynquant.pipeline.codes.code_chooser import CodeChooser
    from dynquant.pipeline.codes.write import QuantizeWork, TensorJob, quantize_job
    from dynquant.pipeline.measure.candidates import CandidatesWork, ModuleJob, candidates_job

    source = resolve_model(str(src))
    specs = [s for s in source.tensor_specs() if s.quantizable and ".layers.3." in s.name]
    weights = WeightsAt.of(source, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = sum(torch.Size(s.shape).numel() for s in specs)
        start = time.perf_counter()
        for s in specs:
            weights.open().get(s)
        read = time.perf_counter() - start
        work = CandidatesWork(weights, (2, 3, 4, 8), (128,), CodeChooser(), weighted=False)
        start = time.perf_counter()
        for s in specs:
            candidates_job(ModuleJob(s), work)
        measure = time.perf_counter() - start
        qwork = QuantizeWork(weights, CodeChooser())
        start = time.perf_counter()
        for i, s in enumerate(specs):
            quantize_job(TensorJob(i, s, 3, 128), qwork)
        quant = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return {"read": n / read, "measure": n / measure, "quantize": n / quant}


# (name, weights quantized, largest tensor's weights): Llama-3-8B, Llama-3-70B (untied
# 128256-token embedding and head), Qwen3-235B-A22B (94 blocks of 128 experts; transformers
# keeps each block's experts as one [128, 3072, 4096] gate_up bank)
MODELS = [("8B (Llama-3-8B)", 8.03e9, 128256 * 4096),
          ("70B (Llama-3-70B)", 70.6e9, 128256 * 8192),
          ("235B-A22B (Qwen3)", 235e9, 128 * 3072 * 4096)]
WORKERS = (1, 8, 64)
BITS = 3.25
DRIVER_WRITE = 1.0e9  # bytes/s the driver writes (a local NVMe: ~1-3 GB/s)
FS_READ = 10e9  # bytes/s a shared filesystem serves all workers together


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def cost_model(rate: dict[str, float]) -> None:
    """Projected wall time of measure (data-free) + quantize, from one worker's measured
    rates; bounded by the workers' compute, the largest tensor (one task), the shared
    filesystem's read bandwidth (bf16 weights read twice: measure and quantize) and the
    driver's writes (the packed checkpoint twice: resume store, then the checkpoint)."""
    per_weight = 1 / rate["measure"] + 1 / rate["quantize"]
    print("| model | workers | compute | largest task | read bound | driver-write bound | "
          "projected wall | worker memory | driver memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, largest in MODELS:
        packed = n * BITS / 8
        for w in WORKERS:
            compute = n * per_weight / w
            read = 2 * 2 * n / FS_READ
            write = 2 * packed / DRIVER_WRITE
            task = largest * per_weight  # one tensor is one task
            wall = max(compute, task, read, write)
            # a worker: the largest tensor as stored (bf16) + its packed codes + scratch
            worker_mem = largest * 2 + largest * BITS / 8 + 0.5e9
            print(f"| {name} | {w} | {_duration(compute)} | {_duration(task)} | {_duration(read)} | "
                  f"{_duration(write)} | **{_duration(wall)}** | {worker_mem / 2**30:.1f} GiB | "
                  f"~0.5 GiB + one result |")


def compare(src: Path, tmp: Path, repeat: int, flags: list[str], dense: int = 0) -> bool:
    """Local and Ray runs of ``quantize SRC FLAGS`` taking turns, best of ``repeat`` each, their
    figures printed (RSS also against ``dense`` bytes, when given); whether the first two
    checkpoints are byte-identical."""
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    for r in range(repeat):
        for kind in ("local", "ray"):  # alternating: drift hits both alike
            out = tmp / f"{kind}{r}"
            extra = ["--ray"] if kind == "ray" else []
            runs[kind].append(run_driver(["quantize", str(src), *flags, "-o", str(out),
                                          "--quiet", *extra]))
    for kind, rs in runs.items():
        best = min(rs, key=lambda x: x["wall"])
        figure(f"{kind}: wall (best of {len(rs)})", best["wall"], "s")
        figure(f"{kind}: driver peak RSS", best["driver_rss"] / 2**20, "MiB")
        if dense:
            figure(f"{kind}: driver peak RSS / dense bf16", best["driver_rss"] / dense, "x")
        figure(f"{kind}: process tree peak RSS (driver + Ray's processes)",
               best["tree_rss"] / 2**20, "MiB")
    wall = {k: min(x["wall"] for x in rs) for k, rs in runs.items()}
    figure("ray / local wall", wall["ray"] / wall["local"], "x")
    same = digest(tmp / "local0") == digest(tmp / "ray0")
    print(f"byte-identical checkpoints: {same}")
    return same


def calibrated(repeat: int) -> None:
    src = real_model()
    if src is None:
        sys.exit("real model not prepared (python scripts/prepare_real_model.py)")
    print(f"# local vs Ray, calibrated quantize of SmolLM2-135M-Instruct, {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        if not compare(src, Path(tmp), repeat, ["--budget", "3.25", "--quantizer", "gptq"]):
            sys.exit("the Ray checkpoint differs from the local one")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calibrated", action="store_true")
    args = parser.parse_args()
    if args.calibrated:
        calibrated(args.repeat)
        return
    print(f"# local vs Ray quantize, {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        dense = save_sharded(LLAMA_885M, src)
        figure("dense bf16 model", dense / 2**20, "MiB")
        same = compare(src, Path(tmp), args.repeat, ["--budget", "3.25"], dense)
        rate = worker_throughput(src)
    for k, v in rate.items():
        figure(f"one worker (1 thread): {k}", v / 1e6, "M weights/s")
    cost_model(rate)
    if not same:
        sys.exit("the Ray checkpoint differs from the local one")


if __name__ == "__main__":
    main()
