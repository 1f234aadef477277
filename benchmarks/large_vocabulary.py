"""Models whose embedding is most of the weights: dynquant's calibrated default and data-free
checkpoints beside llama.cpp's own quantization types of the same model, at their bytes, scored
by one scorer, with the forecast beside the measured KL.

Models (``python scripts/prepare_real_model.py all``; ``make bench`` prepares them):
Gemma-3-270M, a 262,144 x 640 tied, scaled embedding holding 63% of its 268 M weights (the float
model is the dequantized Q4_K_M file its package ships), and SmolLM2-135M-Instruct (49,152 x
576 tied embedding, 21%; the dequantized Q4_1 file).
- dynquant: ``quantize --budget B`` (the calibrated default: Fisher sensitivities on the text
  dynquant ships, gptq codes) and ``quantize --budget B --no-calib`` (data-free, round to
  nearest), each measured once (``measure``, then ``quantize --widths maps.json:B``, which is
  what ``--budget`` runs); the forecast is what ``quantize`` prints for those codes (the
  modules' sum scaled by the measure's check, ``measure/forecast_check.py``; the sum alone
  beside it), and the measure's wall time is printed per model.
- llama.cpp: its quantize API (``llama-cpp-python``) from the shipped GGUF file to other types,
  read back by transformers' GGUF reader into a folder of the model, so that ``dynquant eval``
  scores every row against the same float model. Bytes: the GGUF file.
Scores: KL(float || row) nats per token, perplexity and top-1 agreement on ``data/heldout.txt``,
8 windows of 512 tokens spread over all of it (``--spread``: its stories and its Wikipedia
part; its first 4,096 tokens are stories only), float32. Files are kept under
``out/bench/large_vocabulary`` and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine
from scripts import prepare_real_model as prepare

ROOT = Path(__file__).parents[1]
WORK = ROOT / "out" / "bench" / "large_vocabulary"
MODELS = ("gemma3-270m", "smollm2")
BUDGETS = (3.25, 4.25, 5.5)
LLAMA_TYPES = ("Q2_K", "Q3_K_M", "Q4_0", "IQ4_XS")
EVAL = ["--text", str(ROOT / "data" / "heldout.txt"), "--max-tokens", "4096", "--spread", "--ctx",
        "512", "--dtype", "float32"]


def dynquant(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dynquant", *args], check=True,
                          capture_output=True, text=True).stdout


def measured(real: Path, work: Path, extra: list[str]) -> tuple[Path, float | None]:
    """The model's maps (measured once; the wall time when measured in this run)."""
    maps = work / "maps.json"
    if maps.is_file():
        return maps, None
    start = time.perf_counter()
    dynquant("measure", str(real), "-o", str(maps), "--quiet", *extra)
    return maps, time.perf_counter() - start


def dynquant_rows(name: str, real: Path
                  ) -> dict[str, tuple[Path, float | None, float | None]]:
    """Checkpoints by row label, with their forecast KL and the modules' sum it scales (None:
    data-free)."""
    from dynquant.pipeline.allocate.forecast import forecast
    from dynquant.pipeline.allocate.maps import load_maps, maps_modules

    rows = {}
    for kind, extra in (("calibrated", []), ("data-free", ["--no-calib"])):
        maps, seconds = measured(real, WORK / name / kind, extra)
        if seconds is not None:
            print(f"# {name}: measure ({kind}) {seconds:.0f} s", flush=True)
        doc = load_maps(maps)
        for budget in BUDGETS:
            ck = WORK / name / kind / f"budget-{budget}"
            if not (ck / "dynquant.json").is_file():
                dynquant("quantize", str(real), "--widths", f"{maps}:{budget}", "-o", str(ck),
                         "--quiet", "--overwrite")
            unchecked = {k: v for k, v in doc.items() if k != "forecast_check"}
            rows[f"dynquant {budget}, {kind}"] = (
                ck, forecast(doc, maps_modules(doc), budget).predicted_kl,
                forecast(unchecked, maps_modules(doc), budget).predicted_kl)
        if doc.get("forecast_check"):
            c = doc["forecast_check"]
            for p in c["points"]:
                print(f"# {name}: forecast check ({p['widths']}, {c['held_tokens']} held-out "
                      f"tokens): measured {p['measured_kl']:.3f}, modules' sum "
                      f"{p['predicted_kl']:.3f}", flush=True)
    return rows


def llama_rows(name: str, real: Path, gguf: Path) -> dict[str, tuple[Path, int]]:
    """llama.cpp's types of the model: (folder read back, GGUF bytes)."""
    import llama_cpp

    rows = {}
    for kind in LLAMA_TYPES:
        out = WORK / name / f"llama.cpp-{kind}"
        file = WORK / name / f"{kind}.gguf"
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
            prepare.gguf_to_folder(file, out, tokenizer_from=real)
        rows[f"llama.cpp {kind}"] = (out, file.stat().st_size)
    return rows


def score(model: Path, real: Path) -> dict:
    return json.loads(dynquant("eval", str(model), "--base", str(real), *EVAL, "--json"))


def table(name: str, llama_cpp: bool = True) -> None:
    real = prepare.prepare(name)
    (WORK / name).mkdir(parents=True, exist_ok=True)
    rows: dict[str, tuple[Path, int, float | None, float | None]] = {}
    for label, (ck, predicted, summed) in dynquant_rows(name, real).items():
        doc = json.loads((ck / "dynquant.json").read_text())
        bits = doc["layers"]["model.embed_tokens"]["bits"]
        rows[f"{label} (embedding {bits}-bit)"] = (ck, doc["accounting"]["total_nbytes"],
                                                   predicted, summed)
    llama = llama_rows(name, real, prepare.gguf_path(name)) if llama_cpp else {}
    for label, (folder, nbytes) in llama.items():
        rows[label] = (folder, nbytes, None, None)
    print(f"\n## {name}\n")
    print("| run | MB | PPL | mean KL | forecast KL (/ measured) | modules' sum (/ measured) "
          "| same top-1 % |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for label, (folder, nbytes, predicted, summed) in rows.items():
        r = score(folder, real)
        base = r["ppl_base"]
        shown = ["-" if v is None else f"{v:.3f} ({v / r['kl_mean']:.2f}x)"
                 for v in (predicted, summed)]
        print(f"| {label} | {nbytes / 1e6:.1f} | {r['ppl_model']:.2f} | {r['kl_mean']:.3f} | "
              f"{shown[0]} | {shown[1]} | {100 * r['top1_agreement']:.1f} |", flush=True)
    print(f"\nfloat model (the dequantized GGUF): PPL {base:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks large_vocabulary")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="dynquant's rows only (llama.cpp's need llama-cpp-python: "
                        "scripts/install_llama_cpp.py)")
    args = parser.parse_args()
    print(f"# large vocabulary: {', '.join(MODELS)}; {machine()}")
    for name in MODELS:
        table(name, llama_cpp=not args.no_llama_cpp)


if __name__ == "__main__":
    main()
