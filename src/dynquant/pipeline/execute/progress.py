"""Progress that shows everywhere: rich bars on a terminal; in a log (CI, ``nohup``, ``> log``),
where rich's bars print nothing, one stderr line when a stage starts, one every ``EVERY``
seconds while it runs and one when it ends, with counts, elapsed time and where inside its
current unit it is (``note``). ``enabled=False`` (``--quiet``) silences both.

In a log a heartbeat thread says a running stage's line every ``EVERY`` seconds even when no
unit ends in that time: a 7B model's block takes minutes in one stage, and one product (a
Cholesky factor, a compensated matrix) can take tens of seconds with no Python in between."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich import get_console
from rich.progress import Progress, ProgressColumn

EVERY = 10.0  # seconds between lines of a long stage in a log


@dataclass
class _Stage:
    description: str
    total: int | None
    completed: int = 0
    start: float = field(default_factory=time.monotonic)
    said: float = field(default_factory=time.monotonic)
    ended: bool = False
    note: str = ""  # where inside the current unit the stage is


class StageProgress:
    """The subset of ``rich.progress.Progress`` the pipeline uses (a context manager with
    ``add_task``, ``advance``, ``update``), for a terminal or a log."""

    def __init__(self, *columns: ProgressColumn, enabled: bool = True) -> None:
        self.live = enabled and get_console().is_terminal
        self.log = enabled and not self.live
        self.bar = Progress(*columns, transient=True) if self.live else None
        self.stages: list[_Stage] = []
        self.heartbeat = self.log
        self._lock = threading.Lock()
        self._quit = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> StageProgress:
        if self.bar is not None:
            self.bar.__enter__()
        elif self.heartbeat:
            self._beat = threading.Thread(target=self._beats, name="dynquant-progress",
                                          daemon=True)
            self._beat.start()
        return self

    def _beats(self) -> None:
        """A running stage's line when nothing was said of it for ``EVERY`` seconds."""
        while not self._quit.wait(max(EVERY / 4, 0.05)):
            with self._lock:
                for i, stage in enumerate(self.stages):
                    if not stage.ended and time.monotonic() - stage.said >= EVERY:
                        self._say(i, "running")

    def __exit__(self, *exc) -> None:
        if self._beat is not None:
            self._quit.set()
            self._beat.join()
        if self.bar is not None:
            self.bar.__exit__(*exc)
        elif exc[0] is None:
            for i, stage in enumerate(self.stages):
                if not stage.ended:
                    self._end(i)

    def add_task(self, description: str, total: int | None = None, completed: int = 0) -> int:
        self.stages.append(_Stage(description, total, completed))
        if self.bar is not None:
            return self.bar.add_task(description, total=total, completed=completed)
        self._say(len(self.stages) - 1, "started")
        return len(self.stages) - 1

    def advance(self, task: int, advance: int = 1, note: str = "") -> None:
        """``advance`` units finished (where the stage was inside them is said no more;
        ``note``: what their end found, said with the next line, the stage's "done" included)."""
        self.update(task, completed=self.stages[task].completed + advance, note=note)

    def update(self, task: int, completed: int | None = None, note: str | None = None) -> None:
        """The stage's count of finished units and/or where it is inside the next one."""
        stage = self.stages[task]
        with self._lock:
            stage.completed = stage.completed if completed is None else completed
            stage.note = stage.note if note is None else note
            if self.bar is not None:
                described = f"{stage.description} ({stage.note})" if stage.note else None
                self.bar.update(task, completed=stage.completed,
                                description=described or stage.description)
            elif stage.total is not None and stage.completed >= stage.total:
                self._end(task)
            elif time.monotonic() - stage.said >= EVERY:
                self._say(task, "running")

    def note(self, task: int, note: str) -> None:
        """Where the stage is inside its current unit (said with its next line)."""
        self.update(task, note=note)

    def finish(self, task: int) -> None:
        """End a stage whose total was not known when it started."""
        stage = self.stages[task]
        stage.total = stage.completed
        if self.bar is not None:
            self.bar.update(task, total=stage.total, completed=stage.completed)
        elif not stage.ended:
            self._end(task)

    def _end(self, task: int) -> None:
        self.stages[task].ended = True
        self._say(task, "done")
        self.stages[task].note = ""

    def _say(self, task: int, state: str) -> None:
        if not self.log:
            return
        stage = self.stages[task]
        stage.said = time.monotonic()
        count = f"{stage.completed}/{stage.total}" if stage.total else f"{stage.completed}"
        note = f" ({stage.note})" if stage.note else ""
        print(f"dynquant: {stage.description}: {state}, {count}, "
              f"{stage.said - stage.start:.0f} s{note}", file=sys.stderr, flush=True)


# what a job run in this process (an executor's job, here) says on the driver's progress line; a
# worker's job says nothing (its steps are the driver's wait)
_JOB_NOTES: list[Callable[[str], None]] = []


@contextmanager
def job_notes(say: Callable[[str], None]) -> Iterator[None]:
    """Jobs run in this process while the context lasts report to ``say`` (``job_note``)."""
    _JOB_NOTES.append(say)
    try:
        yield
    finally:
        _JOB_NOTES.pop()


def job_note() -> Callable[[str], None]:
    """Where a job says what it is doing: the driver's line when it runs here, else nowhere."""
    return _JOB_NOTES[-1] if _JOB_NOTES else (lambda _: None)
