"""The executor a run asks for by name, and its lifetime."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dynquant.errors import DynquantError
from dynquant.pipeline.execute.executor import Executor, LocalExecutor
from dynquant.pipeline.execute.ray_executor import RayExecutor


def executor_for(spec: Executor | str | None, address: str | None = None) -> Executor:
    """``None``/``"local"``: this process; ``"ray"``: a Ray cluster (``address``: an existing
    one, e.g. ``ray://head:10001`` or ``auto``; None: a local one started for the run)."""
    if isinstance(spec, Executor):
        return spec
    if spec in (None, "local"):
        return LocalExecutor()
    if spec == "ray":
        return RayExecutor(address)
    raise DynquantError(f"unknown executor {spec!r} (local or ray)", field="executor")


@contextmanager
def executor_scope(spec: Executor | str | None, address: str | None = None
                   ) -> Iterator[Executor]:
    """``executor_for``, closed afterwards when it was made here (not a caller's executor)."""
    executor = executor_for(spec, address)
    try:
        yield executor
    finally:
        if executor is not spec:
            executor.close()
