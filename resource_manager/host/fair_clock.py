"""Where each tenant stands in an island's time: the scheduler's fair-share clock.

A tenant's *pass* is the island time it was charged divided by its weight; the next place in the order goes to
the tenant with work whose pass, plus what its places in flight owe by their estimates, is lowest (stride
scheduling). The island's *virtual time* is the lowest pass among tenants with work: a tenant whose work comes
starts there (or where the places in flight of those waiting then end), at most its weight's share of ``credit_s``
behind it, and when the island has nothing to do every tenant starts the next busy period level. The rules, and
why, are in ``resource_manager.host.scheduler``'s docstring; this part holds the numbers. Not thread-safe: the
scheduler's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from resource_manager.host.usage import Usage


class Flight(Protocol):
    """What the clock reads of a place in flight (``resource_manager.host.scheduler._Flight``)."""

    tenant: str
    owed: float
    came: list[str] | None


class FairClock:
    """Each tenant's weight and pass, what its places in flight owe, the admission work pooled for it, and the
    island's virtual time."""

    def __init__(self, credit_s: float, usage: Usage) -> None:
        self.credit_s = credit_s
        self.usage = usage
        self.vtime = 0.0
        self.weights: dict[str, float] = {}
        self.passes: dict[str, float] = {}  # island time charged (measured) / weight
        self.owed: dict[str, float] = {}  # the estimates of the tenant's places in flight / weight
        self.admitting: dict[str, tuple[float, int]] = {}  # admission seconds not charged yet, and their messages

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, seconds: float) -> None:
        """``seconds`` of the island's time count against ``tenant``'s share (it has woken already)."""
        self.passes[tenant] += seconds / self.weight(tenant)
        self.usage.account(tenant, seconds)

    def pool(self, tenant: str, seconds: float, messages: int) -> None:
        """Admission work for ``messages`` of the tenant's messages, charged a like part as each takes its place."""
        pooled, waiting = self.admitting.get(tenant, (0.0, 0))
        self.admitting[tenant] = (pooled + seconds, waiting + messages)

    def admitted(self, tenant: str, messages: int) -> None:
        """``messages`` of the tenant's messages took their place in the order: charge their part of the admission
        work pooled for it."""
        pooled, count = self.admitting.pop(tenant, (0.0, 0))
        if not count:
            return
        if messages < count:
            self.admitting[tenant] = (pooled * (1 - messages / count), count - messages)
            pooled *= messages / count
        self.charge(tenant, pooled)

    def settle(self, tenant: str) -> None:
        """The tenant went idle: admission work pooled for messages that took no place (merged, dropped) is charged
        now."""
        if tenant in self.admitting:
            self.admitted(tenant, self.admitting[tenant][1])

    def wake(self, tenant: str, vtime: float, queued: set[str], active: set[str], flights: Iterable[Flight]) -> None:
        """``tenant`` had nothing queued and now has (``queued``: the tenants with work queued, a held one aside;
        ``active``: those with work queued or in flight; ``vtime``: the virtual time now). A new tenant starts where
        the others are, and one that comes back, or had only places in flight, at most its share of ``credit_s`` of
        island time behind them (where its own places in flight end, if it has any), whatever it did not use while
        it asked for nothing.

        Where the others are is where the places in flight of the first of those with work queued end (by their
        estimates): they compete with it from now on. With none queued, where the last place in flight ends: a
        place released before it came is no debt of theirs to it (a tenant alone on the island may have a window's
        worth running, and a weight-1 tenant would wait 14 times that among 1:2:4:8 if its pass said so). Not where
        the first place in flight ends: a tenant with a few places in flight and nothing queued does not stand
        where the others compete, and a tenant that filled the window meanwhile would owe that window to every
        tenant that came after. Tenants that came back with it and have nothing in flight yet do not pull the
        start back by their credit. Once those places complete it starts where they really ended
        (``started_after``), and so where the places that tenant itself started from really ended: on a fresh
        island the first window's estimates may be three times what it takes, and a tenant that started from one
        that started from that window would otherwise stay ahead by the difference."""
        self.usage.woke(tenant)
        flights = list(flights)
        ends: dict[str, float] = {}
        for flight in flights:
            if flight.tenant != tenant:
                ends[flight.tenant] = self.passes[flight.tenant] + self.owed.get(flight.tenant, 0.0)
        waiting = {t: end for t, end in ends.items() if t in queued}
        if waiting:
            anchor: str | None = min(waiting, key=waiting.__getitem__)
            at = waiting[anchor]
        else:
            anchor = max(ends, key=ends.__getitem__, default=None)
            at = ends[anchor] if anchor is not None else vtime
        weights = self.weight(tenant) + sum(self.weight(t) for t in active if t != tenant and t in self.passes)
        floor = max(vtime, at) - self.credit_s / weights
        before = self.passes.get(tenant, vtime)
        own = self.owed.get(tenant, 0.0)  # its own places in flight: they are charged when they complete
        self.passes[tenant] = max(before, floor - own)
        if anchor in ends and at > vtime and floor > before + own:
            for flight in flights:  # where they really end is known once they complete
                if flight.tenant == anchor or flight.came and anchor in flight.came:  # and where it really started
                    flight.came = [*flight.came, tenant] if flight.came else [tenant]

    def virtual_time(self, active: Iterable[str]) -> float:
        """The lowest pass among ``active`` tenants (those with work queued or in flight, a throttled tenant
        aside while it is held: its pass stands still then, and must not hold the clock back); it never moves
        back. Passes count what was measured, not the estimates of what is still in flight: an estimate that was
        too high (a compile, a slow moment) must not move the clock that returning tenants start from."""
        passes = [self.passes[t] for t in active if t in self.passes]
        if passes:
            self.vtime = max(self.vtime, min(passes))
        return self.vtime

    def level(self) -> None:
        """Nothing queued and nothing in flight: every tenant starts the next busy period level, debts forgiven (no
        one was kept waiting by them) and credits spent."""
        if self.passes:
            self.vtime = max(self.vtime, max(self.passes.values()))
            self.passes = dict.fromkeys(self.passes, self.vtime)

    def started_after(self, tenants: list[str], error: float, active: set[str]) -> None:
        """Tenants that woke while a place released before them flew started where it would end by its estimate;
        it took ``error`` (in pass) more (or less): they start where it really ended. On a busy machine the first
        window after a pause runs well over its estimate, and a tenant that had the island to itself a moment
        must not owe the excess to those that came after, nor they to it."""
        for tenant in tenants:
            if tenant in active:
                self.passes[tenant] = max(self.passes[tenant] + error, min(self.passes[tenant], self.vtime))
