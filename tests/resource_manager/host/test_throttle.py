"""The op_ms throttle on its own (resource_manager/host/throttle.py): a hold after each place of a throttled tenant,
one place in flight, forgiveness after ``FORGIVE_S`` or when the admin raises op_ms, and when held work is due."""

from __future__ import annotations

import time

import pytest

from resource_manager.host.throttle import FORGIVE_S, Throttles


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return clock


def test_a_hold_starts_a_throttle_once_and_only_grows(clock):
    throttles = Throttles(lambda tenant: 100)
    assert throttles.hold("a", 2.0, 0.5, True, 100.0) is True  # new: the scheduler takes its credit away
    assert throttles.hold("a", 0.5, 0.05, False, 100.2) is False
    assert throttles.held_s("a", 100.0) == 2.0  # a shorter hold later never shortens the one running
    assert throttles.hold("a", 3.0, 0.2, True, 101.0) is False
    assert throttles.held_s("a", 101.0) == 3.0 and throttles.held_s("b", 101.0) == 0.0
    throttle = throttles.tenants["a"]
    assert (throttle.took, throttle.over) == (0.5, 101.0)  # the longest place over the budget, the last one's end
    assert throttles.held(103.9) == {"a"} and throttles.held(104.0) == set()


def test_a_throttled_tenant_goes_once_its_hold_ended_and_nothing_of_its_flies(clock):
    throttles = Throttles(lambda tenant: 100)
    throttles.hold("a", 1.0, 0.5, True, 100.0)
    assert not throttles.may_go("a", 0)
    clock[0] = 101.0
    assert not throttles.may_go("a", 1)  # one place in flight at most
    assert throttles.may_go("a", 0)
    assert "a" in throttles.tenants  # still throttled: its next place is held again


def test_a_throttled_tenant_is_forgiven_after_forgive_s_or_when_op_ms_is_raised(clock):
    caps = {"a": 100, "b": 100}
    throttles = Throttles(caps.__getitem__)
    throttles.hold("a", 1.0, 0.5, True, 100.0)
    throttles.hold("b", 1.0, 0.5, True, 100.0)
    clock[0] = 100.0 + FORGIVE_S - 0.01
    assert throttles.may_go("a", 1) is False and "a" in throttles.tenants
    clock[0] = 100.0 + FORGIVE_S
    assert throttles.may_go("a", 1) is True and "a" not in throttles.tenants
    throttles.hold("b", 50.0, 0.2, True, clock[0])  # held long, and over again just now
    assert not throttles.may_go("b", 1)
    caps["b"] = 600  # the admin raised op_ms above the longest place it ran (0.5 s)
    assert throttles.may_go("b", 1) is True and not throttles.tenants


def test_held_work_is_due_when_the_first_hold_of_a_tenant_with_work_and_nothing_in_flight_ends(clock):
    throttles = Throttles(lambda tenant: 100)
    assert throttles.next_due({"a": [1]}, {}) is None
    throttles.hold("a", 2.0, 0.5, True, 100.0)
    throttles.hold("b", 1.0, 0.5, True, 100.0)
    throttles.hold("c", 0.5, 0.5, True, 100.0)
    queues = {"a": [1], "b": [1], "c": []}
    assert throttles.next_due(queues, {}) == 101.0  # c has nothing queued
    assert throttles.next_due(queues, {"b": 1}) == 102.0  # b has a place in flight: its completion releases it
    assert throttles.next_due({}, {}) is None
