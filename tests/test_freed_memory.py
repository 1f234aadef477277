"""``reusing_freed_memory`` (glibc's malloc inside a loop that remakes large tensors): inside, a
large block freed and allocated again is reused in place, not mapped afresh; on leaving, the
free pages go back and glibc's own settings are in force again; a user's own setting is left
alone."""

from __future__ import annotations

import os
import sys

import pytest
from page_faults import run_probe, step_pages, step_source

# A loop that makes and frees the same 3 x 32 MiB of tensors each step (a tuning step's pattern,
# in small): prints whether the setting applied, each step's minor page faults (~24,600 a step
# when every tensor is mapped afresh, none once the freed ones are reused), the bytes handed back
# on leaving, and the faults of one more step after (glibc's own settings again).
PROBE = step_source(2048, 4096) + """
from dynquant.freed_memory import reusing_freed_memory

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

with reusing_freed_memory() as applied:
    inside = [step() for _ in range(12)]
    held = resident()
released = held - resident()
print(applied, released, step(), *inside)
"""
STEP_PAGES = step_pages(2048, 4096)


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc settings")


def _probe(env: dict[str, str] | None = None) -> tuple[bool, int, int, list[int]]:
    out = run_probe(PROBE, env)
    return out[0] == "True", int(out[1]), int(out[2]), [int(n) for n in out[3:]]


def test_inside_freed_large_blocks_are_reused_and_after_they_are_handed_back():
    applied, released, after, inside = _probe()
    assert applied and sum(inside[6:]) < STEP_PAGES // 20, inside  # the steady state
    assert released > (64 << 20), released
    assert after > STEP_PAGES // 2, after  # glibc's own settings again: fresh mappings


def test_a_users_own_setting_is_left_alone():
    env = {**os.environ, "MALLOC_MMAP_MAX_": "65536"}
    applied, _, _, inside = _probe(env)
    assert not applied and min(inside[6:]) > STEP_PAGES // 2, inside  # fresh mappings
