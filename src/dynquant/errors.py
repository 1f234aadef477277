"""Typed errors. Every error that reaches a user names the file, module and field it is about."""

from __future__ import annotations


class DynquantError(Exception):
    """Base class of all errors dynquant raises on purpose (the CLI prints them in one line)."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        module: str | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.module = module
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = [part for part in (self.file, self.module, self.field) if part]
        return f"{': '.join(where)}: {self.message}" if where else self.message


class CheckpointError(DynquantError):
    """A checkpoint or metadata document that breaks the dynquant_checkpoint_v2 format."""


class QuantizationError(DynquantError):
    """A weight that cannot be quantized as asked (unsupported width, bad shape, non-finite values)."""


class ModelError(DynquantError):
    """A model source that dynquant cannot read (missing config, unknown preset, bad widths file)."""
