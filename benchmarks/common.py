"""Shared helpers: a best-of timer, peak RSS of a child run, and one-line figures."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def best_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 2) -> float:
    """The fastest of ``repeat`` runs, in seconds (after ``warmup`` runs)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_child(args: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a child Python process running ``args`` (that child's
    own peak, from wait4: not the maximum over every child this process ever had)."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, args)
    return wall, usage.ru_maxrss * 1024


def figure(name: str, value: float, unit: str = "") -> None:
    print(f"{name}: {value:.4g}{(' ' + unit) if unit else ''}", flush=True)


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}")
