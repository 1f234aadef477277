"""GPTQ's inverse factor rounds by the number of threads its LAPACK runs on; it runs on torch's
thread count whatever the process's environment said to scipy's OpenBLAS, so a Ray worker (whose
environment is not the driver's) factors to the driver's bits."""

from __future__ import annotations

import os
import subprocess
import sys

from dynquant.numerics.lapack_threads import _set_local

FACTOR = """
import hashlib, numpy as np, torch
torch.set_num_threads(2)
from dynquant.numerics.gptq import ordered_factor
# small integers: X^T X is exact in float32 whatever numpy's BLAS splits it into (with
# OPENBLAS_CORETYPE=Haswell its products of normal draws round by thread count)
x = np.random.default_rng(0).integers(-8, 9, (2048, 1536)).astype(np.float32)
u = ordered_factor(torch.from_numpy(x.T @ x / 2048))
print(hashlib.sha256(u.numpy().tobytes()).hexdigest())
"""


def _factor_digest(blas_threads: int) -> str:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(blas_threads),
           "OMP_NUM_THREADS": str(blas_threads)}
    return subprocess.run([sys.executable, "-c", FACTOR], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_factor_is_the_same_bits_whatever_openblas_was_told():
    assert _set_local() is not None  # scipy's own OpenBLAS, whose thread count is set
    assert _factor_digest(1) == _factor_digest(2)
