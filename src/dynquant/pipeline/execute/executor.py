"""Where the per-tensor work of measure and quantize runs: this process, or a Ray cluster.

The work is a pure function ``fn(job, shared) -> result``: ``job`` names one tensor (its spec,
its widths), ``shared`` is what every job of a run needs (where the weights are, how codes are
chosen); the function reads its tensor itself. An executor maps the function over the jobs and
yields the results **in the jobs' order**, so the driver writes the same bytes whichever
executor ran them. ``LocalExecutor`` is the plain loop (the default); ``RayExecutor``
(``pipeline/execute/ray_executor.py``) runs the same function on Ray workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")
S = TypeVar("S")
K = TypeVar("K")
# blocks whose submitted jobs are not yet taken back, at least (or as many as the cluster runs
# at once): each holds its windows' hidden states in the cluster's object store
IN_FLIGHT = 8


@dataclass(frozen=True)
class Submitted(Generic[R]):
    """A job started by ``Executor.submit``: whether its result is back, and the result
    (waiting for it)."""

    done: Callable[[], bool]
    result: Callable[[], R]


class Executor:
    """Maps a pure function over jobs; results come back in the jobs' order."""

    name = "local"
    # jobs run in this process: a job's input that the driver can hold once for many jobs (a
    # decoder block's weights) is worth holding here
    runs_here = True

    def map(self, fn: Callable[[J, S], R], jobs: Iterable[J], shared: S,
            nbytes: Callable[[J], int] | None = None, cpus: int = 1) -> Iterator[R]:
        """``fn(job, shared)`` for every job, in order. ``nbytes``: the size of a job's result,
        for executors that bound the bytes of results not yet collected; ``cpus``: the threads
        one job uses (a cluster reserves them)."""
        raise NotImplementedError

    def submit(self, fn: Callable[[J, S], R], job: J, shared: S, cpus: int = 1
               ) -> Submitted[R]:
        """``fn(job, shared)`` started now. The driver goes on with other work meanwhile where
        the job runs elsewhere; here it runs at once (this process's threads are the driver's)."""
        result = fn(job, shared)
        return Submitted(lambda: True, lambda: result)

    def slots(self, cpus: int = 1) -> int:
        """How many jobs of ``cpus`` threads run at once (here: one)."""
        return 1

    def idle(self) -> None:
        """No more jobs for a while: release what can be started again by the next ``map``."""

    def close(self) -> None:
        """Release what the executor started (a local Ray instance)."""


class LocalExecutor(Executor):
    """One job after the other, in this process (its kernels use this process's threads)."""

    def map(self, fn: Callable[[J, S], R], jobs: Iterable[J], shared: S,
            nbytes: Callable[[J], int] | None = None, cpus: int = 1) -> Iterator[R]:
        for job in jobs:
            yield fn(job, shared)


def use_threads(threads: int) -> None:
    """Run this process's torch work on ``threads`` threads: what a job whose float results
    depend on the thread count (a block's forward, GPTQ's factor) does on a worker, to compute
    the driver's bits (the task reserves that many CPUs: ``map(..., cpus=threads)``)."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class InOrder(Generic[K, R]):
    """Jobs submitted a block at a time (``add``: the block's key and its jobs) and taken back
    in the order they were added, so the driver folds and writes the same bytes on any
    executor. ``ready`` gives the oldest block's results while its jobs are back, or while more
    than ``max(IN_FLIGHT, executor.slots(cpus))`` blocks wait, and every block's at ``end``."""

    def __init__(self, executor: Executor, cpus: int) -> None:
        self.limit = max(IN_FLIGHT, executor.slots(cpus))
        self.waiting: deque[tuple[K, list[Submitted[R]]]] = deque()

    def add(self, key: K, jobs: list[Submitted[R]]) -> None:
        self.waiting.append((key, jobs))

    def ready(self, end: bool = False) -> Iterator[tuple[K, list[R]]]:
        while self.waiting and (end or len(self.waiting) > self.limit
                                or all(job.done() for job in self.waiting[0][1])):
            key, jobs = self.waiting.popleft()
            yield key, [job.result() for job in jobs]
