"""Each tenant's use of an island, as status shows it: the island time it was charged, since start and over the last
``RECENT_S`` seconds (kept per second, so a tenant's thousands of fragments a second cost a few buckets), and the
seconds it had nothing queued or in flight (so that "backlogged" can be checked). The throttle weighs a tenant
against those that used the island recently."""

from __future__ import annotations

import time
from collections import deque

RECENT_S = 10.0  # the window of the "recent" share that status shows while jobs run


class Usage:
    """The island's per-tenant time and idle time. Not thread-safe: the scheduler owns it and calls it under its
    own lock."""

    def __init__(self) -> None:
        self._time: dict[str, float] = {}
        self._recent: deque[tuple[int, dict[str, float]]] = deque()  # (second, tenant -> island time in it)
        self._idle: dict[str, float] = {}  # tenant -> seconds it had nothing queued or in flight
        self._idle_since: dict[str, float] = {}

    def account(self, tenant: str, seconds: float, second: int | None = None) -> None:
        """``tenant`` was charged ``seconds`` of island time (in the monotonic ``second``, now if None)."""
        self._time[tenant] = self._time.get(tenant, 0.0) + seconds
        if second is None:  # one bucket per second: bounded whatever a tenant's rate of fragments
            second = int(time.monotonic())
        recent = self._recent
        if not recent or recent[-1][0] != second:
            recent.append((second, {}))
            while recent[0][0] < second - RECENT_S:
                recent.popleft()
        bucket = recent[-1][1]
        bucket[tenant] = bucket.get(tenant, 0.0) + seconds

    def time_s(self) -> dict[str, float]:
        """Each tenant's island time since start."""
        return dict(self._time)

    def recent(self) -> dict[str, float]:
        """Each tenant's island time over the last ``RECENT_S`` seconds."""
        horizon = time.monotonic() - RECENT_S
        recent: dict[str, float] = {}
        for second, bucket in self._recent:
            if second >= horizon:
                for tenant, busy in bucket.items():
                    recent[tenant] = recent.get(tenant, 0.0) + busy
        return recent

    def recent_tenants(self) -> set[str]:
        """The tenants charged island time in about the last ``RECENT_S`` seconds."""
        return {t for _, bucket in self._recent for t in bucket}

    def idle(self, tenant: str) -> None:
        """``tenant`` has nothing queued or in flight from now on (if it had not already)."""
        self._idle_since.setdefault(tenant, time.monotonic())

    def woke(self, tenant: str) -> None:
        """``tenant`` has work again: the time since it went idle counts as idle."""
        since = self._idle_since.pop(tenant, None)
        if since is not None:
            self._idle[tenant] = self._idle.get(tenant, 0.0) + time.monotonic() - since

    def idle_s(self, tenant: str, now: float) -> float:
        """Seconds ``tenant`` had nothing queued or in flight, until ``now``."""
        return self._idle.get(tenant, 0.0) + now - self._idle_since.get(tenant, now)
