"""Checkpoint I/O: writing and reading dynquant-packed checkpoint directories (torch tensors)."""

from dynquant.checkpoint.reader import Checkpoint, open_checkpoint
from dynquant.checkpoint.writer import CheckpointWriter, write_checkpoint

__all__ = ["Checkpoint", "CheckpointWriter", "open_checkpoint", "write_checkpoint"]
