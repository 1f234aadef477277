"""Progress in a log: stage lines with counts and elapsed time where rich's bars
print nothing, and silence with --quiet."""

from __future__ import annotations

import re
import time
from pathlib import Path

from dynquant.cli import main
from dynquant.pipeline.execute import progress as progress_mod
from dynquant.pipeline.execute.progress import StageProgress


def _quantize(out, capsys, *extra: str) -> str:
    """What ``dynquant quantize`` writes to stderr when it is a log, not a terminal."""
    capsys.readouterr()
    assert main(["quantize", "tiny", "--random-init", "--uniform", "4", "-o", str(out),
                 *extra]) == 0
    return capsys.readouterr().err


def test_a_run_into_a_log_says_each_stage(tmp_path, capsys):
    err = _quantize(tmp_path / "q", capsys)
    assert re.search(r"^dynquant: measuring: started, 0/\d+, \d+ s$", err, re.M), err
    done = re.search(r"^dynquant: quantizing: done, (\d+)/(\d+), \d+ s$", err, re.M)
    assert done and done.group(1) == done.group(2), err
    quiet = _quantize(tmp_path / "quiet", capsys, "--quiet")
    assert "dynquant:" not in quiet, quiet


def test_long_stages_say_where_they_are(monkeypatch, capsys):
    monkeypatch.setattr(progress_mod, "EVERY", 0.0)
    monkeypatch.setattr(StageProgress, "__init__", _log_only)
    with StageProgress(enabled=True) as bar:
        task = bar.add_task("work", total=3)
        bar.advance(task)
        bar.advance(task)
        bar.advance(task)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0:2] for line in lines] == [
        ["dynquant: work: started", " 0/3"], ["dynquant: work: running", " 1/3"],
        ["dynquant: work: running", " 2/3"], ["dynquant: work: done", " 3/3"]]


def test_what_a_stage_s_end_found_is_in_its_done_line(monkeypatch, capsys):
    """A note given with the last units (the end-to-end pass's verdict) is said with "done";
    a note inside a unit is not said once the unit is finished."""
    monkeypatch.setattr(StageProgress, "__init__", _log_only)
    with StageProgress(enabled=True) as bar:
        task = bar.add_task("work", total=2)
        bar.note(task, "inside the first unit")
        bar.advance(task)
        bar.advance(task, note="held-out KL 0.2 -> 0.1: kept")
        other = bar.add_task("other", total=1)
        bar.note(other, "inside")
        bar.advance(other)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(", ")[0] + line[line.rindex(" s") + 2:] for line in lines] == [
        "dynquant: work: started", "dynquant: work: done (held-out KL 0.2 -> 0.1: kept)",
        "dynquant: other: started", "dynquant: other: done"]


_INIT = StageProgress.__init__


def _log_only(self, *columns, enabled=True):  # as when stderr is not a terminal
    _INIT(self, *columns, enabled=False)
    self.log = enabled  # lines only where a unit ends: no heartbeat


def test_a_block_that_takes_long_is_reported_inside(tmp_path, monkeypatch, capsys):
    """A slow stand-in for a decoder block: the gptq stage's lines come while the block runs,
    saying which group and window it is at."""
    from dynquant.models.sources import resolve_model
    from dynquant.models.tokenizer import load_tokenizer
    from dynquant.pipeline.calibrate.block_stream import BlockStream
    from dynquant.pipeline.calibrate.text import calibration_ids, default_calibration
    from dynquant.pipeline.codes.code_chooser import CodeChooser
    from dynquant.pipeline.codes.sequential_gptq import SequentialCalibration
    from dynquant.pipeline.codes.write import quantize_model

    model = Path(__file__).parents[2] / "models" / "llama-ref"
    ids = calibration_ids(load_tokenizer(model), [str(default_calibration())], 2, 32)
    run_block = BlockStream.run_block

    def slow_block(self, *args, **kwargs):
        time.sleep(0.4)
        return run_block(self, *args, **kwargs)

    monkeypatch.setattr(BlockStream, "run_block", slow_block)
    monkeypatch.setattr(progress_mod, "EVERY", 0.1)
    source = resolve_model(str(model))
    widths = {s.module: 4 for s in source.tensor_specs() if s.quantizable}
    capsys.readouterr()
    quantize_model(source, widths, tmp_path / "q", progress=True,
                   chooser=CodeChooser("gptq", sequential=SequentialCalibration(ids)))
    err = capsys.readouterr().err
    inside = re.findall(r"^dynquant: gptq, block by block: running, (\d)/4, [\d.]+ s "
                        r"\(block (\d): its output: \d/2 shards of the windows\)$", err, re.M)
    # every block is seen running while its (slow) output is computed, before it is counted
    assert sorted({(int(done), int(block)) for done, block in inside}) == [
        (0, 1), (1, 2), (2, 3), (3, 4)], err
