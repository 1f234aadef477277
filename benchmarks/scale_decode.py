"""Decode at a 7 B model's layer shapes: the scale model (``benchmarks/scale_model.py``, N layers,
random weights, untied 49,152-row head) packed by dynquant at 4.25 and 3.25 bits against
llama.cpp Q4_0 of the same weights, tokens/s after a short prompt and after 512 positions, and
of a 512-token prefill (``llama-bench -p 512 -n 0``; dynquant's as ``dynquant generate`` runs a
prompt: the head at the last position only).

dynquant: ``quantize --budget B --no-calib`` (a token's speed depends on the widths and the
format, not on how the codes were chosen; the head is in the budget), decoded as ``dynquant
generate`` decodes (the native decode step). llama.cpp: ``convert_hf_to_gguf.py`` to f16, ``llama-
quantize Q4_0``, ``llama-bench -p 0 -n N -d DEPTH`` on the same threads. Each runtime's best of
``--rounds``, the runtimes taking turns a round at a time. Also each file's size and
the bytes a token reads per second (every tensor once, less the input embedding table of which a
token reads one row: ``token_bytes``) beside this machine's read bandwidth (a sum over 2 GiB).

    python -m benchmarks scale_decode [--layers N] [--depths 0 512] [--new 32] [--prefill 512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import dynquant
from benchmarks.common import figure, machine
from benchmarks.context_decode import best_taking_turns, llama_bench
from benchmarks.scale import convert_command, llama_tools, seven_b_group_sizes, with_libraries
from benchmarks.scale_model import save_scale_model
from benchmarks.vs_llamacpp import Decode
from dynquant.format.safetensors_header import read_header

BUDGETS = (4.25, 3.25)


def read_bandwidth(gib: float = 2.0, rounds: int = 5) -> float:
    """Bytes per second this process reads from memory on its threads: a sum over a float32
    array far larger than the caches (STREAM's read, as torch's reduction runs it), best of
    ``rounds``."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def token_bytes(path: Path) -> int:
    """Bytes a decode step reads from a checkpoint (a dynquant directory or a GGUF file): every
    tensor once, less the input embedding table where a separate head exists (a token reads one
    row of the table; a tied head reads all of it)."""
    if path.is_dir():
        sizes = {t.name: t.nbytes for f in sorted(path.glob("*.safetensors"))
                 for t in read_header(str(f)).values()}
        table, head = "embed_tokens", "lm_head"
    else:
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        table, head = "token_embd", "output."
    untied = any(name.startswith(head) or f".{head}" in name for name in sizes)
    return sum(n for name, n in sizes.items() if not (untied and table in name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 512])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# 7B-shaped Llama, {args.layers} layer(s), random weights, {args.new} new tokens; "
          f"{machine()}")
    figure("memory read bandwidth (2 GiB float32 sum)", read_bandwidth() / 1e9, "GB/s")
    bin_dir, _ = llama_tools()
    with tempfile.TemporaryDirectory(prefix="dynquant-scale-decode-") as tmp:
        work = Path(tmp)
        model = save_scale_model(work / "model", args.layers)
        f16, q40 = work / "f16.gguf", work / "q4_0.gguf"
        cmd, env = convert_command(model, work, f16)
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, env=env)
        subprocess.run([str(c) for c in (bin_dir / "llama-quantize", f16, q40, "Q4_0")],
                       check=True, capture_output=True, env=with_libraries(bin_dir))
        f16.unlink()
        runs: dict[str, tuple[Decode | None, int, int]] = {}
        for budget in BUDGETS:
            out = work / f"q{budget}"
            subprocess.run([sys.executable, "-m", "dynquant", "quantize", str(model), "--budget",
                            str(budget), "--no-calib", "--group-sizes", seven_b_group_sizes(),
                            "-o", str(out), "--quiet"], check=True)
            size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
            runs[f"dynquant {budget}"] = (Decode(dynquant.load(out)), size, token_bytes(out))
        runs["llama.cpp Q4_0"] = (None, q40.stat().st_size, token_bytes(q40))
        print("| runtime | file MiB | MB a token reads | cached positions | tok/s | GB/s read | "
              "/ llama.cpp Q4_0 |")
        print("|---|---|---|---|---|---|---|")
        for depth in args.depths:
            ids = [1 + i % 1000 for i in range(max(depth, 1))]
            rates = best_taking_turns({name: (
                (lambda depth=depth: llama_bench(bin_dir, q40, depth, args.new, args.threads))
                if gen is None else (lambda gen=gen, ids=ids: (args.new - 1)
                                     / gen.decode(ids, args.new)))
                for name, (gen, _, _) in runs.items()}, args.rounds)
            theirs = rates["llama.cpp Q4_0"]
            for name, (_, size, reads) in runs.items():
                rate = rates[name]
                print(f"| {name} | {size / 2**20:.0f} | {reads / 1e6:.0f} | {depth} | "
                      f"{rate:.1f} | {reads * rate / 1e9:.1f} | {rate / theirs:.2f}x |",
                      flush=True)
        print(f"\n| runtime | prefill {args.prefill} tok/s | / llama.cpp Q4_0 |\n|---|---|---|")
        ids = [1 + i % 1000 for i in range(args.prefill)]
        rates = best_taking_turns({name: (
            (lambda: llama_bench(bin_dir, q40, 0, 0, args.threads, prompt=args.prefill))
            if gen is None else (lambda gen=gen: args.prefill / gen.prefill(ids)))
            for name, (gen, _, _) in runs.items()}, args.rounds)
        for name, rate in rates.items():
            print(f"| {name} | {rate:.1f} | {rate / rates['llama.cpp Q4_0']:.2f}x |", flush=True)
    figure("threads", args.threads)


if __name__ == "__main__":
    main()
