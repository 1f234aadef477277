"""Runs that would fill their disk are refused before they start, in one line, leaving nothing
behind; the bytes a measure is checked for are the bytes its second moments take, and those
are written only where asked for (the gptq ratios are taken from them as the pass sums them)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from dynquant.checkpoint import free_space
from dynquant.checkpoint.free_space import folder_nbytes, need_free_space
from dynquant.cli import main
from dynquant.models.sources import resolve_model
from dynquant.pipeline.codes.code_chooser import CodeChooser, GivenMoments
from dynquant.pipeline.measure import forecast_check
from dynquant.pipeline.measure.candidates import gptq_ratios
from dynquant.pipeline.measure.options import moments_dir
from dynquant.pipeline.measure.run import moments_nbytes
from model_zoo import TOKENIZER_TEXT, save_tiny_model, save_tiny_tokenizer


def _calibrated(tmp_path, family: str):
    src = save_tiny_model(family, tmp_path / "src")
    save_tiny_tokenizer(src)
    (tmp_path / "calib.txt").write_text(TOKENIZER_TEXT * 3)
    return src, tmp_path / "calib.txt"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_second_moments_checked_for_are_those_a_measure_writes(tmp_path, family):
    """Every block Linear's X^T X (q/k/v each their own): the bytes checked are the files'
    but their headers; an expert bank's are counted from below (its smaller side as input)."""
    src, calib = _calibrated(tmp_path, family)
    maps = tmp_path / "maps.json"
    assert main(["measure", str(src), "--calib", str(calib), "--no-forecast-check", "-o",
                 str(maps), "--quiet", "--second-moments"]) == 0
    files = list(moments_dir(maps).glob("*.safetensors"))
    assert len(files) == 2  # a file a block
    specs = [s for s in resolve_model(str(src)).tensor_specs() if s.quantizable]
    need, written = moments_nbytes(specs), folder_nbytes(moments_dir(maps))
    assert need <= written
    if family == "llama":
        assert written - need < 2048 * len(files)  # safetensors' headers
        _ratios_are_those_of_the_files(src, maps, specs)
        # not asked for, none are written: the ratios are taken as the pass sums them
        again = tmp_path / "again.json"
        assert main(["measure", str(src), "--calib", str(calib), "--no-forecast-check", "-o",
                     str(again), "--quiet"]) == 0
        assert not moments_dir(again).exists()
        doc, first = json.loads(again.read_text()), json.loads(maps.read_text())
        assert doc["modules"] == first["modules"]


def _ratios_are_those_of_the_files(src, maps, specs) -> None:
    """Each block Linear's gptq ratios in maps.json, taken in the pass, are the bits of
    ``gptq_ratios`` on the X^T X the pass wrote and the statistics beside maps.json."""
    weights = safe_open(str(src / "model.safetensors"), "pt")
    stats = load_file(str(maps.with_name("maps.stats.safetensors")))
    chooser = CodeChooser("rtn", stats)
    modules = json.loads(maps.read_text())["modules"]
    checked = 0
    for path in sorted(moments_dir(maps).glob("*.safetensors")):
        for name, hessian in load_file(str(path)).items():
            spec = next(s for s in specs if s.module == name)
            if len(spec.shape) != 2:
                continue
            weight = weights.get_tensor(spec.name)
            widths = sorted(int(b) for b in modules[name]["gptq_width_ratios"])
            expected = gptq_ratios(spec, weight, hessian,
                                   replace(chooser, moments=GivenMoments(name, hessian)),
                                   widths, 128)
            assert modules[name]["gptq_width_ratios"] == {str(b): r for b, r in
                                                          expected.items()}
            checked += 1
    assert checked == sum(1 for s in specs if ".layers." in s.module and len(s.shape) == 2)


def test_a_run_that_would_fill_its_disk_is_refused_before_it_starts(tmp_path, capsys,
                                                                    monkeypatch):
    src, calib = _calibrated(tmp_path, "llama")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1000))
    maps = tmp_path / "maps.json"
    assert main(["measure", str(src), "--calib", str(calib), "-o", str(maps), "--quiet",
                 "--second-moments"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk space" in err and "second moments" in err
    assert "0.0 MB free" in err
    assert not moments_dir(maps).exists() and not maps.exists()
    out = tmp_path / "q"
    for asked in (["tiny", "--random-init", "--uniform", "4"],
                  [str(src), "--calib", str(calib), "--budget", "4.25"]):
        assert main(["quantize", *asked, "-o", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the checkpoint and its resume store need" in err
        # refused before its measure: nothing beside the output either
        assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "src"]


def test_the_room_asked_before_a_measure_bounds_the_checkpoint(tmp_path, monkeypatch, capsys):
    """The bytes a quantize asks for before its measure (twice the checkpoint: the resume
    store beside it) are the uniform widths' exact bytes, and at a budget no fewer than the
    allocated checkpoint's, within a module's bytes; the size is said before the measure."""
    src, calib = _calibrated(tmp_path, "llama")
    asked: list[int] = []
    real = need_free_space
    # (the check before the measure, then quantize_model's for the allocated widths)
    monkeypatch.setattr(free_space, "need_free_space",
                        lambda folder, nbytes, what: (asked.append(nbytes),
                                                      real(folder, nbytes, what)))
    for n, args in enumerate((["--uniform", "4"], ["--budget", "5.0"])):
        asked.clear()
        out = tmp_path / f"q{n}"
        assert main(["quantize", str(src), "--calib", str(calib), *args, "-o", str(out),
                     *(["--quiet"] if n == 0 else []), "--quantizer", "rtn", "--calib-seqs", "2"]) == 0
        total = json.loads((out / "dynquant.json").read_text())["accounting"]["total_nbytes"]
        assert len(asked) == 2 and asked[1] == 2 * total
        if n == 0:
            assert asked[0] == 2 * total
        else:
            largest = max(m["nbytes"] for m in
                          json.loads((out / "dynquant.json").read_text())["layers"].values())
            assert 2 * total <= asked[0] <= 2 * (total + largest)
            said = f"dynquant: the checkpoint will take at most {asked[0] / 2e6:,.1f} MB ("
            assert said in capsys.readouterr().err


def test_a_failed_forecast_check_leaves_nothing_beside_the_maps(tmp_path, monkeypatch):
    """The forecast check's checkpoints are made inside the measure's partial folder, which a
    rerun resumes from and a finished measure removes: a check that dies leaves no folder of
    its own beside maps.json."""
    src = save_tiny_model("llama", tmp_path / "src")
    save_tiny_tokenizer(src)
    (tmp_path / "calib.txt").write_text(TOKENIZER_TEXT * 40)
    made: list = []

    def dies(_source, _widths, out, **_options):
        made.append(out)
        raise MemoryError("killed inside the check")

    monkeypatch.setattr(forecast_check, "quantize_model", dies)
    maps = tmp_path / "m" / "maps.json"
    with pytest.raises(MemoryError):
        main(["measure", str(src), "--calib", str(tmp_path / "calib.txt"), "--calib-seqs", "4",
              "--calib-len", "32", "-o", str(maps), "--quiet"])
    assert made and made[0].parent.parent == maps.with_name(".maps.json.partial")
    assert sorted(p.name for p in maps.parent.iterdir()) == [".maps.json.partial",
                                                             "maps.stats.safetensors"]
