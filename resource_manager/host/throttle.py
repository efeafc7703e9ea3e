"""An island's throttle on tenants over their op_ms budget: a computation cannot be stopped once it runs, so the
budget holds back what follows instead (host 0 measures; compiling counts).

A tenant is *throttled* once one place of its in the order (a fragment, a part, a group, compiling included) held
the island longer than ``op_ms`` without a break: every later place of its, new programs included, waits until the
island time its weight allows has passed. After a place of ``t`` seconds, none is released for ``t * W / w``
seconds, ``w`` its weight and ``W`` the weights of the other tenants that used the island in the last ``RECENT_S``
seconds (0 if none did: a tenant alone on an island keeps it busy), and at most one place of its is in flight,
never grouped. So a throttled tenant gets at most ``w / (w + W)`` of the island's time, whether or not the others
use theirs, and someone calling now and then waits for at most one of its places. It holds no one else up: other
tenants are released as before. It is forgiven once ``FORGIVE_S`` seconds passed since its last place over the
budget and its hold ended, or at once when the admin raised ``op_ms`` above the longest place it ran. A place whose
hold ends while nothing else happens on the island goes out when the host's thread for it asks (the scheduler's
``wait_due``).

A compile is bounded by the same rule rather than moved off the order: it runs where its fragment's place is, on
every host of the island alike, so the order stays the same everywhere (gang scheduling needs every host to launch
the same computations in the same order, and whether an executable is compiled already differs from host to
host), and a tenant whose fresh programs each compile for long is held after the first like one whose programs
run long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass

FORGIVE_S = 10.0  # a throttled tenant is forgiven this long after its last place over op_ms (its hold ended)


@dataclass(slots=True)
class _Throttle:
    """A tenant throttled for its op_ms budget: nothing of its is released before ``until`` (monotonic), ``took``
    is the longest place of its that went over (seconds) and ``over`` when the last one ended."""

    until: float
    took: float
    over: float


class Throttles:
    """The island's throttled tenants, one hold each at most. Not thread-safe: the scheduler owns it and calls it
    under its own lock, passing what it needs of the order (queues, places in flight) as arguments."""

    def __init__(self, op_cap_ms: Callable[[str], int]) -> None:
        self._op_cap_ms = op_cap_ms  # the tenant's op_ms budget, from the registry
        # tenant -> its hold; the scheduler's release loop tests it as is (one dict test per place), never changes it
        self.tenants: dict[str, _Throttle] = {}

    def may_go(self, tenant: str, flying: int) -> bool:
        """Whether the next place of throttled ``tenant`` (``flying`` places of its in flight) may go: once its hold
        ended and nothing of its is in flight. It is forgiven (no longer throttled) once ``FORGIVE_S`` passed since
        its last place over the budget, or the admin raised its op_ms above the longest place it ran."""
        throttle, now = self.tenants[tenant], time.monotonic()
        if now >= throttle.until and now - throttle.over >= FORGIVE_S or throttle.took * 1e3 <= self._op_cap_ms(tenant):
            del self.tenants[tenant]
            return True
        return now >= throttle.until and not flying

    def hold(self, tenant: str, hold_s: float, busy: float, over: bool, now: float) -> bool:
        """``tenant``'s place just took ``busy`` seconds of the island (``over`` its op_ms budget): hold its next one
        for ``hold_s`` seconds from ``now`` (its weight's share of the island time since, against the others').
        Whether it was not throttled before (then it has no credit to spend)."""
        until = now + hold_s
        throttle = self.tenants.get(tenant)
        new = throttle is None
        if new:
            throttle = self.tenants[tenant] = _Throttle(until, busy, now)
        throttle.until = max(throttle.until, until)
        if over:
            throttle.took, throttle.over = max(throttle.took, busy), now
        return new

    def held(self, now: float) -> set[str]:
        """The tenants held at ``now`` (their passes stand still, and must not hold the island's clock back)."""
        return {t for t, throttle in self.tenants.items() if throttle.until > now}

    def held_s(self, tenant: str, now: float) -> float:
        """Seconds from ``now`` until ``tenant``'s next place may go (0 if it is not throttled)."""
        throttle = self.tenants.get(tenant)
        return max(0.0, throttle.until - now) if throttle is not None else 0.0

    def next_due(self, queues: Mapping[str, Sized], flying: Mapping[str, int]) -> float | None:
        """When (``time.monotonic``) the first throttled tenant with work queued and nothing in flight may go again;
        None if there is none."""
        times = [th.until for t, th in self.tenants.items() if queues.get(t) and not flying.get(t)]
        return min(times, default=None)
