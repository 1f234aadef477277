"""Shared helpers: a best-of timer, peak RSS of a child run, one-line figures, a rerun as on an
AVX2-only CPU, and the real models the quality tables run on."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scripts.prepare_real_model import real_model

# As on an AVX2-only CPU: dynquant's kernels built for x86-64-v3 and torch's own kernels capped at
# AVX2 (the nearest an AVX-512 machine gets to a real AVX2 part; it keeps its caches and clock).
AVX2_LIMITS = {"DYNQUANT_NATIVE_ARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
               "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
               "DYNQUANT_BLAS_KERNELS": "off"}  # what auto does on an AVX2-only AMD CPU


def rerun_as_avx2(module: str, args: list[str]) -> None:
    """Run ``python -m module args`` again under AVX2_LIMITS in float32 (what ``auto`` picks on
    such a CPU), and exit with its status. The same cache directory: the real model is found
    there, and the kernels built for x86-64-v3 are cached under their own key (the build's flags
    are part of it)."""
    import os

    env = {**os.environ, **AVX2_LIMITS, "DYNQUANT_DTYPE": "float32"}
    sys.exit(subprocess.run([sys.executable, "-m", module, *args], env=env).returncode)


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
    """(wall seconds, peak RSS bytes) of a child Python process running ``args``.

    The child is started by GNU time, a tiny process: a child forked straight from this one
    would count this process's memory (copied at fork) in its own peak.
    """
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, args, stderr=proc.stderr)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("maxrss_kb=")][-1]
    return wall, int(line.split("=")[1]) * 1024


def figure(name: str, value: float, unit: str = "") -> None:
    print(f"{name}: {value:.4g}{(' ' + unit) if unit else ''}", flush=True)


def machine() -> str:
    """The machine in one line: CPU model, class and the flags that decide the kernels,
    threads, torch and the kernels its BLAS runs."""
    import os

    from dynquant.blas_kernels import describe
    from dynquant.numerics.compute_dtype import cpu_class, cpu_flags, cpu_model

    shown = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))
                   or f in ("bf16", "asimd", "i8mm", "sve"))
    limits = {k: os.environ[k] for k in (*AVX2_LIMITS, "DYNQUANT_DTYPE", "OPENBLAS_CORETYPE")
              if k in os.environ}
    return (f"{cpu_model()} ({cpu_class()}: {' '.join(shown)}), "
            f"{torch.get_num_threads()} threads, torch {torch.__version__} ({describe()})"
            + (f", limited by {limits}" if limits else ""))


def quality_models(root) -> dict:
    """The models every quality table covers: both reference models, and the real pretrained
    model when it is prepared (else a line says it is skipped)."""
    models = {"hybrid-ref": root / "models" / "hybrid-ref", "llama-ref": root / "models" / "llama-ref"}
    real = real_model()
    if real is None:
        print("real model not prepared (python scripts/prepare_real_model.py): skipped")
    else:
        models["smollm2-135m"] = real
    return models


def prepared_real_model(name: str) -> Path:
    """A prepared real model's folder; the run stops with the command that prepares it when it
    is not there."""
    model_dir = real_model(name)
    if model_dir is None:
        raise SystemExit(f"the real model is not prepared: python scripts/prepare_real_model.py "
                         f"{name}")
    return model_dir
