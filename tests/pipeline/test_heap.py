"""``heap_served`` (glibc's malloc while ``return_freed_memory`` pins the mmap threshold): inside,
a loop's freed tensors of a few MiB are reused from the heap, not mapped afresh; on leaving, the
pin and glibc's trim threshold are set again and the free pages handed back; without the pin
glibc's settings are left alone. (After it, a chunk the heap still holds free may serve a later
allocation, which glibc looks for before it maps one: how many do depends on the heap's layout,
so the faults after are not asserted.)"""

from __future__ import annotations

import sys

import pytest
from page_faults import run_probe, step_pages, step_source

from dynquant.freed_memory import USER_SETTINGS
from dynquant.pipeline.execute import heap

# A loop that makes and frees 3 x 2 MiB of tensors each step (the measure's chunks of rows, in
# small): each step's minor page faults pinned (4 steps after the first 2), then inside
# heap_served (4 steps after the first 6, while the heap grows to the loop's size).
PROBE = step_source(512, 1024) + """
from dynquant.pipeline.execute.heap import heap_served, return_freed_memory

pinned = return_freed_memory()
outside = [step() for _ in range(6)]
with heap_served():
    inside = [step() for _ in range(10)]
print(pinned, sum(outside[2:]), sum(inside[6:]))
"""
STEP_PAGES = step_pages(512, 1024)


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc settings")


def _probe() -> tuple[bool, int, int]:
    """(pinned, faults of 4 steps pinned, of 4 steps inside once the heap holds the loop)."""
    out = run_probe(PROBE)
    return out[0] == "True", int(out[1]), int(out[2])


def test_inside_a_loop_s_tensors_come_from_the_heap():
    pinned, outside, inside = _probe()
    assert pinned
    assert outside > 4 * STEP_PAGES // 2, outside  # 4 steps, each mapped afresh
    assert inside < STEP_PAGES // 4, inside  # reused in place


def test_heap_served_sets_and_restores_only_over_a_pin(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(heap, "glibc", lambda: Libc())
    for name in (*USER_SETTINGS, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(heap._pinned, "threshold", 0)
    with heap.heap_served():
        pass
    assert calls == []  # no pin: glibc's own policy is left alone
    monkeypatch.setitem(heap._pinned, "threshold", heap.THRESHOLD)
    with heap.heap_served():
        assert calls == [(heap.M_MMAP_THRESHOLD, heap.SERVED_THRESHOLD),
                         (heap.M_TRIM_THRESHOLD, heap.SERVED_TOP)]
    assert calls[2:] == [(heap.M_MMAP_THRESHOLD, heap.THRESHOLD),
                         (heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD), ("trim", 0)]
    calls.clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    with heap.heap_served():
        pass
    assert calls == []  # the user's own setting: left alone
