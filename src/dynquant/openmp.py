"""OpenMP's waiting policy, set before torch loads its OpenMP runtime.

torch's CPU kernels run on libgomp, whose idle threads spin for ~300,000 iterations before they
sleep. On a machine where another process is busy, a spinning thread holds a core while the
thread it waits for is descheduled, and every parallel region of a forward pass pays for it:
the demo took 60-67 s with one competing busy process on 2 cores against 20-22 s quiet (measured
2026-11-30). A short spin (``GOMP_SPINCOUNT=1000``) keeps the quiet speed (22 s) and halves the
loss under load (44-48 s); a fully passive wait (``OMP_WAIT_POLICY=PASSIVE``) is steadier still
under load (32 s) but slower when quiet (31-34 s).

libgomp reads these variables once, when it loads (``import torch``): ``import dynquant`` before
torch, and the ``dynquant`` command, set the short spin unless the user set either variable.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "1000"
# Whether torch had loaded its OpenMP runtime, with no policy chosen, before dynquant could set one.
too_late = False


def set_short_spin() -> bool:
    """Set ``GOMP_SPINCOUNT`` unless the user chose a policy or torch is already loaded;
    whether it was set."""
    global too_late
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    if "torch" in sys.modules:
        too_late = True
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def warn_if_too_late() -> None:
    """Once, where it matters (loading a model to run): torch's threads spin long."""
    global too_late
    if too_late:
        import warnings

        too_late = False
        warnings.warn("dynquant: torch was imported before dynquant, so its OpenMP threads spin "
                      "~300,000 iterations when idle and hold the cores the packed kernels' "
                      "threads need (decode up to 1.3x slower); import dynquant first or set "
                      "GOMP_SPINCOUNT=1000", RuntimeWarning, stacklevel=3)
