"""Free space checked before work that writes much: a run that would fill its disk is refused
before it starts, not stopped by ENOSPC hours into the work."""

from __future__ import annotations

import shutil
from pathlib import Path

from dynquant.checkpoint.resume import PartialDir
from dynquant.errors import DynquantError


def folder_nbytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 where it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def need_free_space(folder: str | Path, nbytes: int, what: str) -> None:
    """Raise unless ``nbytes`` more of ``what`` fit in the free space of ``folder``'s disk (its
    nearest existing ancestor's, where it is not made yet)."""
    where = Path(folder).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise DynquantError(f"{what} need {_gb(nbytes)} more on this disk, which has "
                            f"{_gb(free)} free", file=str(folder), field="disk space")


def need_checkpoint_space(out: str | Path, total_nbytes: int) -> None:
    """Raise unless a checkpoint of ``total_nbytes`` fits at ``out`` beside its resume store
    (the store's tensors and the checkpoint made from them are on the disk at once), less what
    the store already holds."""
    need_free_space(Path(out).parent, 2 * total_nbytes - folder_nbytes(PartialDir.folder(out)),
                    "the checkpoint and its resume store")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
