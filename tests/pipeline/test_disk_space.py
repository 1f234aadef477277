"""Runs that would fill their disk are refused before they start, in one line, leaving nothing
behind; the bytes a measure is checked for are the bytes its second moments take, and those
are kept only where asked for."""

from __future__ import annotations

import json
import shutil

import pytest

from dynquant.checkpoint.free_space import folder_nbytes
from dynquant.cli import main
from dynquant.models.sources import resolve_model
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
        # not asked for, they serve the measure's gptq ratios and go with its end
        again = tmp_path / "again.json"
        assert main(["measure", str(src), "--calib", str(calib), "--no-forecast-check", "-o",
                     str(again), "--quiet"]) == 0
        doc = json.loads(again.read_text())
        blocks = [m for name, m in doc["modules"].items() if ".layers." in name]
        assert blocks and all("gptq_ratio" in m for m in blocks)
        assert not moments_dir(again).exists()


def test_a_run_that_would_fill_its_disk_is_refused_before_it_starts(tmp_path, capsys,
                                                                    monkeypatch):
    src, calib = _calibrated(tmp_path, "llama")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1000))
    maps = tmp_path / "maps.json"
    assert main(["measure", str(src), "--calib", str(calib), "-o", str(maps), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk space" in err and "second moments" in err
    assert "0.0 MB free" in err
    assert not moments_dir(maps).exists() and not maps.exists()
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "--random-init", "--uniform", "4", "-o", str(out),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the checkpoint and its resume store need" in err
    assert not out.exists() and not (tmp_path / ".q.partial").exists()
