"""Sessions: a client that proved its tenant (a credential the admin issued, or a job's one-time ticket) holds one.

Every host is told each session's key, tenant, weight and budgets from the registry, so that no host believes a
name, weight or budget a client's message carries. A session ends when its client closes it, when it is not
renewed for ``SESSION_TTL_S``, when its client has kept no connection to the resource manager for longer than the
grace period, when the admin reclaims it, or when its tenant's credential is rotated or the tenant removed; what it
held is then released and its buffers freed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from pathways import auth
from pathways.budgets import Budgets, over
from pathways.errors import ResourceError, TenantAccessError
from pathways.messages import CLIENT_ID_BITS, EndSession, OpenSession, ReleaseTenant, SetBudgets, SetWeight
from resource_manager.fleet import Fleet
from resource_manager.health import IslandHealth
from resource_manager.island import Island
from resource_manager.phase import ClusterPhase
from resource_manager.registry import Registry, TenantRecord
from resource_manager.slices import Slices
from resource_manager.tickets import Tickets

SESSION_TTL_S = 60.0  # a session not renewed for this long ends (clients renew every few seconds)
MAX_CLIENTS = (1 << (63 - CLIENT_ID_BITS)) - 1
KEEP_RECLAIMED = 100
ENDED = "this session has ended (closed, expired or reclaimed); call pw.init() again"
log = logging.getLogger(__name__)


@dataclass
class Client:
    """An open session: its tenant, key, process id, job, and how alive its client is."""

    tenant: str
    key: bytes
    pid: int
    job: str
    expires: float  # monotonic: renewals push it on
    since: float = field(default_factory=time.time)
    connections: int = 0
    gone_since: float | None = None  # monotonic: when its last connection to the resource manager closed


class Sessions:
    """The open sessions by client id, their numbering and the sessions reclaimed, under one lock. Whatever every
    host must know of sessions (and of the slices they hold) is ordered under that lock, so a restarted island
    learns each session once and misses none. Lock order: sessions, then slices, then island health."""

    def __init__(self, registry: Registry, tickets: Tickets, slices: Slices, fleet: Fleet, health: IslandHealth,
                 phase: ClusterPhase, grace: float) -> None:
        self._registry, self._tickets, self._slices = registry, tickets, slices
        self._fleet, self._health, self._phase = fleet, health, phase
        self._grace = grace
        self._lock = threading.Lock()
        self._clients: dict[int, Client] = {}
        self._ids = itertools.count(1)
        self._reclaimed: list[dict] = []

    # -- a session's life ---------------------------------------------------------------------------------
    def open(self, tenant: str, credential: str | None, ticket: str | None, pid: int,
             job: str | None) -> tuple[int, bytes, TenantRecord]:
        """A new session for the tenant a credential (or a job's ticket) proves: (client id, session key, the
        tenant's record); every healthy host learns it."""
        with self._lock:
            self._phase.refuse("opening a session")
            if ticket:
                record = self._registry.get(self._tickets.redeem(ticket, job or ""))
                if record is None:
                    raise TenantAccessError("the ticket's tenant no longer exists")
            else:
                record = self._registry.authenticate(tenant, credential)
            limits = record.limits
            open_now = sum(1 for c in self._clients.values() if c.tenant == record.name)
            if open_now >= limits.sessions:
                raise over("sessions", open_now, 1, limits.sessions, "sessions")
            client = next(self._ids)
            if client > MAX_CLIENTS:
                raise ResourceError("this runtime has opened all the sessions it can; restart it")
            key = auth.new_key()
            self._clients[client] = Client(record.name, key, pid, job or "", time.monotonic() + SESSION_TTL_S)
            self._tell_healthy(OpenSession(client, record.name, key, record.weight, limits.to_wire()))
            return client, key, record

    def caller(self, client: int) -> tuple[bytes, str, Budgets] | None:
        """The session's key, tenant and budgets, for its connections' handshakes (None once it ended). Read
        without the lock (one dict lookup), as every request of a session asks it: an order that waits on a dying
        host while the lock is held must not hold up every client's requests."""
        session = self._clients.get(client)
        if session is None:
            return None
        record = self._registry.get(session.tenant)
        return session.key, session.tenant, record.limits if record is not None else Budgets()

    def tenant_of(self, client: int) -> str:
        """The tenant of ``client``'s session; TenantAccessError once it ended."""
        with self._lock:
            return self._session(client).tenant

    def connected(self, client: int, up: bool) -> None:
        """A connection of ``client`` to the resource manager opened (``up``) or closed."""
        with self._lock:
            session = self._clients.get(client)
            if session is None:
                return
            session.connections += 1 if up else -1
            session.gone_since = None if session.connections > 0 else time.monotonic()

    def renew(self, client: int) -> None:
        """Keep the session alive for ``SESSION_TTL_S`` more; TenantAccessError once it ended."""
        with self._lock:
            self._session(client).expires = time.monotonic() + SESSION_TTL_S

    def close(self, client: int) -> None:
        """The client ends its session: its slices are released and its buffers freed."""
        with self._lock:
            self._forget(client, "closed")

    def expire(self) -> None:
        """End the sessions not renewed in time, or whose client's connection has been gone past the grace."""
        now = time.monotonic()
        with self._lock:
            for client, s in list(self._clients.items()):
                if s.gone_since is not None and now - s.gone_since > self._grace:
                    self._forget(client, f"its connection was gone for {self._grace:.0f}s")
                elif now > s.expires:
                    self._forget(client, f"it was not renewed for {SESSION_TTL_S:.0f}s")

    def _session(self, client: int) -> Client:
        session = self._clients.get(client)
        if session is None:
            raise TenantAccessError(ENDED)
        return session

    def _forget(self, client: int, why: str) -> dict:
        """End ``client``'s session (the lock held): its slices are revoked, every host drops it and its buffers."""
        info = self._clients.pop(client, None)
        keys = self._slices.drop_client(client)
        self._tell_healthy(EndSession(client, True), wait=False)
        record = {"client": client, "tenant": info.tenant if info else None, "slices": keys, "why": why,
                  "at": time.time()}
        if info is not None and why != "closed":
            self._reclaimed.append(record)
            self._reclaimed = self._reclaimed[-KEEP_RECLAIMED:]
            log.warning("reclaimed client %s of tenant %s: %s", client, info.tenant, why)
        return record

    def _tell_healthy(self, order: object, wait: bool = True) -> None:
        self._fleet.order(self._fleet.hosts(self._health.healthy()), order, wait=wait)

    # -- slices -------------------------------------------------------------------------------------------
    def allocate(self, client: int, shape: tuple[int, ...], axes: tuple[str, ...], island: int | None) -> dict:
        """A virtual slice for the client's tenant, within its device quota."""
        with self._lock:
            tenant = self._session(client).tenant
            self._phase.refuse("placing a slice")
            record = self._registry.get(tenant)
            quota = record.quota if record is not None else None
            return self._slices.allocate(tenant, client, quota, shape, axes, island).to_wire()

    def release(self, client: int, key: str) -> None:
        """Free slice ``key`` of the client's tenant."""
        with self._lock:
            tenant = self._session(client).tenant
            self._phase.refuse("releasing a slice")
            self._slices.release(tenant, key)

    # -- the admin ----------------------------------------------------------------------------------------
    def reclaim(self, tenant: str | None, client: int | None) -> list[dict]:
        """End ``client``'s session, or every session of ``tenant``; what each held."""
        with self._lock:
            ended = [c for c, s in self._clients.items() if s.tenant == tenant or c == client]
            return [self._forget(c, "reclaimed by the admin") for c in ended]

    def end_tenant(self, tenant: str, why: str, removed: bool = False) -> None:
        """End every session of ``tenant`` and void its unused tickets (its credential changed, or ``removed``:
        every host then drops every buffer it holds)."""
        with self._lock:
            for client in [c for c, s in self._clients.items() if s.tenant == tenant]:
                self._forget(client, why)
            self._tickets.void(tenant)
            if removed:
                self._tell_healthy(ReleaseTenant(tenant), wait=False)

    def tenant_changed(self, tenant: str, weight: float | None, budgets: bool) -> None:
        """Tell every healthy host ``tenant``'s new ``weight`` and, with ``budgets``, its budgets."""
        with self._lock:
            if weight is not None:
                self._tell_healthy(SetWeight(tenant, weight))
            record = self._registry.get(tenant)
            if budgets and record is not None:
                self._tell_healthy(SetBudgets(tenant, record.limits.to_wire()))

    # -- islands that come back ---------------------------------------------------------------------------
    def welcome(self, new: Island, reason: str, lost: dict) -> None:
        """The restarted island ``new`` learns every session and its slices, then goes back into service."""
        with self._lock:
            self._announce([new])
            self._health.restored(new, reason, lost)

    def _announce(self, islands: list[Island]) -> None:
        """Tell the hosts of ``islands`` every open session and the slices on their islands (the lock held)."""
        hosts = self._fleet.hosts(islands)
        for client, s in self._clients.items():
            record = self._registry.get(s.tenant)
            limits = record.limits if record is not None else Budgets()
            weight = record.weight if record is not None else 1.0
            self._fleet.order(hosts, OpenSession(client, s.tenant, s.key, weight, limits.to_wire()))
        for island in islands:
            self._slices.welcome(island)

    # -- what others read ---------------------------------------------------------------------------------
    def listing(self) -> dict[int, Client]:
        """Every open session, by client id (copies)."""
        with self._lock:
            return {c: Client(**vars(s)) for c, s in self._clients.items()}

    def attached(self) -> set[int]:
        """The sessions whose client holds a connection to the resource manager now."""
        with self._lock:
            return {c for c, s in self._clients.items() if s.connections > 0}

    def reclaimed(self) -> list[dict]:
        """The last sessions the runtime ended on its own or the admin reclaimed."""
        with self._lock:
            return list(self._reclaimed)

    # -- suspend and resume -------------------------------------------------------------------------------
    def to_wire(self) -> list[dict]:
        """Every open session with its key: what a suspended cluster's manifest keeps."""
        with self._lock:
            return [{"client": c, "tenant": s.tenant, "key": s.key.hex(), "pid": s.pid, "job": s.job,
                     "since": s.since} for c, s in self._clients.items()]

    def restore(self, sessions: list[dict], allocations: list[dict]) -> list[int]:
        """A resume's sessions and slices: on this cluster, the sessions still open (those closed meanwhile stay
        closed); on a fresh one, the saved ones whose tenant the registry still has, with a grace period for
        their clients to reconnect. Every host then learns them; returns the saved sessions left out."""
        now = time.monotonic()
        with self._lock:
            fresh = not self._clients
            kept = set()
            for s in sessions:
                client, tenant = int(s["client"]), str(s["tenant"])
                if client in self._clients:
                    kept.add(client)
                elif fresh and self._registry.get(tenant) is not None:
                    self._clients[client] = Client(tenant, bytes.fromhex(s["key"]), int(s["pid"]), str(s["job"]),
                                                   now + SESSION_TTL_S, float(s["since"]), gone_since=now)
                    kept.add(client)
            self._slices.restore(allocations, kept if fresh else set())
            for s in self._clients.values():
                s.expires = now + SESSION_TTL_S
                if s.connections == 0:
                    s.gone_since = now
            self._ids = itertools.count(max(next(self._ids), max([0, *self._clients]) + 1))
            self._announce(self._fleet.islands())
            return [int(s["client"]) for s in sessions if int(s["client"]) not in kept]

    def forget_restored(self) -> None:
        """A resume into a fresh cluster failed: drop the sessions and slices it restored."""
        with self._lock:
            self._clients.clear()
            self._slices.clear()
