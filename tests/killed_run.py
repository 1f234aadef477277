"""A quantize killed (SIGKILL) from outside the production loop once a chosen number of tensors
are in its resume store: the run the resume tests start in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import os, signal, sys
from dynquant.pipeline.codes import write
real = write.quantize_model

def killing(*args, **kwargs):
    def hook(index):
        if index + 1 >= {kill_after}:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, on_tensor=hook, **kwargs)

write.quantize_model = killing
from dynquant.cli import main
sys.exit(main({argv!r}))
"""


def quantize_argv(out: Path, *extra: str) -> list[str]:
    """The resume tests' quantize: the tiny preset, random weights, uniform 4 bits."""
    return ["quantize", "tiny", "--random-init", "--uniform", "4", "-o", str(out), "--quiet",
            *extra]


def killed_quantize(out: Path, kill_after: int, *extra: str) -> int:
    """Run ``quantize_argv(out, *extra)`` in a child killed after ``kill_after`` tensors; its
    return code (-SIGKILL when the kill came)."""
    script = _SCRIPT.format(kill_after=kill_after, argv=quantize_argv(out, *extra))
    return subprocess.run([sys.executable, "-c", script], capture_output=True).returncode
