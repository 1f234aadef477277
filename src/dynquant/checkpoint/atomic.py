"""Atomic directory output: everything is written into a sibling temp dir, then renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dynquant.errors import CheckpointError


def make_temp_dir(target: Path) -> Path:
    """A fresh temp dir beside ``target`` (same filesystem, so the final rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a checkpoint is an ordinary folder
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_dir(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move ``tmp`` to ``target``; an existing target is replaced only when ``overwrite``."""
    if target.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError("output exists (use --overwrite to replace it)", file=str(target))
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, trash / "old")
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)


def fsync_file(path: Path) -> None:
    """Flush ``path`` to disk and give it ordinary permissions (some writers make it 0600)."""
    os.chmod(path, 0o666 & ~_umask())
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
