"""Each tenant's use of an island on its own (resource_manager/host/usage.py): island time since start and over the
last ``RECENT_S`` seconds in bounded memory, who used the island recently, and idle time."""

from __future__ import annotations

import time

import pytest

from resource_manager.host.usage import RECENT_S, Usage


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return clock


def test_recent_time_covers_the_last_recent_s_seconds_in_a_bucket_a_second(clock):
    usage = Usage()
    for k in range(30000):  # 1,000 charges a second for 30 s
        clock[0] = 1000.0 + k * 1e-3
        usage.account("b" if k % 4 == 0 else "a", 1e-3)
    assert len(usage._recent) <= RECENT_S + 2
    recent = usage.recent()
    assert recent["a"] == pytest.approx(0.75 * RECENT_S, abs=0.8) and recent["b"] == pytest.approx(0.25 * RECENT_S,
                                                                                                     abs=0.3)
    assert usage.time_s() == pytest.approx({"a": 22.5, "b": 7.5})
    usage.account("c", 2.0, second=int(clock[0]))  # in the second the caller names
    assert usage.recent_tenants() == {"a", "b", "c"}
    clock[0] += 2 * RECENT_S
    usage.account("a", 1.0)
    assert usage.recent_tenants() == {"a"} and usage.recent() == {"a": 1.0}


def test_idle_time_counts_from_the_first_moment_with_nothing_queued_or_in_flight(clock):
    usage = Usage()
    assert usage.idle_s("a", clock[0]) == 0.0
    usage.idle("a")
    clock[0] += 2.0
    usage.idle("a")  # still idle: counted from the first time
    assert usage.idle_s("a", clock[0]) == 2.0
    clock[0] += 1.0
    usage.woke("a")
    clock[0] += 5.0
    assert usage.idle_s("a", clock[0]) == 3.0
    usage.woke("a")  # woke without going idle: nothing to add
    assert usage.idle_s("a", clock[0]) == 3.0
