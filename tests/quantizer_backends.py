"""Run the quantizer on one of its two backends (the native kernel or the torch path)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

BACKENDS = ("native", "torch")


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the quantizer on one backend: the native kernel or the torch path."""
    old = os.environ.get("DYNQUANT_NATIVE")
    os.environ["DYNQUANT_NATIVE"] = "1" if name == "native" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DYNQUANT_NATIVE"]
        else:
            os.environ["DYNQUANT_NATIVE"] = old
