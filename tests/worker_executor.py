"""An executor that runs each job as a Ray worker process would, in this process: on a block
skeleton of its own (the driver's is set aside while the job runs), so the block's weights are
read from the model's files and whatever the job carries is put in place, not the driver's
block. What a worker computes, checked without a cluster."""

from __future__ import annotations

from dynquant.pipeline.calibrate import calibration_pass
from dynquant.pipeline.execute.executor import LocalExecutor, Submitted


class AsAWorker(LocalExecutor):
    def map(self, fn, jobs, shared, nbytes=None, cpus=1):
        for job in jobs:
            yield _as_a_worker(fn, job, shared)

    def submit(self, fn, job, shared, cpus=1):
        result = _as_a_worker(fn, job, shared)
        return Submitted(lambda: True, lambda: result)


def _as_a_worker(fn, job, shared):
    kept = dict(calibration_pass._STREAMS)
    calibration_pass._STREAMS.clear()
    try:
        return fn(job, shared)
    finally:
        calibration_pass._STREAMS.clear()
        calibration_pass._STREAMS.update(kept)
