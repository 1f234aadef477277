"""A loop step that makes and frees three float32 tensors of one size (a tuning step's or a
chunked error sum's pattern, in small), as the source of a child process: ``step()`` returns its
minor page faults (~size / 4 KiB a tensor when each is mapped afresh, ~0 when freed memory is
reused). The malloc settings under test are the child's own, so each probe runs in one, on one
torch thread: the kernels' threads allocate from arenas of their own, whose reuse varies with
their timing (on a loaded machine a step inside ``heap_served`` now and then mapped a tensor
afresh)."""

from __future__ import annotations

import os
import subprocess
import sys


def step_source(rows: int, cols: int) -> str:
    """The child's imports, ``faults()`` and ``step()`` for tensors of ``rows`` x ``cols``."""
    return f"""
import os, resource, torch

torch.set_num_threads(1)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

codes = torch.randint(0, 16, ({rows}, {cols}), dtype=torch.uint8)
scales = torch.rand({rows}, 1)

def step():
    before = faults()
    w = codes * scales
    g = torch.ones_like(w)
    (g * codes).sum()
    return faults() - before
"""


def step_pages(rows: int, cols: int) -> int:
    """A step's pages when every tensor is mapped afresh."""
    return 3 * rows * cols * 4 // 4096


def run_probe(source: str, env: dict[str, str] | None = None) -> list[str]:
    """The child's printed words; by default with no malloc setting or preload of the user's."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.pop("LD_PRELOAD", None)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          check=True, env=env).stdout.split()
