"""An island's scheduler: one total order over every client's fragments, handed to every host.

It lives in the island's host 0 (``resource_manager.host``), which serves its
methods on one thread of their own and hands its own share of each batch to its
executor without an actor call: a fragment on a one-host island costs the
client's call and nothing more. Ray runs a threaded actor's calls in no
guaranteed order, even those of one caller, so each client numbers its
messages and a batch that overtook an earlier one waits here until the gap
is filled. Each message is validated and checked against the slices its
tenant owns, then queued per tenant. Up to ``window`` fragments, and about
``window_s`` seconds of estimated island time, are in flight on the island;
the next one comes from the tenant with the lowest *pass* (stride scheduling:
a tenant's pass grows by the island time it used divided by its weight), so
busy tenants share the island in proportion to their weights. Each forwarded
message gets the next sequence number and goes to all hosts, which admit
strictly by that number: collectives launched by two clients on the same
hosts can never interleave differently on two hosts.

Small computations are cheap to run and dear to send: once ``eager``
fragments are in flight, new messages wait for the next completion report and
go with everything released then, as one message per host. The busier the
island (the more clients), the larger those batches and the cheaper each
fragment's trip.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from pathways import wire
from pathways.errors import PathwaysError, TenantAccessError, WireFormatError, to_wire
from pathways.names import CLIENT_ID_BITS

FIRST_ESTIMATE_S = 1e-3
RECENT_S = 10.0  # the window of the "recent" share that status shows while jobs run


class Scheduler:
    """``forward(batch)`` hands a batch of ``(seq, payload, refs, refusal)`` to every host of the island.

    Thread-safe: clients' messages and the executor's reports arrive on different threads; batches are
    forwarded outside the lock, and hosts admit by sequence number whatever order they arrive in.
    """

    def __init__(self, island: int, forward: Callable[[list], None], window: int = 64, window_s: float = 0.05,
                 eager: int = 8) -> None:
        self.island = island
        self._forward = forward
        self._lock = threading.Lock()
        self.window, self.window_s, self.eager = window, window_s, eager
        self._inflight_s = 0.0  # the estimates of the fragments in flight
        self._received = [0, 0]  # submit calls, messages in them: how well clients coalesce
        self._seq = 0
        self._templates = wire.TemplateCache()
        self._grants: dict[str, tuple[str, dict]] = {}
        self._clients: dict[int, str] = {}
        self._weights: dict[str, float] = {}
        self._queues: dict[str, deque] = {}
        self._pass: dict[str, float] = {}
        self._estimate: dict[str, float] = {}
        self._inflight: dict[int, tuple[str, float]] = {}
        self._blocked: dict[int, tuple[str, float]] = {}
        self._time: dict[str, float] = {}
        self._recent: deque[tuple[float, str, float]] = deque()
        self._fragments: dict[str, int] = {}
        self._streams: dict[int, int] = {}  # client -> number of its messages queued so far
        self._early: dict[int, dict[int, list]] = {}  # client -> {first message's number: batch} ahead of a gap

    # -- ownership and weights (set by the resource manager) ------------------------------------
    def grant(self, key: str, tenant: str, desc: dict) -> None:
        with self._lock:
            self._grants[key] = (tenant, desc)

    def grant_client(self, client: int, tenant: str) -> None:
        with self._lock:
            self._clients[client] = tenant

    def revoke_client(self, client: int) -> None:
        with self._lock:
            self._clients.pop(client, None)
            self._streams.pop(client, None)
            self._early.pop(client, None)

    def revoke(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._grants.pop(key, None)

    def set_weight(self, tenant: str, weight: float) -> None:
        with self._lock:
            self._weights[tenant] = max(float(weight), 1e-6)

    # -- the ordered stream ---------------------------------------------------------------------
    def submit(self, payload: bytes, refs: list | None = None) -> None:
        """Queue one message outside any client's numbered stream (the resource manager's, which waits for
        each); forward what the window allows."""
        def queue() -> WireFormatError | None:
            entries, error = self._decode([(payload, refs)])
            self._queue_all(entries)
            return error

        self._take(queue)

    def submit_batch(self, client: int, first: int, items: list) -> None:
        """Queue messages ``first``, ``first + 1``, ... of ``client``'s stream, each ``(payload, refs)``.

        A batch that arrives before an earlier one of the same client waits for it. Messages are forwarded
        now only while fewer than ``eager`` fragments are in flight (a busy client's session coalesces what
        it dispatches meanwhile). A malformed message raises after the others are queued; a batch holding
        another client's message is refused whole, so no client can disturb another's stream."""
        self._take(lambda: self._in_order(client, first, items))

    def _take(self, queue: Callable[[], PathwaysError | None]) -> None:
        released = []
        with self._lock:
            error = queue()
            if len(self._inflight) < self.eager:
                released = self._release()
        if released:
            self._forward(released)
        if error is not None:
            raise error

    @staticmethod
    def _decode(items: list) -> tuple[list, WireFormatError | None]:
        """``(message or None if malformed, payload, refs)`` per item, and the first decoding error."""
        entries, error = [], None
        for payload, refs in items:
            try:
                entries.append((wire.decode(payload, "call", "put", "free"), payload, refs))
            except WireFormatError as exc:
                entries.append((None, payload, refs))
                error = error or exc
        return entries, error

    def _in_order(self, client: int, first: int, items: list) -> PathwaysError | None:
        entries, error = self._decode(items)
        claimed = {msg["client"] for msg, _, _ in entries if msg is not None} - {client}
        if claimed:
            return TenantAccessError(f"a batch on client {client}'s stream carries messages of client(s) "
                                     f"{sorted(claimed)}; the island refused all of it")
        expected = self._streams.get(client, 0)
        if first < expected:
            return WireFormatError(f"island {self.island} already queued message {first} of client {client}; "
                                   f"a message is sent once")
        early = self._early.setdefault(client, {})
        early[first] = (entries, error)
        error = None
        while expected in early:
            batch, decode_error = early.pop(expected)
            self._queue_all(batch)
            error = error or decode_error
            expected += len(batch)
        self._streams[client] = expected
        if not early:
            del self._early[client]
        return error

    def _queue_all(self, entries: list) -> None:
        """Queue the decoded messages of one batch, skipping malformed ones."""
        self._received[0] += 1
        self._received[1] += len(entries)
        for msg, payload, refs in entries:
            if msg is not None:
                self._queue(msg, payload, refs)

    def _queue(self, msg: dict, payload: bytes, refs: list | None) -> None:
        refusal = self._check(msg)
        tenant = msg["tenant"]
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        if not queue:  # a tenant waking up starts at the current virtual time, not in the past
            active = [self._pass[t] for t, q in self._queues.items() if q]
            self._pass[tenant] = max(self._pass.get(tenant, 0.0), min(active, default=0.0))
        queue.append((payload, refs, refusal, msg["kind"] == "call"))

    def _check(self, msg: dict) -> list[str] | None:
        """None if the tenant owns every slice the message names, else the refusal to hand the hosts."""
        tenant, client = msg["tenant"], msg["client"]
        if self._clients.get(client) != tenant:
            return list(to_wire(TenantAccessError(f"client {client} is not registered for tenant {tenant!r}")))
        if msg["kind"] == "free":
            return None
        if msg["kind"] == "put":
            slices = {msg["slice"]["key"]: msg["slice"]}
            first, last = msg["id"], msg["id"]
        else:
            template = self._templates.get(msg["template"])
            slices = template["slices"]
            first, last = msg["base"], msg["base"] + max(template["n_values"] - 1, 0)
        if first >> CLIENT_ID_BITS != client or last >> CLIENT_ID_BITS != client:
            return list(to_wire(TenantAccessError(f"client {client} minted buffer ids outside its own id space")))
        for key, desc in slices.items():
            grant = self._grants.get(key)
            if grant is None or grant[0] != tenant or grant[1]["devices"] != desc["devices"]:
                exc = TenantAccessError(f"slice {key} on island {self.island} is not owned by tenant "
                                        f"{tenant!r}; a program may only run on its own slices")
                return list(to_wire(exc))
        return None

    def _release(self) -> list:
        """What the window allows, in pass order, as one batch for every host (forwarded by the caller,
        outside the lock): a backlogged island pays one actor call per batch instead of one per message."""
        released = []
        while len(self._inflight) < self.window and (not self._inflight or self._inflight_s < self.window_s):
            ready = [t for t, q in self._queues.items() if q]
            if not ready:
                break
            tenant = min(ready, key=lambda t: (self._pass[t], t))
            payload, refs, refusal, counts = self._queues[tenant].popleft()
            seq = self._seq
            self._seq += 1
            released.append((seq, payload, refs, refusal))
            if counts and refusal is None:
                estimate = self._estimate.get(tenant, FIRST_ESTIMATE_S)
                self._pass[tenant] += estimate / self._weights.get(tenant, 1.0)
                self._inflight[seq] = (tenant, estimate)
                self._inflight_s += estimate
                self._fragments[tenant] = self._fragments.get(tenant, 0) + 1
        return released

    def completed(self, reports: list[list]) -> None:
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
            released = self._release()
        if released:
            self._forward(released)

    def blocked(self, seqs: list[int]) -> None:
        """Fragments waiting on another island's transfer leave the window, so islands never wait on
        each other's windows (which could deadlock two islands exchanging data)."""
        with self._lock:
            for seq in seqs:
                entry = self._leave_window(seq)
                if entry is not None:
                    self._blocked[seq] = entry
            released = self._release()
        if released:
            self._forward(released)

    def _leave_window(self, seq: int) -> tuple[str, float] | None:
        entry = self._inflight.pop(seq, None)
        if entry is not None:
            self._inflight_s = self._inflight_s - entry[1] if self._inflight else 0.0
        return entry

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        horizon = time.monotonic() - RECENT_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        recent: dict[str, float] = {}
        for _, tenant, busy in self._recent:
            recent[tenant] = recent.get(tenant, 0.0) + busy
        return {"tenant_time_recent_s": recent, "island": self.island, "sequenced": self._seq, "window": self.window,
                "window_s": self.window_s, "inflight_s": self._inflight_s,
                "queued": sum(len(q) for q in self._queues.values()), "inflight": len(self._inflight),
                "blocked": len(self._blocked), "tenant_time_s": dict(self._time),
                "fragments": dict(self._fragments), "weights": dict(self._weights),
                "submit_calls": self._received[0], "messages": self._received[1],
                "early": sum(len(e) for e in self._early.values())}
