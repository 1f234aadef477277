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
from transformers import AutoModelForCausalLM

from benchmarks.common import figure, machine, quality_models
from benchmarks.quantizer_vs_hqq import hqq_dequantize, hqq_quantize
from dynquant.checkpoint.writer import SIDE_FILES
from dynquant.models.registration import register
from dynquant.models.sources import resolve_model
from dynquant.pipeline.evaluate import evaluate
from dynquant.pipeline.frontier import size_quality_frontier

ROOT = Path(__file__).parents[1]
HELDOUT = ROOT / "data" / "heldout.txt"
EVAL_TOKENS = 16384  # of the held-out text: enough for the 135 M real model, all of the rest
BUDGETS = (2.25, 3.25, 4.25)


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


def main() -> None:
    print(f"# quality at matched bytes vs HQQ, held-out text, {machine()}")
    for name, model_dir in quality_models(ROOT).items():
        with tempfile.TemporaryDirectory() as tmp:
            points = size_quality_frontier(model_dir, ROOT / "data" / "calibration.txt",
                                           HELDOUT, Path(tmp), budgets=BUDGETS,
                                           max_tokens=EVAL_TOKENS)
            # no text at all (--no-calib): priors, random-token statistics for the clip search
            free = size_quality_frontier(model_dir, None, HELDOUT, Path(tmp) / "free",
                                         budgets=BUDGETS, max_tokens=EVAL_TOKENS,
                                         method="weight")
            for p, f in zip(points, free, strict=True):
                bits = p.uniform_bits
                h = evaluate(hqq_model(model_dir, bits, Path(tmp) / f"hqq{bits}"), model_dir,
                             HELDOUT, progress=False, max_tokens=EVAL_TOKENS)
                tag = f"{name} @{p.budget} bits"
                figure(f"{tag}: dynquant sensitivity mean KL", p.result.kl_mean)
                figure(f"{tag}: dynquant uniform {bits}-bit mean KL", p.uniform_result.kl_mean)
                figure(f"{tag}: dynquant data-free uniform {bits}-bit mean KL",
                       f.uniform_result.kl_mean)
                figure(f"{tag}: HQQ uniform {bits}-bit mean KL", h.kl_mean)
                figure(f"{tag}: dynquant data-free uniform / HQQ KL",
                       f.uniform_result.kl_mean / h.kl_mean, "x")
                figure(f"{tag}: dynquant sensitivity delta PPL", p.result.delta_ppl)
                figure(f"{tag}: dynquant uniform delta PPL", p.uniform_result.delta_ppl)
                figure(f"{tag}: HQQ uniform delta PPL", h.delta_ppl)


if __name__ == "__main__":
    main()
