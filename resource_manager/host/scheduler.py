"""An island's scheduler: one total order over every client's admitted messages, the same for every host.

It lives in the island's host 0 (``resource_manager.host``), after admission
(``resource_manager.host.admission``), which has put each client's messages back in
order and checked them. Messages wait in one queue per tenant. Up to
``window`` fragments, and about ``window_s`` seconds of estimated island time,
are in flight on the island; the next one comes from the tenant with the
lowest *pass* (stride scheduling: a tenant's pass grows by the island time it
used divided by its weight), so busy tenants share the island in proportion
to their weights. Each released message gets the next sequence number; every
host admits strictly by that number, so collectives launched by two clients on
the same hosts can never interleave differently on two hosts.

Small computations are cheap to run and dear to send: once ``eager``
fragments are in flight, new messages wait for the next completion report and
go with everything released then, as one message per host.

On a multi-host island a fragment parks at each receive; when every host has
reported that receive's data landed, the rest of the fragment is released as
a ``Resume`` ahead of new work (it already had its share).

Every method returns what it releases, in order, for the host to forward; the
scheduler calls no one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from resource_manager.host.admission import Admitted

FIRST_ESTIMATE_S = 1e-3
RECENT_S = 10.0  # the window of the "recent" share that status shows while jobs run


@dataclass(frozen=True)
class Resume:
    """The rest of fragment ``seq`` from op ``pc`` on, once its receive's data landed on every host."""

    seq: int
    pc: int


Item = Admitted | Resume
Released = list[tuple[int, Item]]


class Scheduler:
    """Thread-safe: admitted messages and the executors' reports arrive on different threads."""

    def __init__(self, island: int, n_hosts: int, window: int = 64, window_s: float = 0.05, eager: int = 8) -> None:
        self.island, self.n_hosts = island, n_hosts
        self._lock = threading.Lock()
        self.window, self.window_s, self.eager = window, window_s, eager
        self._inflight_s = 0.0  # the estimates of the fragments in flight
        self._received = [0, 0]  # queue calls, messages in them: how well clients coalesce
        self._seq = 0
        self._weights: dict[str, float] = {}
        self._queues: dict[str, deque[Admitted]] = {}
        self._pass: dict[str, float] = {}
        self._estimate: dict[str, float] = {}
        self._inflight: dict[int, tuple[str, float]] = {}
        self._blocked: dict[int, tuple[str, float]] = {}
        self._landed: dict[tuple[int, int], set[int]] = {}
        self._resumes: deque[Resume] = deque()
        self._time: dict[str, float] = {}
        self._recent: deque[tuple[float, str, float]] = deque()
        self._fragments: dict[str, int] = {}

    def set_weight(self, tenant: str, weight: float) -> None:
        """The tenant's weight, as the resource manager's registry holds it (finite and positive)."""
        with self._lock:
            self._weights[tenant] = weight

    # -- the order ------------------------------------------------------------------------------------------
    def queue(self, entries: list[Admitted]) -> Released:
        """Queue admitted messages; release what the window allows while few fragments are in flight."""
        with self._lock:
            self._received[0] += 1
            self._received[1] += len(entries)
            for entry in entries:
                queue = self._queues.get(entry.tenant)
                if queue is None:
                    queue = self._queues[entry.tenant] = deque()
                if not queue:  # a tenant waking up starts at the current virtual time, not in the past
                    active = [self._pass[t] for t, q in self._queues.items() if q]
                    self._pass[entry.tenant] = max(self._pass.get(entry.tenant, 0.0), min(active, default=0.0))
                queue.append(entry)
            return self._release() if len(self._inflight) < self.eager else []

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _release(self) -> Released:
        """Resumes first, then what the window allows in pass order, as one batch for every host."""
        released: Released = [(self._next(), resume) for resume in self._resumes]
        self._resumes.clear()
        while len(self._inflight) < self.window and (not self._inflight or self._inflight_s < self.window_s):
            ready = [t for t, q in self._queues.items() if q]
            if not ready:
                break
            tenant = min(ready, key=lambda t: (self._pass[t], t))
            entry = self._queues[tenant].popleft()
            seq = self._next()
            released.append((seq, entry))
            if entry.counts:
                estimate = self._estimate.get(tenant, FIRST_ESTIMATE_S)
                self._pass[tenant] += estimate / self._weights.get(tenant, 1.0)
                self._inflight[seq] = (tenant, estimate)
                self._inflight_s += estimate
                self._fragments[tenant] = self._fragments.get(tenant, 0) + 1
        return released

    # -- reports ------------------------------------------------------------------------------------------
    def completed(self, reports: list[list]) -> Released:
        """Host 0 reports (seq, island seconds) for finished fragments; charge them to their tenants."""
        with self._lock:
            for seq, busy in reports:
                entry = self._leave_window(seq) or self._blocked.pop(seq, None)
                if entry is None:
                    continue
                tenant, estimate = entry
                self._time[tenant] = self._time.get(tenant, 0.0) + busy
                self._recent.append((time.monotonic(), tenant, busy))
                self._pass[tenant] += (busy - estimate) / self._weights.get(tenant, 1.0)
                self._estimate[tenant] = 0.8 * self._estimate.get(tenant, busy) + 0.2 * busy
            return self._release()

    def blocked(self, seqs: list[int]) -> Released:
        """Fragments waiting on another island's transfer leave the window, so islands never wait on
        each other's windows."""
        with self._lock:
            for seq in seqs:
                entry = self._leave_window(seq)
                if entry is not None:
                    self._blocked[seq] = entry
            return self._release()

    def landed(self, host: int, pairs: list[tuple[int, int]]) -> Released:
        """Host ``host`` has the data of parked receive (seq, pc); once every host has, resume it."""
        with self._lock:
            for seq, pc in pairs:
                hosts = self._landed.setdefault((seq, pc), set())
                hosts.add(host)
                if len(hosts) == self.n_hosts:
                    del self._landed[(seq, pc)]
                    self._resumes.append(Resume(seq, pc))
            return self._release() if self._resumes else []

    def _leave_window(self, seq: int) -> tuple[str, float] | None:
        entry = self._inflight.pop(seq, None)
        if entry is not None:
            self._inflight_s = self._inflight_s - entry[1] if self._inflight else 0.0
        return entry

    def stats(self) -> dict:
        """The scheduler's counters: sequence numbers issued, window, queued/in-flight/blocked fragments, and each
        tenant's island time (since start and over the last ``RECENT_S`` seconds), fragments and weight."""
        with self._lock:
            horizon = time.monotonic() - RECENT_S
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            recent: dict[str, float] = {}
            for _, tenant, busy in self._recent:
                recent[tenant] = recent.get(tenant, 0.0) + busy
            return {"tenant_time_recent_s": recent, "island": self.island, "sequenced": self._seq,
                    "window": self.window, "window_s": self.window_s, "inflight_s": self._inflight_s,
                    "queued": sum(len(q) for q in self._queues.values()), "inflight": len(self._inflight),
                    "blocked": len(self._blocked), "parked": len(self._landed), "tenant_time_s": dict(self._time),
                    "fragments": dict(self._fragments), "weights": dict(self._weights),
                    "submit_calls": self._received[0], "messages": self._received[1]}
