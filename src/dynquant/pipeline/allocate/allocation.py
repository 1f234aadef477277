"""The exact budget allocator: one (width, group size) per module, least predicted error.

A multiple-choice knapsack: choose exactly one candidate per module to minimise
``sum_m sensitivity_m * error_m(choice)`` subject to ``8 * sum_m nbytes_m(choice) <=
budget * sum_m elements_m`` (the budget counts scale/offset overhead exactly like the seed's
``average_bits``). Solved to optimality as a MILP by HiGHS (scipy.optimize.milp, zero gap).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from dynquant.errors import DynquantError


class AllocationError(DynquantError):
    """A budget or constraint set that no choice of widths can meet."""


@dataclass(frozen=True)
class Candidate:
    bits: int
    group_size: int
    nbytes: int
    error: float  # relative squared error of this choice (importance-weighted if stats exist)


@dataclass
class ModuleChoices:
    name: str
    elements: int
    sensitivity: float
    candidates: list[Candidate]


@dataclass
class Constraints:
    """User constraints: pins by glob (``pattern -> bits``), width bounds, allowed group sizes."""

    pins: dict[str, int] = field(default_factory=dict)
    min_bits: int | None = None
    max_bits: int | None = None
    group_sizes: Sequence[int] | None = None

    def allowed(self, module: str, cand: Candidate) -> bool:
        pinned = [b for pat, b in self.pins.items() if fnmatch.fnmatchcase(module, pat)]
        if pinned:
            return cand.bits == pinned[-1]  # the last matching pin wins
        if self.min_bits is not None and cand.bits < self.min_bits:
            return False
        if self.max_bits is not None and cand.bits > self.max_bits:
            return False
        return self.group_sizes is None or cand.group_size in self.group_sizes


@dataclass
class Allocation:
    widths: dict[str, tuple[int, int]]  # module -> (bits, group size)
    packed_nbytes: int
    elements: int
    predicted_error: float

    @property
    def average_bits(self) -> float:
        return round(self.packed_nbytes * 8 / self.elements, 6)


def _filtered(modules: Sequence[ModuleChoices], cons: Constraints) -> list[list[Candidate]]:
    options = []
    for m in modules:
        ok = [c for c in m.candidates if cons.allowed(m.name, c)]
        if not ok:
            raise AllocationError("no candidate width satisfies the constraints",
                                  module=m.name, field="pin")
        options.append(ok)
    return options


def reachable_range(modules: Sequence[ModuleChoices], cons: Constraints | None = None
                    ) -> tuple[float, float]:
    """The smallest and largest average bits the constraints allow."""
    options = _filtered(modules, cons or Constraints())
    elements = sum(m.elements for m in modules)
    lo = sum(min(c.nbytes for c in opts) for opts in options) * 8 / elements
    hi = sum(max(c.nbytes for c in opts) for opts in options) * 8 / elements
    return lo, hi


def _result(modules: Sequence[ModuleChoices], picks: list[Candidate]) -> Allocation:
    return Allocation(
        widths={m.name: (c.bits, c.group_size) for m, c in zip(modules, picks, strict=True)},
        packed_nbytes=sum(c.nbytes for c in picks),
        elements=sum(m.elements for m in modules),
        predicted_error=sum(m.sensitivity * c.error for m, c in zip(modules, picks,
                                                                    strict=True)),
    )


def allocate_widths(modules: Sequence[ModuleChoices], budget: float,
                    constraints: Constraints | None = None) -> Allocation:
    """The exact optimum of the multiple-choice knapsack at ``budget`` bits per weight."""
    cons = constraints or Constraints()
    options = _filtered(modules, cons)
    lo, hi = reachable_range(modules, cons)
    elements = sum(m.elements for m in modules)
    # Sizes are whole bytes: the budget allows at most floor(budget * elements / 8) of them.
    # Half a byte of slack keeps the solver's feasibility tolerance from admitting one more.
    capacity = math.floor(budget * elements / 8) + 0.5
    if min(sum(min(c.nbytes for c in o) for o in options), float("inf")) > capacity:
        raise AllocationError(f"budget {budget} bits is unreachable: the reachable range is "
                              f"{lo:.6f} to {hi:.6f} bits per weight", field="budget")
    cost = np.array([m.sensitivity * c.error for m, o in zip(modules, options, strict=True)
                     for c in o])
    size = np.array([c.nbytes for o in options for c in o], dtype=float)
    n = len(cost)
    choose = np.zeros((len(options), n))
    col = 0
    for i, o in enumerate(options):
        choose[i, col:col + len(o)] = 1
        col += len(o)
    # HiGHS stops within an absolute objective gap of 1e-6: scale the objective so that its
    # lower bound (every module at its cheapest error) is 1e6, making that gap negligible.
    lower, col = 0.0, 0
    for o in options:
        lower += float(cost[col:col + len(o)].min())
        col += len(o)
    scale = 1e6 / lower if lower > 0 else 1.0
    with _native_stdout_silenced():
        res = milp(cost * scale, integrality=np.ones(n),
                   bounds=Bounds(0, 1),
                   constraints=[LinearConstraint(choose, 1, 1),
                                LinearConstraint(size[None, :], -np.inf, capacity)],
                   options={"mip_rel_gap": 0.0, "presolve": True})
    if res.x is None:
        raise AllocationError(f"no allocation found for budget {budget} ({res.message})",
                              field="budget")
    x = np.round(res.x).astype(bool)
    picks, col = [], 0
    for o in options:
        picks.append(o[int(np.argmax(x[col:col + len(o)]))])
        col += len(o)
    result = _result(modules, picks)
    if result.packed_nbytes * 8 > budget * elements:  # never trust a tolerance with a budget
        raise AllocationError(f"solver returned {result.average_bits} bits for budget {budget}",
                              field="budget")
    return result


@contextlib.contextmanager
def _native_stdout_silenced():
    """HiGHS (1.7-1.12) prints a stray debug line ("HighsMipSolverData::transformNewInteger
    FeasibleSolution tmpSolver.run();") to the C stdout even when silent (ERGO-Code/HiGHS
    #2783); it would corrupt ``--json`` output. File descriptor 1 points at /dev/null while the
    solver runs."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no usable stdout: nothing to protect
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def uniform_widths(modules: Sequence[ModuleChoices], bits: int, group_size: int,
                   constraints: Constraints | None = None) -> Allocation:
    """Every module at ``bits`` (pins still apply): the comparison point."""
    cons = constraints or Constraints()
    picks = []
    for m in modules:
        pinned = [b for pat, b in cons.pins.items() if fnmatch.fnmatchcase(m.name, pat)]
        want = pinned[-1] if pinned else bits
        match = [c for c in m.candidates if c.bits == want and c.group_size == group_size]
        if not match:
            raise AllocationError(f"no {want}-bit candidate at group size {group_size}",
                                  module=m.name, field="bits")
        picks.append(match[0])
    return _result(modules, picks)


def brute_force(modules: Sequence[ModuleChoices], budget: float,
                constraints: Constraints | None = None) -> Allocation:
    """Reference: try every combination (tests only; exponential)."""
    import itertools

    options = _filtered(modules, constraints or Constraints())
    elements = sum(m.elements for m in modules)
    best = None
    for combo in itertools.product(*options):
        if sum(c.nbytes for c in combo) * 8 > budget * elements:
            continue
        alloc = _result(modules, list(combo))
        if best is None or alloc.predicted_error < best.predicted_error:
            best = alloc
    if best is None:
        raise AllocationError("unreachable", field="budget")
    return best


def parse_pins(pins: Sequence[str]) -> dict[str, int]:
    """``['model.embed_tokens=8', '*.self_attn.*=8']`` -> {pattern: bits}."""
    out: dict[str, int] = {}
    for pin in pins:
        pattern, sep, bits = pin.rpartition("=")
        if not sep or not pattern or not bits.isdigit():
            raise AllocationError(f"a pin is PATTERN=BITS, got {pin!r}", field="pin")
        out[pattern] = int(bits)
    return out


def widths_mapping(alloc: Allocation, default_group_size: int) -> Mapping[str, object]:
    """The allocation as a widths JSON: bits, or {bits, group_size} where it differs."""
    return {name: bits if gs == default_group_size else {"bits": bits, "group_size": gs}
            for name, (bits, gs) in sorted(alloc.widths.items())}
