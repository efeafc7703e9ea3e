"""An island's fair-share clock (resource_manager/host/fair_clock.py): where a tenant starts when its work comes,
and where it starts once the places it started from have really run."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from resource_manager.host.fair_clock import FairClock
from resource_manager.host.usage import Usage


@dataclass
class Place:
    """A place in flight, as the clock reads it."""

    tenant: str
    owed: float
    came: list[str] | None = None


def fly(clock: FairClock, tenant: str, estimate: float) -> Place:
    clock.owed[tenant] = clock.owed.get(tenant, 0.0) + estimate
    return Place(tenant, estimate)


def land(clock: FairClock, place: Place, took: float, active: set[str]) -> None:
    """The place completes after ``took`` seconds (weights 1): charged, and those that started from it corrected."""
    clock.passes[place.tenant] += took
    clock.owed[place.tenant] -= place.owed
    if place.came:
        clock.started_after(place.came, took - place.owed, active)


def test_a_tenant_starts_where_the_places_it_started_from_really_end_through_another_that_started_from_them():
    """On a fresh island a's first window is estimated at three times what it takes. b comes while it flies and
    starts where it would end; b's first place flies, then c comes and starts where b's place ends. Once a's window
    has run, b starts where it really ended, and so must c, or it stays ahead of b by a's error."""
    clock = FairClock(credit_s=0.01, usage=Usage())
    clock.weights.update(a=1.0, b=1.0, c=1.0)
    clock.wake("a", 0.0, set(), set(), [])
    window = fly(clock, "a", 0.05)
    clock.wake("b", 0.0, {"a"}, {"a"}, [window])
    assert clock.passes["b"] == pytest.approx(0.05 - 0.01 / 2)  # where a's window ends, less its credit
    first = fly(clock, "b", 0.01)
    clock.wake("c", 0.0, {"b"}, {"a", "b"}, [window, first])  # a's queue ran empty: b is where the others wait
    assert clock.passes["c"] == pytest.approx(0.045 + 0.01 - 0.01 / 3)
    land(clock, window, 0.05 / 3, {"a", "b", "c"})
    land(clock, first, 0.01, {"a", "b", "c"})
    assert clock.passes["b"] == pytest.approx(0.05 / 3 - 0.005 + 0.01)
    assert clock.passes["c"] == pytest.approx(clock.passes["b"] - 0.01 / 3)  # where b's place really ended
