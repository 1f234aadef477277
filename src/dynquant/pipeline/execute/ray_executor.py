"""The Ray executor: the per-tensor work of measure and quantize on Ray workers.

Each job is one Ray task (one CPU) that reads its own tensor from the model folder (a path every
worker sees: a shared filesystem, or each worker's own copy at the same path) and returns the
packed tensors and statistics as a Ray object. At most ``max_in_flight`` tasks, and results of
at most ``max_in_flight_bytes`` (when the caller says what each result weighs), are submitted
and not yet collected: backpressure, so the object store holds a bounded amount and the driver,
which fetches one result at a time, stays small. Results are collected in the jobs' order, so
the driver writes exactly what a local run writes.

Fault tolerance is Ray's: a task whose worker dies is run again (``max_retries``); a driver
killed mid-run resumes from the run's resume store like a local one.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dynquant.errors import DynquantError
from dynquant.pipeline.execute.executor import Executor, J, R, S, Submitted

MAX_RETRIES = 3  # runs of a task whose worker died, after the first
MAX_IN_FLIGHT_BYTES = 2 << 30  # results submitted and not yet collected (one may be larger)
# A worker idle this long exits (Ray's default: 1 s past its soft limit of one worker a CPU).
# A block's jobs come in bursts (a shard's forwards asking 2 CPUs, then matrices asking 1) with
# the driver's factor between them; with the default, Ray started workers for the queued jobs
# and retired the warm ones, and each new worker paid its imports and the model's skeleton
# (~3 s): a SmolLM2 GPTQ pass took 5x the local one.
IDLE_WORKER_SECONDS = 300


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise DynquantError("the Ray executor needs ray: pip install 'dynquant[ray]'",
                            field="executor") from exc
    return ray


class RayExecutor(Executor):
    """Jobs as Ray tasks. ``address``: an existing cluster (``auto``, ``ray://HOST:10001``);
    None starts a local instance with ``workers`` CPUs (default: all) and stops it on close.
    ``max_in_flight`` bounds the submitted-but-not-collected tasks (default: 2 per CPU), and
    ``max_in_flight_bytes`` their results' bytes."""

    name = "ray"
    runs_here = False

    def __init__(self, address: str | None = None, workers: int | None = None,
                 max_in_flight: int | None = None,
                 max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
                 max_retries: int = MAX_RETRIES) -> None:
        self.address, self.workers = address, workers
        self.max_in_flight, self.max_in_flight_bytes = max_in_flight, max_in_flight_bytes
        self.max_retries = max_retries
        self.peak_in_flight = 0  # the most tasks in flight at once so far (tests, benchmarks)
        self._started = False

    def _connect(self) -> Any:
        ray = _ray()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
            if self.address is None:
                kwargs.update(num_cpus=self.workers or os.cpu_count(), include_dashboard=False,
                              _system_config={"idle_worker_killing_time_threshold_ms":
                                              IDLE_WORKER_SECONDS * 1000})
                self._started = True
            try:
                ray.init(address=self.address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise DynquantError(f"cannot reach the Ray cluster: {exc}",
                                    field="ray") from None
        return ray

    def _limit(self, ray: Any) -> int:
        if self.max_in_flight is not None:
            return max(1, self.max_in_flight)
        return max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable[[J, S], R], jobs: Iterable[J], shared: S,
            nbytes: Callable[[J], int] | None = None, cpus: int = 1) -> Iterator[R]:
        ray = self._connect()
        task = self._task(ray, fn, cpus)
        shared_ref = ray.put(shared)  # sent to the object store once, not with every job
        limit = self._limit(ray)
        pending: deque = deque()  # (ref, bytes of its result), oldest first
        try:
            for job in jobs:
                size = 0 if nbytes is None else nbytes(job)
                while pending and (len(pending) >= limit or sum(
                        b for _, b in pending) + size > self.max_in_flight_bytes):
                    yield self._collect(ray, pending.popleft()[0])
                pending.append((task.remote(job, shared_ref), size))
                self.peak_in_flight = max(self.peak_in_flight, len(pending))
            while pending:
                yield self._collect(ray, pending.popleft()[0])
        finally:
            for ref, _ in pending:  # a failed or abandoned run: stop what is still queued
                ray.cancel(ref, force=True)

    def submit(self, fn: Callable[[J, S], R], job: J, shared: S, cpus: int = 1
               ) -> Submitted[R]:
        ray = self._connect()
        ref = self._task(ray, fn, cpus).remote(job, shared)
        return Submitted(lambda: bool(ray.wait([ref], timeout=0)[0]),
                         lambda: self._collect(ray, ref))

    def slots(self, cpus: int = 1) -> int:
        ray = self._connect()
        return max(1, int(ray.cluster_resources().get("CPU", 1)) // max(cpus, 1))

    def _task(self, ray: Any, fn: Callable, cpus: int) -> Any:
        # no more than the largest node has: a task asking for more would never be scheduled
        widest = max((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["Alive"]),
                     default=1)
        return ray.remote(num_cpus=min(cpus, widest), max_retries=self.max_retries,
                          retry_exceptions=False)(fn)

    def _collect(self, ray: Any, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            # the worker's own typed error (bad input names its file and module), not Ray's
            # wrapper with a remote traceback
            if isinstance(exc.cause, DynquantError):
                raise exc.cause from None
            raise
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as exc:
            raise DynquantError(f"a Ray worker died {self.max_retries + 1} times on one task "
                                f"({type(exc).__name__})", field="ray") from None

    def idle(self) -> None:
        """Stop the Ray instance this executor started (the next ``map`` starts one): the
        driver has mapped the object store's pages its results passed through, and they count
        in its memory until then (~180 MiB after the 885 M-parameter model's quantize)."""
        self.close()

    def close(self) -> None:
        if self._started:
            _ray().shutdown()
            self._started = False
