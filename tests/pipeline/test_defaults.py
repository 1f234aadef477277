"""Calibrated by default (the bundled text, recorded in provenance), the data-free path
on request, a loss forecast with a warning above the threshold, and the data-free priors'
ranking of modules against calibrated sensitivities on a trained model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from scipy.stats import spearmanr

from dynquant.cli import main
from dynquant.models.sources import resolve_model
from dynquant.pipeline.allocate.allocation import Candidate, ModuleChoices
from dynquant.pipeline.allocate.forecast import LARGE_LOSS, forecast
from dynquant.pipeline.calibrate.text import default_calibration
from dynquant.pipeline.measure.options import MeasureOptions
from dynquant.pipeline.measure.run import measure
from model_zoo import save_tiny_model, save_tiny_tokenizer

ROOT = Path(__file__).parents[2]
SHORT = ["--calib-seqs", "2", "--calib-len", "32", "--tune-steps", "10"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    src = save_tiny_model("llama", tmp_path_factory.mktemp("defaults") / "src")
    save_tiny_tokenizer(src)
    return src


def test_bundled_text_is_packaged_and_unchanged():
    text = default_calibration().read_bytes()
    readme = (default_calibration().parent / "README.md").read_text()
    assert hashlib.sha256(text).hexdigest() in readme  # the README's checksum is the file's
    assert len(text.decode()) > 40_000 and "<unk>" not in text.decode()


def test_measure_calibrates_on_the_bundled_text_by_default(model_dir, tmp_path, capsys):
    maps_path = tmp_path / "maps.json"
    assert main(["measure", str(model_dir), "-o", str(maps_path), "--budgets", "6.0",
                 *SHORT]) == 0
    err = capsys.readouterr().err
    assert "calibrating on dynquant's bundled English text (2 x 32 tokens)" in err
    maps = json.loads(maps_path.read_text())
    assert maps["method"] == "fisher"
    assert maps["calibration"] == {
        "texts": ["dynquant:calibration_default.txt"],
        "sha256": hashlib.sha256(default_calibration().read_bytes()).hexdigest(),
        "sequences": 2, "tokens_per_sequence": 32}
    assert (tmp_path / maps["stats"]).is_file()


def test_quantize_records_the_default_calibration_in_provenance(model_dir, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", str(model_dir), "-o", str(out), "--budget", "6.0", "--quiet",
                 *SHORT]) == 0
    prov = json.loads((out / "dynquant.json").read_text())["provenance"]
    assert prov["allocator"] == "sensitivity" and prov["stats"] == "maps.stats.safetensors"
    assert prov["calibration"]["texts"] == ["dynquant:calibration_default.txt"]
    assert prov["calibration"]["sha256"] == hashlib.sha256(
        default_calibration().read_bytes()).hexdigest()
    source = resolve_model(str(model_dir))
    linears = {s.module: s.shape for s in source.tensor_specs()
               if s.quantizable and s.module != "model.embed_tokens"}
    with safe_open(out / prov["stats"], "pt") as f:  # every Linear's input columns, from text
        assert set(f.keys()) == set(linears)
        for name, shape in linears.items():
            stat = f.get_tensor(name)
            assert stat.shape == (shape[-1],) and bool((stat > 0).all()), name


@pytest.mark.parametrize("flag", [["--no-calib"], ["--method", "weight"]])
def test_data_free_on_request(model_dir, tmp_path, flag):
    out = tmp_path / "q"
    assert main(["quantize", str(model_dir), "-o", str(out), "--budget", "6.0", "--quiet",
                 *SHORT, *flag]) == 0
    doc = json.loads((out / "dynquant.json").read_text())
    maps = json.loads((out / "maps.json").read_text())
    # no text: priors for the sensitivities, random tokens for the quantizer's statistics
    synthetic = {"synthetic": "uniform random token ids, seed 0", "sequences": 2,
                 "tokens_per_sequence": 32}
    assert maps["method"] == "weight" and maps["calibration"] == synthetic
    assert doc["provenance"]["calibration"] == synthetic
    assert doc["provenance"]["stats"] == "maps.stats.safetensors"
    first = (out / "model.safetensors").read_bytes()
    assert main(["quantize", str(model_dir), "-o", str(out), "--budget", "6.0", "--quiet",
                 "--overwrite", *SHORT, *flag]) == 0
    assert (out / "model.safetensors").read_bytes() == first  # seeded: the same bytes again


def test_a_data_free_checkpoint_without_statistics_keeps_the_seed_provenance(tmp_path,
                                                                             seed_doc):
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "--random-init", "--budget", "6.0", "--quiet", "-o",
                 str(out)]) == 0
    prov = json.loads((out / "dynquant.json").read_text())["provenance"]
    assert set(prov) == set(seed_doc["provenance"]) and prov["stats"] is None


def test_conflicting_calibration_flags_fail_in_one_line(model_dir, tmp_path, capsys):
    calib = tmp_path / "c.txt"
    calib.write_text("some text " * 100)
    for extra in (["--no-calib", "--calib", str(calib)], ["--method", "weight", "--calib",
                                                          str(calib)]):
        assert main(["measure", str(model_dir), "-o", str(tmp_path / "m.json"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dynquant: error:") and "\n" not in err and "data-free" in err


def test_a_preset_without_weights_falls_back_to_data_free(tmp_path, capsys):
    doc = measure(resolve_model("tiny"), MeasureOptions(budgets=[6.0]), None, progress=True,
                  random_init=True)
    assert doc["method"] == "weight" and doc["calibration"] is None
    assert "data-free sensitivities (model weights (a model directory) to calibrate)" in \
        capsys.readouterr().err


def _toy_maps(method: str, sensitivity: float) -> tuple[dict, list[ModuleChoices]]:
    errors = {2: 0.1, 3: 0.03, 4: 0.008, 8: 0.0001}
    modules = [ModuleChoices(name, 1024, sensitivity,
                             [Candidate(b, 128, 1024 * (4 * b + 1) // 32, e)
                              for b, e in errors.items()])
               for name in ("a", "b")]
    return {"method": method}, modules


def test_warning_above_the_threshold_and_not_below():
    maps, modules = _toy_maps("fisher", 1.0)
    low = forecast(maps, modules, 2.25)  # both at 2 bits: 2 x 0.1 nats
    assert low.predicted_kl == pytest.approx(0.2) and low.predicted_kl > LARGE_LOSS
    # 2.75 bits is one module at 3: 0.13, still large; 3.25 is both at 3: 0.06
    assert low.advice == (3.25, pytest.approx(0.06))
    assert low.lines() == [
        "predicted KL 0.2 nats/token at 2.25 bits (neighbours 2.5: 0.2); a sum over modules, "
        "unchecked (dynquant measure checks it)",
        "warning: expect a large loss (0.2 nats/token > 0.1); 3.25 bits predicts 0.06"]
    high = forecast(maps, modules, 4.25)
    assert high.predicted_kl == pytest.approx(0.016) and not high.large
    assert high.lines() == ["predicted KL 0.016 nats/token at 4.25 bits "
                            "(neighbours 4.0: 0.038, 4.5: 0.016); a sum over modules, "
                            "unchecked (dynquant measure checks it)"]
    assert forecast(maps, modules, 4.25, codes="rtn").lines() == [
        "predicted KL 0.016 nats/token at 4.25 bits (neighbours 4.0: 0.038, 4.5: 0.016)"]
    assert high.to_json()["large_loss"] is False and low.to_json()["advice"]["budget"] == 3.25


def test_the_forecast_is_scaled_by_the_measures_check():
    """A check of one point that measured 2x the modules' sum at 0.1 nats: the forecast is 2x
    the sum from 0.1 up, r ** (sum / 0.1) below it, for the checked codes only; the advice
    reads the scaled forecasts; a ratio beyond e is held at e."""
    import math

    from dynquant.pipeline.allocate.forecast import calibrated_kl

    maps, modules = _toy_maps("fisher", 1.0)
    maps["quantizer"] = "rtn"  # calibrated maps: tuned codes by default
    maps["forecast_check"] = _check((0.1, 0.2))
    assert calibrated_kl(maps, 0.3) == pytest.approx(0.6)
    assert calibrated_kl(maps, 0.05) == pytest.approx(0.05 * 2 ** 0.5)
    assert calibrated_kl(maps, 0.05, "rtn") == 0.05
    assert calibrated_kl({"method": "fisher"}, 0.05) == 0.05
    low = forecast(maps, modules, 2.25)  # sum 0.2 -> 0.4; 3.25 bits: sum 0.06 -> 0.06 * 2**0.6
    assert low.predicted_kl == pytest.approx(0.4) and not low.unchecked
    assert "unchecked" not in low.lines()[0]
    assert low.advice == (3.25, pytest.approx(0.06 * 2 ** 0.6))
    assert forecast(maps, modules, 2.25, codes="rtn").predicted_kl == pytest.approx(0.2)
    maps["forecast_check"]["points"][0]["measured_kl"] = 100.0
    assert calibrated_kl(maps, 0.3) == pytest.approx(0.3 * math.e)
    # maps.json written before the check had points: the one point at the top level
    maps["forecast_check"] = {"codes": "tuned", "predicted_kl": 0.1, "measured_kl": 0.2}
    assert calibrated_kl(maps, 0.05) == pytest.approx(0.05 * 2 ** 0.5)


def test_a_check_of_gptq_codes_bounds_the_tuned_codes_forecast():
    """The measure checks gptq codes by default: the forecast of the tuned codes quantize
    writes is scaled by that check and said to be a bound from above; a check of tuned codes
    scales no gptq forecast, and a gptq forecast from a gptq check is no bound."""
    from dynquant.pipeline.allocate.forecast import calibrated_kl, measure_summary, summary_lines

    maps, modules = _toy_maps("fisher", 1.0)
    maps["quantizer"] = "rtn"  # calibrated maps: tuned codes by default
    maps["forecast_check"] = dict(_check((0.1, 0.2)), codes="gptq")
    assert calibrated_kl(maps, 0.3) == pytest.approx(0.6)
    assert calibrated_kl(maps, 0.3, "gptq") == pytest.approx(0.6)
    tuned = forecast(maps, modules, 2.25)
    assert tuned.bound and not tuned.unchecked and tuned.predicted_kl == pytest.approx(0.4)
    assert tuned.lines()[0].startswith("predicted KL at most 0.4 nats/token at 2.25 bits")
    assert "tuned codes come at or below it" in tuned.lines()[0]
    assert not forecast(maps, modules, 2.25, codes="gptq").bound
    maps["allocations"] = {"3.25": {"average_bits": 3.25, "packed_nbytes": 100,
                                    "predicted_error": 0.05}}
    summary = measure_summary(maps)
    assert summary["bound"] and not summary["unchecked"]
    assert "at or below it" in summary_lines(summary)[-1]
    maps["forecast_check"]["codes"] = "tuned"
    assert calibrated_kl(maps, 0.3, "gptq") == 0.3
    assert not forecast(maps, modules, 2.25).bound


def test_a_check_of_two_points_interpolates_between_them():
    """Points measuring 0.5x the sum at 0.4 nats and 1.5x at 0.1: 0.5x from 0.4 up, 1.5x from
    0.1 down, and between them log r linear in log sum (at 0.2, halfway in log, their
    geometric mean); a point measuring more than a larger one is held to the larger's
    forecast."""
    import math

    from dynquant.pipeline.allocate.forecast import calibrated_kl

    maps, _ = _toy_maps("fisher", 1.0)
    maps["quantizer"] = "rtn"
    maps["forecast_check"] = _check((0.1, 0.15), (0.4, 0.2))
    for summed, scaled in ((0.8, 0.4), (0.4, 0.2), (0.2, 0.2 * math.sqrt(0.75)), (0.1, 0.15),
                           (0.05, 0.075)):
        assert calibrated_kl(maps, summed) == pytest.approx(scaled)
    between = [calibrated_kl(maps, s) for s in (0.11, 0.15, 0.3, 0.39)]
    assert between == sorted(between)
    maps["forecast_check"] = _check((0.1, 0.3), (0.4, 0.2))
    assert calibrated_kl(maps, 0.1) == pytest.approx(0.2)
    assert calibrated_kl(maps, 0.05) == pytest.approx(0.1)


def _check(*points: tuple[float, float]) -> dict:
    """A gptq forecast check of (predicted, measured) KL points."""
    return {"codes": "tuned", "held_tokens": 1024,
            "points": [{"widths": "test", "predicted_kl": p, "measured_kl": m}
                       for p, m in points]}


def test_a_measure_summary_without_a_check_says_so():
    from dynquant.pipeline.allocate.forecast import measure_summary, summary_lines

    maps, _ = _toy_maps("fisher", 1.0)
    maps["quantizer"] = "rtn"
    maps["allocations"] = {"3.25": {"average_bits": 3.25, "packed_nbytes": 100,
                                    "predicted_error": 0.05}}
    unchecked = summary_lines(measure_summary(maps))
    assert "unchecked" in unchecked[-1] and "0.05 nats" in unchecked[0]
    maps["forecast_check"] = _check((0.1, 0.2))
    checked = measure_summary(maps)
    assert not checked["unchecked"]
    assert checked["budgets"]["3.25"]["predicted_kl"] == pytest.approx(0.05 * 2 ** 0.5)
    assert not any("unchecked" in line for line in summary_lines(checked))


def test_data_free_maps_never_warn():
    maps, modules = _toy_maps("weight", 1e6)
    f = forecast(maps, modules, 2.25)
    assert f.predicted_kl is None and not f.large and "warning" not in " ".join(f.lines())


def test_cli_says_the_forecast_before_writing(model_dir, tmp_path, capsys):
    maps_path = tmp_path / "maps.json"
    assert main(["measure", str(model_dir), "-o", str(maps_path), "--budgets", "6.0", "--json",
                 *SHORT]) == 0
    summary = json.loads(capsys.readouterr().out)
    small = summary["budgets"]["6.0"]
    assert summary["method"] == "fisher" and small["predicted_kl"] < LARGE_LOSS
    assert small["large_loss"] is False and summary["advice"] is None
    # the same maps with every sensitivity 1e4 times larger predict a large loss
    maps = json.loads(maps_path.read_text())
    for m in maps["modules"].values():
        m["sensitivity"] *= 1e4
    loud = tmp_path / "loud.json"
    loud.write_text(json.dumps(maps))
    for path, warned in ((maps_path, False), (loud, True)):
        assert main(["plan", str(model_dir), "--widths", f"{path}:6.0"]) == 0
        err = capsys.readouterr().err
        assert "predicted KL" in err and ("warning: expect a large loss" in err) == warned
    out = tmp_path / "q"
    assert main(["quantize", str(model_dir), "-o", str(out), "--widths", f"{loud}:6.0",
                 "--json", "--tune-steps", "10"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["forecast"]["large_loss"] is True
    assert result["accounting"]["average_bits"] <= 6.0


def _cost_at_3_bits(maps: dict) -> dict[str, float]:
    return {n: m["sensitivity"] * next(c["error"] for c in m["candidates"] if c["bits"] == 3)
            for n, m in maps["modules"].items()}


def test_data_free_priors_rank_modules_like_the_calibrated_measurement(tmp_path):
    """llama-ref (trained here): the priors' 3-bit costs against Fisher's, and against a
    size proxy (the absolute squared weight error, usage x ||W||^2 x relative error)."""
    source = resolve_model(str(ROOT / "models" / "llama-ref"))
    calib = [str(ROOT / "data" / "calibration.txt")]
    calibrated = measure(source, MeasureOptions.of(calib=calib, budgets=[]), None, progress=False)
    free = measure(source, MeasureOptions(method="weight", budgets=[]), None, progress=False)
    names = sorted(free["modules"])
    truth, priors = _cost_at_3_bits(calibrated), _cost_at_3_bits(free)
    from safetensors.torch import load_file

    weights = load_file(ROOT / "models" / "llama-ref" / "model.safetensors")
    old = {n: next(c["error"] for c in free["modules"][n]["candidates"] if c["bits"] == 3)
           * float(weights[f"{n}.weight"].float().square().sum()) for n in names}
    rho_new = spearmanr([truth[n] for n in names], [priors[n] for n in names]).statistic
    rho_old = spearmanr([truth[n] for n in names], [old[n] for n in names]).statistic
    assert rho_new >= 0.45 and rho_new >= rho_old + 0.25, (rho_new, rho_old)
    # the tied embedding (the output head too) is the costliest module for both
    assert max(names, key=truth.get) == max(names, key=priors.get) == "model.embed_tokens"
    assert torch.isfinite(torch.tensor(list(priors.values()))).all()
