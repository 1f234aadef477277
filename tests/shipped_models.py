"""The reference models the project ships (``models/``), and a checkpoint's files as bytes: what
the tests that compare whole checkpoints share, wherever they live under ``tests/``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[1]
LLAMA_REF = ROOT / "models" / "llama-ref"


def checkpoint_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder by name."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
