"""Streamed Fisher sensitivities vs the exact KL probe: time, peak memory, agreement, and the
quality of the allocations they lead to.

On each reference model and on the real pretrained model (``scripts/prepare_real_model.py``,
skipped with a note when it is not prepared): ``dynquant measure --calib`` with ``--method
fisher`` and ``--method kl-exact`` (``--no-forecast-check``: the sensitivities alone) in child
processes (wall time, peak RSS), beside one plain
float32 forward+backward of the dense model over the same calibration tokens; the rank
correlation of the modules' 3-bit KLs (estimated vs probed); then each method's allocations at
every budget quantized and evaluated on held-out text (mean KL against the base), and the rank
correlation of predicted vs measured KL over the budgets. The frontier's checkpoints are
round-to-nearest codes (what the sensitivities are defined on); at ``DEFAULT_CODES_BUDGETS``
both methods' widths are also written with the codes a calibrated ``quantize`` writes by
default (sequential GPTQ on the bundled text) and compared the same way.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from scipy.stats import spearmanr

from benchmarks.common import figure, machine, run_child
from benchmarks.gptq_quality import gptq_windows
from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.pipeline.allocate.allocation import allocate_widths
from dynquant.pipeline.allocate.maps import maps_modules
from dynquant.pipeline.calibrate.text import calibration_ids
from dynquant.pipeline.codes.code_chooser import CodeChooser
from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions, probe_bits
from dynquant.pipeline.report.frontier import evaluate_checkpoints, size_quality_frontier
from dynquant.runtime.any_model import load_any
from scripts.prepare_real_model import real_model

ROOT = Path(__file__).parents[1]
CALIB = ROOT / "data" / "calibration.txt"
HELDOUT = ROOT / "data" / "heldout.txt"
SEQS, LENGTH = 8, 256
EVAL_TOKENS = 16384
DEFAULT_CODES_BUDGETS = (3.25,)


def forward_backward_seconds(model_dir: Path) -> float:
    """One float32 forward+backward of the dense model over the calibration sequences."""
    model = load_any(model_dir, dtype="float32")
    ids = calibration_ids(load_tokenizer(model_dir), [CALIB], SEQS, LENGTH)
    start = time.perf_counter()
    for row in ids:
        model(row[None], labels=row[None]).loss.backward()
    return time.perf_counter() - start


def probe_kls(maps: dict) -> dict[str, float]:
    """Each module's KL at the probe width: sensitivity x that candidate's error."""
    bits, gs = probe_bits(MeasureOptions(widths=maps["widths"], group_sizes=maps["group_sizes"]))
    return {name: m["sensitivity"] * next(c["error"] for c in m["candidates"]
                                          if (c["bits"], c["group_size"]) == (bits, gs))
            for name, m in maps["modules"].items()}


def compare(name: str, model_dir: Path, tmp: Path) -> None:
    maps, seconds = {}, {}
    for method in ("fisher", "kl-exact"):
        out = tmp / f"{name}-{method}" / "maps.json"
        wall, rss = run_child(["-m", "dynquant", "measure", str(model_dir), "-o", str(out),
                               "--calib", str(CALIB), "--calib-seqs", str(SEQS),
                               "--calib-len", str(LENGTH), "--method", method,
                               # (the forecast's check quantizes twice for either method)
                               "--no-forecast-check"])
        maps[method], seconds[method] = json.loads(out.read_text()), wall
        figure(f"{name} measure --method {method}: wall", wall, "s")
        figure(f"{name} measure --method {method}: peak RSS", rss / 2**20, "MiB")
    fb = forward_backward_seconds(model_dir)
    figure(f"{name}: one float32 forward+backward over {SEQS}x{LENGTH} tokens", fb, "s")
    figure(f"{name}: kl-exact / fisher measure time", seconds["kl-exact"] / seconds["fisher"],
           "x")
    figure(f"{name}: fisher measure / forward+backward", seconds["fisher"] / fb, "x")
    est, exact = probe_kls(maps["fisher"]), probe_kls(maps["kl-exact"])
    order = sorted(exact)
    figure(f"{name}: rank correlation of module KLs, fisher vs kl-exact",
           spearmanr([est[m] for m in order], [exact[m] for m in order]).statistic)
    figure(f"{name}: sum of module KLs, fisher / kl-exact",
           sum(est.values()) / sum(exact.values()), "x")
    kls = {}
    for method in ("fisher", "kl-exact"):
        maps_path = tmp / f"{name}-{method}" / "maps.json"
        points = size_quality_frontier(model_dir, CALIB, HELDOUT, maps_path.parent,
                                       max_tokens=EVAL_TOKENS, maps_path=maps_path)
        kls[method] = {p.budget: p.result.kl_mean for p in points}
        for p in points:
            figure(f"{name} {method} @{p.budget}: measured mean KL", p.result.kl_mean)
        figure(f"{name} {method}: rank correlation predicted vs measured KL over budgets",
               spearmanr([p.predicted_kl for p in points],
                         [p.result.kl_mean for p in points]).statistic)
    for budget in kls["fisher"]:
        figure(f"{name} @{budget}: measured KL fisher / kl-exact allocation",
               kls["fisher"][budget] / kls["kl-exact"][budget], "x")
    default_codes(name, model_dir, tmp)


def default_codes(name: str, model_dir: Path, tmp: Path) -> None:
    """Both methods' allocations written with the default calibrated codes (sequential GPTQ)."""
    source = resolve_model(str(model_dir))
    ids = gptq_windows(model_dir)
    tags = []
    for budget in DEFAULT_CODES_BUDGETS:
        for method in ("fisher", "kl-exact"):
            maps_path = tmp / f"{name}-{method}" / "maps.json"
            maps = json.loads(maps_path.read_text())
            chooser = CodeChooser("gptq", load_file(maps_path.parent / maps["stats"]),
                                  sequential=SequentialCalibration(ids))
            tag = f"{name}-{method}-gptq-{budget}"
            quantize_model(source, allocate_widths(maps_modules(maps), budget).widths,
                           tmp / tag, overwrite=True, progress=False, chooser=chooser)
            tags.append(tag)
    kl = {t: r.kl_mean for t, r in evaluate_checkpoints(model_dir, tmp, tags, HELDOUT, 512,
                                                         EVAL_TOKENS, None).items()}
    for budget in DEFAULT_CODES_BUDGETS:
        fisher, exact = (kl[f"{name}-{m}-gptq-{budget}"] for m in ("fisher", "kl-exact"))
        figure(f"{name} @{budget}, GPTQ codes: measured KL fisher / kl-exact allocation "
               f"({fisher:.4g} / {exact:.4g})", fisher / exact, "x")


def main() -> None:
    print(f"# sensitivity methods, {SEQS}x{LENGTH} calibration tokens, {machine()}")
    models = {"hybrid-ref": ROOT / "models" / "hybrid-ref",
              "llama-ref": ROOT / "models" / "llama-ref"}
    real = real_model()
    if real is None:
        print("real model not prepared (python scripts/prepare_real_model.py): skipped")
    else:
        models["smollm2-135m"] = real
    only = set(sys.argv[1:])
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in models.items():
            if not only or name in only:
                compare(name, model_dir, Path(tmp))


if __name__ == "__main__":
    main()
