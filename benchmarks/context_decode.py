"""Decode after a long context: dynquant's default checkpoint against llama.cpp Q4_0, tokens/s
of the steps after 0, 512, 2,048 and 8,192 cached positions.

Model: SmolLM2-135M-Instruct (``make real-model``). dynquant: the default calibrated ``quantize
--budget 4.25`` checkpoint (``vs_llamacpp``'s, quantized once and kept), decoded as ``dynquant
generate`` decodes (the native decode step), a prompt of that many tokens of held-out text
(repeated where the text is short), timed from the first new token's logits to the last's.
llama.cpp: its own ``llama-bench -p 0 -n N -d DEPTH`` (``scripts/install_llama_cpp.py --tools``)
on a Q4_0 made from the shipped Q4_1 by ``llama-quantize``. Same threads; the best of ``--rounds``
for each, the two taking turns a round at a time.

    python -m benchmarks context_decode [--depths 0 512 2048 8192] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

import dynquant
from benchmarks.common import figure, machine
from benchmarks.scale import llama_tools, with_libraries
from benchmarks.vs_llamacpp import WORK, Decode, checkpoints
from dynquant.models.tokenizer import load_tokenizer
from scripts.prepare_real_model import real_model

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"


def q4_0(real: Path, bin_dir: Path) -> Path:
    """A Q4_0 GGUF of the model, made from the shipped Q4_1 by llama.cpp's quantize (kept)."""
    out = WORK / "SmolLM2-135M-Instruct.Q4_0.tools.gguf"
    if not out.is_file():
        WORK.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([bin_dir / "llama-quantize", "--allow-requantize",
                        real.parent / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp, "Q4_0"],
                       check=True, capture_output=True, env=with_libraries(bin_dir))
        os.replace(tmp, out)
    return out


def llama_bench(bin_dir: Path, gguf: Path, depth: int, new: int, threads: int,
                rounds: int = 1, prompt: int = 0) -> float:
    """llama-bench's best tokens/s over ``rounds`` of ``new`` tokens generated after ``depth``
    positions, or (``new`` 0) of a ``prompt``-token prefill (after its own warm-up run)."""
    out = subprocess.run([bin_dir / "llama-bench", "-m", gguf, "-p", str(prompt), "-n", str(new),
                          "-d", str(depth), "-t", str(threads), "-r", str(rounds), "-o", "json"],
                         check=True, capture_output=True, text=True,
                         env=with_libraries(bin_dir))
    return max(float(x) for x in json.loads(out.stdout)[0]["samples_ts"])


def best_taking_turns(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each run's best rate over ``rounds``, the runs taking turns a round at a time: on a VM
    whose memory speed drifts over minutes, each sees the same spells (one runtime's rounds
    all at once can fall in a slow one)."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = max(best[name], run())
    return best


def prompt(real: Path, n: int) -> list[int]:
    ids = load_tokenizer(real)(HELDOUT.read_text())["input_ids"]
    return (ids * (n // len(ids) + 1))[:max(n, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 512, 2048, 8192])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    real = real_model()
    if real is None:
        raise SystemExit("the real model is not prepared: make real-model")
    torch.set_num_threads(args.threads)
    print(f"# SmolLM2-135M-Instruct, {args.new} new tokens after a context; {machine()}")
    bin_dir, _ = llama_tools()
    gguf = q4_0(real, bin_dir)
    model = Decode(dynquant.load(checkpoints(real)["dynquant 4.25"]))
    print("| cached positions | dynquant 4.25 tok/s | llama.cpp Q4_0 tok/s | ratio |")
    print("|---|---|---|---|")
    for depth in args.depths:
        ids = prompt(real, depth)
        rates = best_taking_turns({
            "ours": lambda ids=ids: (args.new - 1) / model.decode(ids, args.new),
            "theirs": lambda depth=depth: llama_bench(bin_dir, gguf, depth, args.new,
                                                      args.threads)}, args.rounds)
        ours, theirs = rates["ours"], rates["theirs"]
        print(f"| {depth} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |", flush=True)
    figure("dynquant checkpoint", sum(
        p.stat().st_size for p in checkpoints(real)["dynquant 4.25"].glob("*.safetensors"))
        / 2**20, "MiB")
    figure("llama.cpp Q4_0", gguf.stat().st_size / 2**20, "MiB")


if __name__ == "__main__":
    main()
