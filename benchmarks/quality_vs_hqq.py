"""Quality vs size at matched bytes on the quality models: dynquant's sensitivity allocation,
dynquant uniform (calibrated, and data-free: no text at all), and HQQ uniform (dequantized
into the model to evaluate), by mean KL and delta PPL on held-out text. HQQ at group size 128
stores a scale and a zero per group like dynquant, so b-bit HQQ costs b + 0.25 bits per weight
as b-bit dynquant does.
Needs ``pip install hqq``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from benchmarks.common import figure, machine, quality_models
from benchmarks.quantizer_vs_hqq import hqq_dequantize, hqq_quantize
from dynquant.checkpoint.writer import SIDE_FILES
from dynquant.models.registration import register
from dynquant.models.sources import resolve_model
from dynquant.pipeline.allocate.allocation import reachable_range, uniform_widths
from dynquant.pipeline.allocate.maps import load_maps, maps_modules
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from dynquant.pipeline.report.evaluate import evaluate
from dynquant.pipeline.report.frontier import evaluate_checkpoints, size_quality_frontier

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384  # of the held-out text: enough for the 135 M real model, all of the rest
BUDGETS = (2.25, 3.25, 4.25)
UNIFORM = (2, 3, 4)


def hqq_model(model_dir: Path, bits: int, out: Path) -> Path:
    """The model with every quantizable matrix replaced by its HQQ round trip."""
    register()
    source = resolve_model(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for spec in source.tensor_specs():
            if spec.quantizable:
                p = model.get_parameter(spec.name)
                flat = p.data.reshape(-1, p.shape[-1])
                p.data = hqq_dequantize(hqq_quantize(flat, bits), flat.shape).reshape(p.shape)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in SIDE_FILES:
        if (model_dir / f).is_file():
            shutil.copyfile(model_dir / f, out / f)
    return out


def data_free_uniform(model_dir: Path, out: Path) -> dict[int, float]:
    """Mean KL of dynquant's data-free (--no-calib) uniform 2/3/4-bit checkpoints."""
    source = resolve_model(str(model_dir))
    maps = measure(source, MeasureOptions(method="weight", budgets=[]), out / "maps.json",
                   progress=False)
    importance = load_file(out / maps["stats"])
    for bits in UNIFORM:
        widths = uniform_widths(maps_modules(maps), bits, 128).widths
        quantize_model(source, widths, out / f"free{bits}", importance=importance,
                       overwrite=True, progress=False)
    results = evaluate_checkpoints(model_dir, out, [f"free{b}" for b in UNIFORM], HELDOUT, 512,
                                   EVAL_TOKENS, None)
    return {b: results[f"free{b}"].kl_mean for b in UNIFORM}


def main() -> None:
    print(f"# quality at matched bytes vs HQQ, held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        with tempfile.TemporaryDirectory() as tmp:
            free = data_free_uniform(Path(model_dir), Path(tmp))
            hqq = {bits: evaluate(hqq_model(model_dir, bits, Path(tmp) / f"hqq{bits}"),
                                  model_dir, HELDOUT, progress=False, max_tokens=EVAL_TOKENS)
                   for bits in UNIFORM}
            for bits in UNIFORM:  # no text at all: priors, random-token statistics
                tag = f"{name} uniform {bits}-bit"
                figure(f"{tag}: dynquant data-free mean KL", free[bits])
                figure(f"{tag}: HQQ mean KL", hqq[bits].kl_mean)
                figure(f"{tag}: dynquant data-free / HQQ KL", free[bits] / hqq[bits].kl_mean,
                       "x")
            lowest = reachable_range(maps_modules(load_maps(Path(tmp) / "maps.json")))[0]
            budgets = [b for b in BUDGETS if b >= lowest]  # 576-wide rows pad: 2.25 is not
            points = size_quality_frontier(model_dir, ROOT / "data" / "calibration.txt",
                                           HELDOUT, Path(tmp), budgets=budgets,
                                           max_tokens=EVAL_TOKENS)
            for p in points:
                bits, h = p.uniform_bits, hqq[p.uniform_bits]
                tag = f"{name} @{p.budget} bits"
                figure(f"{tag}: dynquant sensitivity mean KL", p.result.kl_mean)
                figure(f"{tag}: dynquant uniform {bits}-bit mean KL", p.uniform_result.kl_mean)
                figure(f"{tag}: HQQ uniform {bits}-bit mean KL", h.kl_mean)
                figure(f"{tag}: dynquant sensitivity delta PPL", p.result.delta_ppl)
                figure(f"{tag}: dynquant uniform delta PPL", p.uniform_result.delta_ppl)
                figure(f"{tag}: HQQ uniform delta PPL", h.delta_ppl)


if __name__ == "__main__":
    main()
