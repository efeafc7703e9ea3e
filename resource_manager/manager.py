"""The resource manager: the runtime's authority, as a plain object that Ray cannot call.

It wires the parts that hold the runtime's state, each with its own lock, and routes each request to the part
that answers it:

- ``fleet.Fleet``: the islands' hosts and the runtime key that signs every order and call sent to them;
- ``health.IslandHealth``: which islands are in service, found by health checks; this object restarts a failed
  island's hosts with a new epoch, saying what was lost;
- ``registry.Registry``: the tenants, their weights, quotas, budgets and credentials;
- ``tickets.Tickets``: jobs' single-use tickets;
- ``sessions.Sessions``: a session for each client that proves its tenant, told to every host with the tenant's
  key, weight and budgets (no host believes a name, weight or budget a client's message carries), and reclaimed
  once it ends: closed, expired, its client gone past the grace period, or its credential rotated or removed;
- ``slices.Slices``: the virtual slices placed within each tenant's device quota;
- ``phase.ClusterPhase`` and ``suspension.Suspension``: suspending the cluster and resuming it;
- ``admin.AdminOps``: the admin's typed requests, one handler each; ``view.ClusterView``: what is shown.

``ManagerActor`` (``resource_manager.actor``) is how Ray holds it; clients reach it through its client
endpoint (``resource_manager.service``), which calls the methods below with the session its connection proved.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pathways.budgets import Budgets
from pathways.errors import ResourceError
from pathways.topology import Topology
from resource_manager.admin import AdminOps
from resource_manager.fleet import Fleet
from resource_manager.health import IslandHealth
from resource_manager.island import Island
from resource_manager.notices import Notices
from resource_manager.phase import RUNNING, ClusterPhase
from resource_manager.registry import Registry
from resource_manager.sessions import SESSION_TTL_S, Sessions
from resource_manager.slices import Slices
from resource_manager.suspension import Suspension
from resource_manager.tickets import Tickets
from resource_manager.view import ClusterView, cluster_state

ISLAND_CHECK_S = 1.0
SESSION_CHECK_S = 0.5
RESTART_TIMEOUT = 120.0
RESTART_RETRY_S = 15.0
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


class ResourceManager:
    """The parts of the runtime's authority, wired together; the watches that keep sessions and islands alive."""

    def __init__(self, config: Config, runtime_key: bytes, runtime_id: str) -> None:
        self.config = config
        self.runtime_id = runtime_id
        started = time.time()
        topology = Topology.from_wire(config.topology)
        self.phase = ClusterPhase()
        self.registry = Registry(config.registry_path, config.admin_digest, config.default_quota,
                                 make_job_users=config.registry_path is not None)
        implicit = config.implicit
        if implicit is not None and self.registry.get(implicit["tenant"]) is None:
            self.registry.add(implicit["tenant"], 1.0, None, digest=implicit["digest"])
        self.tickets = Tickets()
        self.fleet = Fleet(topology, runtime_key, runtime_id, config.op_timeout, config.gap_timeout,
                           config.start_timeout)
        self.health = IslandHealth(self.fleet, self.phase)
        self.slices = Slices(topology, self.fleet, self.health)
        self.sessions = Sessions(self.registry, self.tickets, self.slices, self.fleet, self.health, self.phase,
                                 config.grace)
        self.notices = Notices(lambda: cluster_state(self.phase, self.health))
        self.suspension = Suspension(self.phase, self.fleet, self.health, self.sessions, self.slices, self.notices)
        self.view = ClusterView(topology, runtime_id, started, config.suspend_dir, self.registry, self.sessions,
                                self.slices, self.health, self.tickets, self.phase, self.suspension)
        self.admin_ops = AdminOps(self.registry, self.sessions, self.health, self.fleet, self.suspension, self.view,
                                  config.suspend_dir, config.suspend_timeout)
        threading.Thread(target=self._watch_sessions, name="session-watch", daemon=True).start()
        threading.Thread(target=self._watch_islands, name="island-watch", daemon=True).start()

    # -- what anyone may ask ------------------------------------------------------------------------------
    def ready(self) -> dict:
        """The runtime's topology and identity: what a client checks before it opens a session."""
        return self.view.ready()

    def whoami(self, tenant: str, credential: str) -> dict:
        """Whether a credential is the admin's or ``tenant``'s (TenantAccessError for neither)."""
        return self.registry.whoami(tenant, credential)

    def admin(self, credential: str, op: str, args: dict) -> Any:
        """One of the cluster admin's operations; TenantAccessError without the admin credential."""
        return self.admin_ops.run(credential, op, args)

    def snapshot_dir(self) -> str | None:
        """Where a suspend that names no directory goes (None without ``--suspend-dir``)."""
        return self.admin_ops.snapshot_dir()

    # -- a session's requests -----------------------------------------------------------------------------
    def open_session(self, tenant: str, credential: str | None, ticket: str | None, pid: int,
                     job: str | None) -> tuple[int, bytes, dict]:
        """A new session for the tenant a credential (or a job's ticket) proves: (client id, session key, the
        answer the client gets: its tenant, weight, quota, budgets, the topology and the islands' hosts)."""
        client, key, record = self.sessions.open(tenant, credential, ticket, pid, job)
        return client, key, {"client": client, "tenant": record.name, "weight": record.weight,
                             "quota": record.quota, "budgets": record.limits.to_wire(),
                             "topology": self.view.topology.to_wire(), "runtime": self.runtime_id,
                             "ttl": SESSION_TTL_S, "islands": self.health.public()}

    def caller(self, client: int) -> tuple[bytes, str, Budgets] | None:
        """The session's key, tenant and budgets, for its connections' handshakes (None once it ended)."""
        return self.sessions.caller(client)

    def connected(self, client: int, up: bool) -> None:
        """A connection of ``client`` opened (``up``) or closed: a session whose client keeps no connection for
        longer than the grace period ends."""
        self.sessions.connected(client, up)

    def renew(self, client: int) -> dict:
        """Keep the session alive; each island's epoch and health, with the hosts of every island (a client
        reconnects to an island whose epoch changed)."""
        self.sessions.renew(client)
        return self.view.cluster_state()

    def close(self, client: int) -> None:
        """The client ends its session: its slices are released and its buffers freed."""
        self.sessions.close(client)

    def allocate(self, client: int, shape: list, axes: list, island: int | None) -> dict:
        """A virtual slice for the client's tenant, within its device quota."""
        return self.sessions.allocate(client, tuple(shape), tuple(axes), island)

    def release(self, client: int, key: str) -> None:
        """Free slice ``key`` of the client's tenant."""
        self.sessions.release(client, key)

    def state_of(self, client: int) -> dict:
        """The cluster as the client's tenant may see it."""
        return self.view.state(self.sessions.tenant_of(client))

    def suspect(self, client: int, island: int, reason: str) -> None:
        """A client saw an island fail: check it now (the client's word alone marks nothing)."""
        self.sessions.tenant_of(client)
        if self.phase.now != RUNNING:
            return
        if not 0 <= island < len(self.fleet.islands()):
            raise ResourceError(f"no island {island!r}")
        threading.Thread(target=self._check_islands, args=(island,), daemon=True).start()

    # -- the watches --------------------------------------------------------------------------------------
    def _watch_sessions(self) -> None:
        """End sessions that were not renewed, or whose client's connection has been gone past the grace."""
        while True:
            time.sleep(SESSION_CHECK_S)
            try:
                self.sessions.expire()
            except Exception:  # the watch must outlive any one mistake
                log.exception("resource manager: watching sessions failed")

    def _watch_islands(self) -> None:
        while True:
            time.sleep(ISLAND_CHECK_S)
            try:
                self._check_islands()
            except Exception:  # the watch must outlive any one mistake
                log.exception("resource manager: checking the islands failed")

    def _check_islands(self, only: int | None = None) -> None:
        for failure in self.health.check(only):
            threading.Thread(target=self._restart, args=failure, name="island-restart", daemon=True).start()

    def _restart(self, island: Island, reason: str, lost: dict) -> None:
        """New hosts for a failed island (tried again until a node takes them); once they know the peers, every
        session and the island's slices, the island is back in service."""
        while True:
            try:
                new = self.fleet.restart(island, RESTART_TIMEOUT)
                break
            except Exception as exc:  # no node for it yet: stay unhealthy, try again
                log.error("island %d could not restart: %s", island.index, exc)
                self.health.retrying(island.index, f"{reason}; restart failed, retrying: {exc}")
                time.sleep(RESTART_RETRY_S)
        self.fleet.install(new)
        self.fleet.tell_peers([*self.health.healthy(), new])  # every host, the new ones too, learns the new table
        self.sessions.welcome(new, reason, lost)

