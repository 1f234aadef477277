"""Progress in a log (issue 15): stage lines with counts and elapsed time where rich's bars
print nothing, and silence with --quiet."""

from __future__ import annotations

import re

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


def _log_only(self, *columns, enabled=True):  # as when stderr is not a terminal
    self.live, self.log, self.bar, self.stages = False, enabled, None, []
