"""The resource manager's logic: the runtime's authority, as a plain object that Ray cannot call.

It starts the islands and keeps them serving (it checks every host's health and restarts a failed island's
hosts with a new epoch, saying what was lost); it holds the tenant registry; it opens a session for each
client that proves its tenant (a credential the admin issued, or a job's one-time ticket) and tells the
hosts each session's key, tenant, weight and budgets, so that no host believes a name, weight or budget a
client's message carries. It places virtual slices within each tenant's device quota and reclaims what a
session held once it ends: closed, expired (not renewed), its client's connection gone longer than the
grace period, or its credential rotated or removed.

``ManagerActor`` (``resource_manager.actor``) is how Ray holds it; clients reach it through its client
endpoint (``resource_manager.service``), which calls the methods below with the session its connection proved.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from pathways import auth, snapshot
from pathways.budgets import Budgets, over
from pathways.errors import PathwaysError, ResourceError, TenantAccessError
from pathways.messages import (
    CLIENT_ID_BITS,
    EndSession,
    Grant,
    IslandFailed,
    OpenSession,
    PeerTable,
    ReleaseTenant,
    Revoke,
    SetBudgets,
    SetWeight,
)
from pathways.topology import Topology
from resource_manager.island import Island, restart_island, start_islands
from resource_manager.notices import Notices
from resource_manager.placement import Allocation, Inventory, place
from resource_manager.registry import Registry, TenantRecord, check_name, check_quota, check_weight
from resource_manager.suspension import RUNNING, SUSPENDING, Suspension

PING_TIMEOUT = 2.0
ISLAND_CHECK_S = 1.0
CENSUS_S = 1.0  # how often the buffers each tenant holds are counted (what a restart says was lost)
STRIKES = 3  # health checks in a row without an answer before a host counts as failed
RESTART_TIMEOUT = 120.0
RESTART_RETRY_S = 15.0
SESSION_TTL_S = 60.0  # a session not renewed for this long ends (clients renew every few seconds)
TICKET_TTL_S = 600.0
MAX_CLIENTS = (1 << (63 - CLIENT_ID_BITS)) - 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """How the runtime was started (``pathways up``'s options, or ``pw.init``'s for an embedded cluster)."""

    topology: dict
    op_timeout: float
    gap_timeout: float
    start_timeout: float
    grace: float
    admin_digest: str | None
    registry_path: str | None = None
    implicit: dict | None = None  # the embedded cluster's one tenant: {"tenant", "digest"}
    default_quota: int | None = None
    jobs_dir: str | None = None
    unsafe_jobs_as_runtime_user: bool = False  # every tenant's jobs run as the runtime's own user
    suspend_dir: str | None = None  # where SIGTERM (a preemption notice) suspends the cluster to
    suspend_timeout: float = 60.0


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


@dataclass
class Ticket:
    """A job's single-use ticket, stored under its digest: the tenant it opens a session for, until ``expires``."""

    tenant: str
    job: str
    expires: float
    used: bool = False


class ResourceManager:
    """The runtime's authority: islands and their health, the tenant registry, sessions, slices, quotas."""

    def __init__(self, config: Config, runtime_key: bytes, runtime_id: str) -> None:
        self.config = config
        self.topology = Topology.from_wire(config.topology)
        self.runtime_id = runtime_id
        self.started = time.time()
        self._lock = threading.RLock()
        self._key = runtime_key
        self.suspension = Suspension(self)
        self.notices = Notices(self.cluster_state)
        self.registry = Registry(config.registry_path, config.admin_digest, config.default_quota,
                                 make_job_users=config.registry_path is not None)
        implicit = config.implicit
        if implicit is not None and self.registry.get(implicit["tenant"]) is None:
            self.registry.add(implicit["tenant"], 1.0, None, digest=implicit["digest"])
        self.islands: list[Island] = start_islands(self.topology, runtime_key, runtime_id, config.op_timeout,
                                                   config.gap_timeout, config.start_timeout)
        self.inventory = Inventory(self.topology)
        self.clients: dict[int, Client] = {}
        self.tickets: dict[str, Ticket] = {}
        self.reclaimed: list[dict] = []
        self.restarts: list[dict] = []
        self.refusals: list[dict] = []
        self._census: dict[int, dict[str, tuple[int, int]]] = {}
        self._strikes: dict[tuple[int, int], int] = {}
        self._restarting: set[int] = set()
        self._client_ids = itertools.count(1)
        self._slice_ids = itertools.count(1)
        self._orders = itertools.count(1)
        self._order_all(self._peer_table())
        threading.Thread(target=self._watch_sessions, name="session-watch", daemon=True).start()
        threading.Thread(target=self._watch_islands, name="island-watch", daemon=True).start()

    # -- orders to hosts ----------------------------------------------------------------------------------
    def _order(self, hosts: list[tuple[int, int, Any]], order: Any, handles: list | None = None,
               wait: bool = True) -> None:
        """Send ``order`` to each (island, host, actor): signed with the runtime key for that host, numbered
        once (a host refuses a number it has seen)."""
        payload, seq = order.encode(), next(self._orders)
        refs = [h.control.remote(payload, seq, auth.sign(self._key, "control", i, k, seq, payload), handles)
                for i, k, h in hosts]
        if not wait:
            return
        for ref in refs:
            try:
                ray.get(ref, timeout=PING_TIMEOUT * 5)
            except Exception as exc:  # a dying host is the health check's to report
                log.warning("a host did not take %s: %s", type(order).__name__, exc)

    def _healthy(self) -> list[Island]:
        return [i for i in self.islands if i.index not in self.inventory.unhealthy]

    def _hosts(self, islands: list[Island]) -> list[tuple[int, int, Any]]:
        return [(i.index, k, h) for i in islands for k, h in enumerate(i.hosts)]

    def _order_all(self, order: Any, handles: list | None = None, wait: bool = True) -> None:
        if isinstance(order, tuple):
            order, handles = order
        self._order(self._hosts(self._healthy()), order, handles, wait)

    def _peer_table(self) -> tuple[PeerTable, list]:
        infos = [info for i in self.islands for info in i.host_info]
        hosts = [{"island": h["island"], "host": h["host"], "node": h["node"], "pid": h["pid"],
                  "channel": h["channel"], "data": h["data"]} for h in infos]
        return PeerTable(hosts), [h for i in self.islands for h in i.hosts]

    def sign_for(self, island: int, host: int, purpose: str, *parts: Any) -> bytes:
        """The runtime key's MAC for a call to host ``host`` of ``island``."""
        return auth.sign(self._key, purpose, island, host, *parts)

    @property
    def lock(self) -> threading.RLock:
        """The lock of everything the resource manager holds."""
        return self._lock

    @property
    def key(self) -> bytes:
        """The runtime key (the island hosts' and the resource manager's shared secret)."""
        return self._key

    def cluster_state(self) -> dict:
        """The cluster's phase and generation (which every suspend and resume moves on), and its islands: what a
        client's watch is answered with."""
        with self._lock:
            return {"state": self.suspension.phase, "generation": self.suspension.generation,
                    "islands": self._islands_public()}

    # -- what anyone may ask ------------------------------------------------------------------------------
    def ready(self) -> dict:
        """The runtime's topology and identity: what a client checks before it opens a session."""
        return {"topology": self.topology.to_wire(), "started": self.started, "runtime": self.runtime_id}

    def whoami(self, tenant: str, credential: str) -> dict:
        """Whether a credential is the admin's or ``tenant``'s (TenantAccessError for neither)."""
        if self.registry.is_admin(credential):
            return {"admin": True, "tenant": None}
        return {"admin": False, "tenant": self.registry.authenticate(tenant, credential).name}

    # -- sessions -----------------------------------------------------------------------------------------
    def open_session(self, tenant: str, credential: str | None, ticket: str | None, pid: int,
                     job: str | None) -> tuple[int, bytes, dict]:
        """A new session for the tenant a credential (or a job's ticket) proves: (client id, session key, the
        answer the client gets: its tenant, weight, quota, budgets, the topology and the islands' hosts)."""
        with self._lock:
            self.suspension.refuse("opening a session")
            if ticket:
                name = self._redeem(ticket, job or "")
                record = self.registry.get(name)
                if record is None:
                    raise TenantAccessError("the ticket's tenant no longer exists")
            else:
                record = self.registry.authenticate(tenant, credential)
            limits = record.limits
            open_now = sum(1 for c in self.clients.values() if c.tenant == record.name)
            if open_now >= limits.sessions:
                raise over("sessions", open_now, 1, limits.sessions, "sessions")
            client = next(self._client_ids)
            if client > MAX_CLIENTS:
                raise ResourceError("this runtime has opened all the sessions it can; restart it")
            key = auth.new_key()
            self.clients[client] = Client(record.name, key, pid, job or "", time.monotonic() + SESSION_TTL_S)
            self._order_all(OpenSession(client, record.name, key, record.weight, limits.to_wire()))
            return client, key, {"client": client, "tenant": record.name, "weight": record.weight,
                                 "quota": record.quota, "budgets": limits.to_wire(),
                                 "topology": self.topology.to_wire(), "runtime": self.runtime_id,
                                 "ttl": SESSION_TTL_S, "islands": self._islands_public()}

    def _redeem(self, ticket: str, job: str) -> str:
        record = self.tickets.get(auth.digest(ticket)) if isinstance(ticket, str) else None
        if record is None or record.expires < time.time():
            raise TenantAccessError("unknown or expired ticket; submit the job again with `pathways submit`")
        if record.used or record.job != job:
            self.refusals.append({"at": time.time(), "job": record.job, "by_job": job})
            log.warning("refused a ticket of job %s (presented by job %r, used before: %s)", record.job, job,
                        record.used)
            raise TenantAccessError(f"the ticket of job {record.job} was already used or belongs to another job; a "
                                    "ticket opens one session, for its own job")
        record.used = True
        return record.tenant

    def issue_ticket(self, tenant: str, job: str) -> str:
        """A single-use ticket for job ``job`` of ``tenant`` (the job runner hands it to the job's process)."""
        with self._lock:
            now = time.time()
            self.tickets = {d: t for d, t in self.tickets.items() if t.expires > now}  # used ones stay, to log reuse
            ticket = auth.new_secret()
            self.tickets[auth.digest(ticket)] = Ticket(tenant, job, now + TICKET_TTL_S)
            return ticket

    def caller(self, client: int) -> tuple[bytes, str, Budgets] | None:
        """The session's key, tenant and budgets, for its connections' handshakes (None once it ended)."""
        session = self.clients.get(client)
        if session is None:
            return None
        record = self.registry.get(session.tenant)
        return session.key, session.tenant, record.limits if record is not None else Budgets()

    def connected(self, client: int, up: bool) -> None:
        """A connection of ``client`` to the resource manager opened (``up``) or closed: a session whose client
        keeps no connection for longer than the grace period ends."""
        with self._lock:
            session = self.clients.get(client)
            if session is None:
                return
            session.connections += 1 if up else -1
            session.gone_since = None if session.connections > 0 else time.monotonic()

    def renew(self, client: int) -> dict:
        """Keep the session alive; each island's epoch and health, with the hosts of every island (a client
        reconnects to an island whose epoch changed)."""
        with self._lock:
            session = self._session(client)
            session.expires = time.monotonic() + SESSION_TTL_S
            return self.cluster_state()

    def _session(self, client: int) -> Client:
        session = self.clients.get(client)
        if session is None:
            raise TenantAccessError("this session has ended (closed, expired or reclaimed); call pw.init() again")
        return session

    def close(self, client: int) -> None:
        """The client ends its session: its slices are released and its buffers freed."""
        with self._lock:
            self._forget(client, free_buffers=True, why="closed")

    def _forget(self, client: int, free_buffers: bool, why: str) -> dict:
        info = self.clients.pop(client, None)
        keys = [k for k, a in self.inventory.allocations.items() if a.client == client]
        for key in keys:
            alloc = self.inventory.allocations.pop(key)
            self._order(self._hosts([self.islands[alloc.island]])[:1], Revoke([key]), wait=False)
        self._order_all(EndSession(client, free_buffers), wait=False)
        record = {"client": client, "tenant": info.tenant if info else None, "slices": keys, "why": why,
                  "at": time.time()}
        if info is not None and why != "closed":
            self.reclaimed.append(record)
            self.reclaimed = self.reclaimed[-100:]
            log.warning("reclaimed client %s of tenant %s: %s", client, info.tenant, why)
        return record

    def _end_tenant_sessions(self, tenant: str, why: str) -> None:
        """End every session of ``tenant`` and void its unredeemed tickets (its credential changed or it left)."""
        for client in [c for c, s in self.clients.items() if s.tenant == tenant]:
            self._forget(client, free_buffers=True, why=why)
        for ticket in self.tickets.values():
            if ticket.tenant == tenant:
                ticket.used = True

    def _watch_sessions(self) -> None:
        """End sessions that were not renewed, or whose client's connection has been gone past the grace."""
        while True:
            time.sleep(0.5)
            try:
                now = time.monotonic()
                with self._lock:
                    for client, s in list(self.clients.items()):
                        if s.gone_since is not None and now - s.gone_since > self.config.grace:
                            self._forget(client, True, f"its connection was gone for {self.config.grace:.0f}s")
                        elif now > s.expires:
                            self._forget(client, True, f"it was not renewed for {SESSION_TTL_S:.0f}s")
            except Exception:  # the watch must outlive any one mistake
                log.exception("resource manager: watching sessions failed")

    # -- slices -------------------------------------------------------------------------------------------
    def allocate(self, client: int, shape: list, axes: list, island: int | None) -> dict:
        """A virtual slice for the client's tenant, within its device quota."""
        with self._lock:
            tenant = self._session(client).tenant
            self.suspension.refuse("placing a slice")
            shape_t, axes_t = tuple(shape), tuple(axes)
            where, devices = place(self.inventory, shape_t, axes_t, island)
            record = self.registry.get(tenant)
            quota = record.quota if record is not None else None
            held = sum(len(a.devices) for a in self.inventory.allocations.values() if a.tenant == tenant)
            if quota is not None and held + len(devices) > quota:
                raise ResourceError(f"tenant {tenant!r} asked for a slice of shape {shape_t} ({len(devices)} devices) "
                                    f"but holds {held} of its quota of {quota} devices; release a slice first")
            alloc = Allocation(f"s{next(self._slice_ids)}", tenant, client, where, shape_t, axes_t, devices)
            self._order(self._hosts([self.islands[where]])[:1], Grant(alloc.desc().to_wire(), tenant))
            self.inventory.allocations[alloc.key] = alloc
            return alloc.to_wire()

    def release(self, client: int, key: str) -> None:
        """Free slice ``key`` of the client's tenant."""
        with self._lock:
            tenant = self._session(client).tenant
            self.suspension.refuse("releasing a slice")
            alloc = self.inventory.allocations.get(key)
            if alloc is None or alloc.tenant != tenant:
                raise ResourceError(f"you hold no slice {key!r}")
            del self.inventory.allocations[key]
            self._order(self._hosts([self.islands[alloc.island]])[:1], Revoke([key]), wait=False)

    # -- island health ------------------------------------------------------------------------------------
    def _watch_islands(self) -> None:
        last_census = 0.0
        while True:
            time.sleep(ISLAND_CHECK_S)
            try:
                self._check_islands()
                if time.monotonic() - last_census > CENSUS_S:
                    last_census = time.monotonic()
                    self._take_census()
            except Exception:  # the watch must outlive any one mistake
                log.exception("resource manager: checking the islands failed")

    def _check_islands(self, only: int | None = None) -> None:
        with self._lock:
            if self.suspension.phase not in (RUNNING, SUSPENDING):  # no islands, or new ones starting
                return
            islands = [i for i in self.islands if i.index not in self._restarting and only in (None, i.index)]
        for island in islands:
            refs = [h.health.remote(self.sign_for(island.index, k, "health")) for k, h in enumerate(island.hosts)]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT)
            reason = None
            for k, ref in enumerate(refs):
                if ref not in ready:
                    strikes = self._strikes[(island.index, k)] = self._strikes.get((island.index, k), 0) + 1
                    if strikes >= STRIKES:
                        reason = f"host {k} did not answer {STRIKES} health checks in a row"
                    continue
                self._strikes.pop((island.index, k), None)
                try:
                    health = ray.get(ref, timeout=0)
                except Exception as exc:  # the actor (or its node) is gone
                    reason = f"host {k} died ({type(exc).__name__})"
                    break
                if not health["ok"]:
                    reason = health["reason"]
                    break
            if reason is not None:
                self._island_failed(island, reason)

    def suspect(self, client: int, island: int, reason: str) -> None:
        """A client saw an island fail: check it now (the client's word alone marks nothing)."""
        self._session(client)
        if self.suspension.phase != RUNNING:
            return
        if not 0 <= island < len(self.islands):
            raise ResourceError(f"no island {island!r}")
        threading.Thread(target=self._check_islands, args=(island,), daemon=True).start()

    def _take_census(self) -> None:
        """What each island holds per tenant, kept so a restart can say what was lost."""
        if self.suspension.phase != RUNNING:
            return
        for island in self._healthy():
            refs = [h.census.remote(self.sign_for(island.index, k, "census")) for k, h in enumerate(island.hosts)]
            try:
                counts = ray.get(refs, timeout=PING_TIMEOUT)
            except Exception:  # the health check handles a host that does not answer
                continue
            total: dict[str, tuple[int, int]] = {}
            for by_tenant in counts:
                for tenant, (n, b) in by_tenant.items():
                    old = total.get(tenant, (0, 0))
                    total[tenant] = (old[0] + n, old[1] + b)
            self._census[island.index] = total

    def _island_failed(self, island: Island, reason: str) -> None:
        with self._lock:
            if island.index in self._restarting or self.islands[island.index] is not island:
                return
            self._restarting.add(island.index)
            self.inventory.unhealthy[island.index] = reason
            lost = self._census.pop(island.index, {})
            log.error("island %d failed: %s; restarting it", island.index, reason)
            self._order_all(IslandFailed(island.index), wait=False)
        threading.Thread(target=self._restart, args=(island, reason, lost), name="island-restart", daemon=True).start()

    def _restart(self, island: Island, reason: str, lost: dict) -> None:
        c = self.config
        while True:
            try:
                new = restart_island(self.topology, island, self._key, self.runtime_id, c.op_timeout, c.gap_timeout,
                                     RESTART_TIMEOUT)
                break
            except Exception as exc:  # no node for it yet: stay unhealthy, try again
                log.error("island %d could not restart: %s", island.index, exc)
                with self._lock:
                    self.inventory.unhealthy[island.index] = f"{reason}; restart failed, retrying: {exc}"
                time.sleep(RESTART_RETRY_S)
        with self._lock:
            self.islands[island.index] = new
            table, handles = self._peer_table()  # every host, the new ones too, learns the new table
            self._order(self._hosts([i for i in self.islands if i.index not in self.inventory.unhealthy or i is new]),
                        table, handles)
            self._announce([new])
            self.inventory.unhealthy.pop(island.index, None)
            self._restarting.discard(island.index)
            self.restarts.append({"island": island.index, "epoch": new.epoch, "at": time.time(), "reason": reason,
                                  "lost": {t: list(v) for t, v in lost.items()}})
            self.restarts = self.restarts[-100:]
        log.warning("island %d restarted (epoch %d) after: %s", island.index, new.epoch, reason)

    def _announce(self, islands: list[Island]) -> None:
        """Tell new hosts every open session and the slices on their islands (the lock held)."""
        for client, s in self.clients.items():
            record = self.registry.get(s.tenant)
            limits = record.limits if record is not None else Budgets()
            self._order(self._hosts(islands), OpenSession(client, s.tenant, s.key, self._weight(s.tenant),
                                                          limits.to_wire()))
        for island in islands:
            for alloc in self.inventory.allocations.values():
                if alloc.island == island.index:
                    self._order(self._hosts([island])[:1], Grant(alloc.desc().to_wire(), alloc.tenant))

    # -- suspend and resume (``resource_manager.suspension``) ----------------------------------------------
    def restarting(self) -> set[int]:
        """The islands restarting after a failure now."""
        with self._lock:
            return set(self._restarting)

    def sessions_to_wire(self) -> list[dict]:
        """Every open session with its key: what a suspended cluster's manifest keeps."""
        with self._lock:
            return [{"client": c, "tenant": s.tenant, "key": s.key.hex(), "pid": s.pid, "job": s.job,
                     "since": s.since} for c, s in self.clients.items()]

    def allocations_to_wire(self) -> list[dict]:
        """Every slice: what a suspended cluster's manifest keeps."""
        with self._lock:
            return [a.to_wire() for a in self.inventory.allocations.values()]

    def replace_islands(self, islands: list[Island]) -> None:
        """New hosts for every island (a resume): every host learns the peer table."""
        with self._lock:
            self.islands = list(islands)
            self.inventory.unhealthy.clear()
            self._strikes.clear()
            self._census.clear()
            self._order_all(self._peer_table())

    def restore_sessions(self, sessions: list[dict], allocations: list[dict]) -> list[int]:
        """A resume's sessions and slices: on this cluster, the sessions still open (those closed meanwhile stay
        closed); on a fresh one, the saved ones whose tenant the registry still has, with a grace period for
        their clients to reconnect. Every host then learns them; returns the saved sessions left out."""
        now = time.monotonic()
        with self._lock:
            fresh = not self.clients
            kept = set()
            for s in sessions:
                client, tenant = int(s["client"]), str(s["tenant"])
                if client in self.clients:
                    kept.add(client)
                elif fresh and self.registry.get(tenant) is not None:
                    self.clients[client] = Client(tenant, bytes.fromhex(s["key"]), int(s["pid"]), str(s["job"]),
                                                  now + SESSION_TTL_S, float(s["since"]), gone_since=now)
                    kept.add(client)
            if fresh:
                for a in allocations:
                    if int(a["client"]) in kept:
                        alloc = Allocation(str(a["key"]), str(a["tenant"]), int(a["client"]), int(a["island"]),
                                           tuple(a["shape"]), tuple(a["axes"]), [tuple(d) for d in a["devices"]])
                        self.inventory.allocations[alloc.key] = alloc
            for s in self.clients.values():
                s.expires = now + SESSION_TTL_S
                if s.connections == 0:
                    s.gone_since = now
            top_client = max([0, *self.clients], default=0)
            top_slice = max([0, *(int(k[1:]) for k in self.inventory.allocations if k[1:].isdigit())])
            self._client_ids = itertools.count(max(next(self._client_ids), top_client + 1))
            self._slice_ids = itertools.count(max(next(self._slice_ids), top_slice + 1))
            self._announce(self.islands)
            return [int(s["client"]) for s in sessions if int(s["client"]) not in kept]

    def forget_restored(self) -> None:
        """A resume into a fresh cluster failed: drop the sessions and slices it restored."""
        with self._lock:
            self.clients.clear()
            self.inventory.allocations.clear()

    def _weight(self, tenant: str) -> float:
        record = self.registry.get(tenant)
        return record.weight if record is not None else 1.0

    # -- the admin ----------------------------------------------------------------------------------------
    def admin(self, credential: str, op: str, args: dict) -> Any:
        """One of the cluster admin's operations; TenantAccessError without the admin credential."""
        if not self.registry.is_admin(credential):
            raise TenantAccessError("this operation needs the cluster's admin credential (the file `pathways up` "
                                    "wrote, readable by its owner only)")
        slow = {"suspend": self._suspend, "resume": self._resume}  # they wait on the islands: not under the lock
        handler = self._admin_ops().get(op)
        if op in slow:
            return slow[op](args)
        if handler is None:
            known = sorted([*self._admin_ops(), *slow])
            raise ResourceError(f"unknown admin operation {op!r}; known: {', '.join(known)}")
        with self._lock:
            return handler(args)

    def _suspend(self, args: dict) -> dict:
        directory = args.get("dir") or self.snapshot_dir()
        if not isinstance(directory, str):
            raise PathwaysError("name the directory to suspend into (pathways suspend DIR), or start the runtime "
                                "with `pathways up --suspend-dir DIR`")
        return self.suspension.suspend(directory, _seconds(args.get("timeout"), self.config.suspend_timeout))

    def _resume(self, args: dict) -> dict:
        directory = args.get("dir") or self.suspension.directory
        if not directory and self.config.suspend_dir:
            directory = snapshot.newest(self.config.suspend_dir)
        if not isinstance(directory, str):
            raise PathwaysError("name the directory to resume from (pathways resume DIR): this runtime was not "
                                "suspended, and its --suspend-dir holds no finished suspend")
        return self.suspension.resume(directory, _seconds(args.get("timeout"), self.config.suspend_timeout))

    def snapshot_dir(self) -> str | None:
        """Where a suspend that names no directory goes: a new one under ``--suspend-dir``, named by its time."""
        return snapshot.stamped(self.config.suspend_dir, time.time()) if self.config.suspend_dir else None

    def _admin_ops(self) -> dict[str, Any]:
        return {"tenants": lambda a: self._tenants(), "tenant_add": self._tenant_add, "tenant_set": self._tenant_set,
                "tenant_remove": self._tenant_remove, "reclaim": self._reclaim, "mark": self._mark,
                "state": lambda a: self.state(None), "schedule": lambda a: self._schedules(),
                "host_stats": lambda a: self._host_stats(), "probe_network": self._probe_network,
                "usage": lambda a: self._usage()}

    def _tenant_add(self, args: dict) -> dict:
        return {"credential": self.registry.add(check_name(args.get("name")), args.get("weight", 1.0),
                                                check_quota(args.get("quota")), budgets=args.get("budgets"),
                                                job_user=args.get("job_user"))}

    def _tenant_set(self, args: dict) -> dict:
        name = args.get("name")
        quota = check_quota(args["quota"]) if "quota" in args else "keep"
        weight = check_weight(args["weight"]) if args.get("weight") is not None else None
        budgets = args.get("budgets") or None
        secret = self.registry.set(name, weight, quota, bool(args.get("new_credential")), budgets,
                                   args.get("job_user"))
        record: TenantRecord = self.registry.get(name)
        if weight is not None:
            self._order(self._hosts([i for i in self._healthy()]), SetWeight(name, weight))
        if budgets:
            self._order_all(SetBudgets(name, record.limits.to_wire()))
        if secret is not None:
            self._end_tenant_sessions(name, "its credential was rotated")
        return {"credential": secret}

    def _tenant_remove(self, args: dict) -> None:
        name = args.get("name")
        self.registry.remove(name)
        self._end_tenant_sessions(name, "its tenant was removed")
        self._order_all(ReleaseTenant(name), wait=False)

    def _reclaim(self, args: dict) -> list[dict]:
        clients = [c for c, s in self.clients.items() if s.tenant == args.get("tenant") or c == args.get("client")]
        return [self._forget(c, free_buffers=True, why="reclaimed by the admin") for c in clients]

    def _mark(self, args: dict) -> None:
        island = args.get("island")
        if not isinstance(island, int) or not 0 <= island < len(self.islands):
            raise ResourceError(f"no island {island!r}")
        if args.get("healthy"):
            self.inventory.unhealthy.pop(island, None)
        else:
            self.inventory.unhealthy[island] = str(args.get("reason") or "marked unhealthy by the admin")

    def _schedules(self) -> list[dict]:
        out = []
        for i in self._healthy():
            try:
                out.append(ray.get(i.scheduler.tenant_schedule.remote(self.sign_for(i.index, 0, "tenant_schedule")),
                                   timeout=PING_TIMEOUT * 5))
            except Exception:  # a host that does not answer is the health check's to report
                continue
        return out

    def _host_stats(self) -> list[list[dict | None]]:
        refs = [[h.stats.remote(self.sign_for(i.index, k, "stats")) for k, h in enumerate(i.hosts)]
                for i in self.islands]
        out = []
        for row in refs:
            stats = []
            for ref in row:
                try:
                    stats.append(ray.get(ref, timeout=PING_TIMEOUT * 5))
                except Exception:  # reported as not alive
                    stats.append(None)
            out.append(stats)
        return out

    def _probe_network(self, args: dict) -> float:
        (si, sh), (di, dh), nbytes = args["src"], args["dst"], args["nbytes"]
        host = self.islands[si].hosts[sh]
        return ray.get(host.probe_network.remote(self.sign_for(si, sh, "probe_network", di, dh, nbytes), di, dh,
                                                 nbytes), timeout=600)

    def _usage(self) -> dict:
        self._take_census()
        return {str(i): {t: list(v) for t, v in c.items()} for i, c in self._census.items()}

    def _tenants(self) -> list[dict]:
        out = []
        for t in self.registry.listing():
            t["clients"] = sum(1 for s in self.clients.values() if s.tenant == t["name"])
            t["devices"] = sum(len(a.devices) for a in self.inventory.allocations.values() if a.tenant == t["name"])
            out.append(t)
        return out

    # -- state --------------------------------------------------------------------------------------------
    def _islands_public(self) -> list[dict]:
        return [{"index": i.index, "epoch": i.epoch, "healthy": i.index not in self.inventory.unhealthy,
                 "reason": self.inventory.unhealthy.get(i.index, ""),
                 "hosts": [{k: h[k] for k in ("island", "host", "node", "ip", "devices", "node_labels",
                                              "memory_bytes", "device_bytes", "channel", "data", "client")}
                           for h in i.host_info]}
                for i in self.islands]

    def state_of(self, client: int) -> dict:
        """The cluster as the client's tenant may see it."""
        with self._lock:
            return self.state(self._session(client).tenant)

    def state(self, tenant: str | None) -> dict:
        """The cluster as ``tenant`` may see it (its own slices, clients and losses by name; others as counts),
        or whole for the admin (``tenant`` None)."""
        def mine(t: str | None) -> bool:
            return tenant is None or t == tenant

        allocs = [a for a in self.inventory.allocations.values() if mine(a.tenant)]
        others = [a for a in self.inventory.allocations.values() if not mine(a.tenant)]
        tenants = {t["name"]: t for t in self._tenants() if mine(t["name"])}
        restarts = [{**r, "lost": {t: v for t, v in r["lost"].items() if mine(t)}} for r in self.restarts]
        return {
            "topology": self.topology.to_wire(), "started": self.started, "islands": self._islands_public(),
            "allocations": [a.to_wire() for a in allocs],
            "others": {"slices": len(others), "devices": sum(len(a.devices) for a in others),
                       "tenants": len({a.tenant for a in others} | ({t for t in self.registry.tenants if not mine(t)}
                                                                     if tenant is not None else set()))},
            "clients": {str(c): {"tenant": s.tenant, "pid": s.pid, "since": s.since, "job": s.job}
                        for c, s in self.clients.items() if mine(s.tenant)},
            "tenants": tenants, "restarts": restarts[-20:],
            "reclaimed": [r for r in self.reclaimed if mine(r["tenant"])][-20:],
            "refusals": self.refusals[-20:] if tenant is None else [],
            "cluster": {"state": self.suspension.phase, "generation": self.suspension.generation,
                        **({"suspended_to": self.suspension.directory, "last": self.suspension.last,
                            "pid": os.getpid(), "suspend_dir": self.config.suspend_dir} if tenant is None else {})},
        }


def _seconds(value: Any, default: float) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or not 0 < value <= 24 * 3600:
        raise PathwaysError(f"a timeout is a number of seconds between 0 and 86400, not {value!r}")
    return float(value)
