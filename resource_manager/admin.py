"""The cluster admin's operations: each typed request (``pathways.admin_requests``) has one handler, in one table.

The admin credential is checked before anything else of a request is read; then the request is built typed (an
unknown operation or a bad field is refused, saying which) and its handler runs. Each handler acts through the
parts that own what it changes (the registry, sessions, island health, the fleet, the suspension procedures).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from pathways import admin_requests, snapshot
from pathways.admin_requests import (
    HostCounters,
    MarkIsland,
    ProbeNetwork,
    Reclaim,
    Resume,
    Schedules,
    Suspend,
    TenantAdd,
    TenantList,
    TenantRemove,
    TenantSet,
    TenantUsage,
    WholeState,
)
from pathways.errors import PathwaysError, ResourceError, TenantAccessError
from resource_manager.fleet import ORDER_TIMEOUT, Fleet
from resource_manager.health import IslandHealth
from resource_manager.registry import Registry, check_name, check_quota, check_weight
from resource_manager.sessions import Sessions
from resource_manager.suspension import Suspension
from resource_manager.view import ClusterView

PROBE_TIMEOUT = 600.0
NOT_ADMIN = ("this operation needs the cluster's admin credential (the file `pathways up` wrote, readable by its "
             "owner only)")


class AdminOps:
    """The handlers of the admin's requests, by request type. It holds no state of its own (so no lock): each
    handler acts through a part, under that part's lock. ``suspend_dir`` and ``suspend_timeout`` are the runtime's
    defaults for a suspend or resume that names no directory or timeout."""

    def __init__(self, registry: Registry, sessions: Sessions, health: IslandHealth, fleet: Fleet,
                 suspension: Suspension, view: ClusterView, suspend_dir: str | None, suspend_timeout: float) -> None:
        self._registry, self._sessions, self._health, self._fleet = registry, sessions, health, fleet
        self._suspension, self._view = suspension, view
        self._suspend_dir, self._suspend_timeout = suspend_dir, suspend_timeout
        self._handlers: dict[type, Callable[[Any], Any]] = {
            TenantList: lambda r: view.tenants(), TenantAdd: self._tenant_add, TenantSet: self._tenant_set,
            TenantRemove: self._tenant_remove, Reclaim: lambda r: sessions.reclaim(r.tenant, r.client),
            MarkIsland: lambda r: health.mark(r.island, r.healthy, r.reason), WholeState: lambda r: view.state(None),
            Schedules: lambda r: self._schedules(), HostCounters: lambda r: self._host_stats(),
            ProbeNetwork: self._probe_network, TenantUsage: lambda r: self._usage(), Suspend: self._suspend,
            Resume: self._resume,
        }

    def run(self, credential: str, op: str, args: dict) -> Any:
        """Admin operation ``op`` with ``args`` (``AdminOp``'s fields); TenantAccessError without the admin
        credential, before anything else is read."""
        if not self._registry.is_admin(credential):
            raise TenantAccessError(NOT_ADMIN)
        request = admin_requests.from_wire(op, args)
        return self._handlers[type(request)](request)

    def snapshot_dir(self) -> str | None:
        """Where a suspend that names no directory goes: a new one under ``--suspend-dir``, named by its time."""
        return snapshot.stamped(self._suspend_dir, time.time()) if self._suspend_dir else None

    # -- tenants ------------------------------------------------------------------------------------------
    def _tenant_add(self, r: TenantAdd) -> dict:
        return {"credential": self._registry.add(check_name(r.name), r.weight, check_quota(r.quota),
                                                 budgets=r.budgets, job_user=r.job_user)}

    def _tenant_set(self, r: TenantSet) -> dict:
        quota = check_quota(r.quota) if r.quota != admin_requests.KEEP else r.quota
        weight = check_weight(r.weight) if r.weight is not None else None
        secret = self._registry.set(r.name, weight, quota, r.new_credential, r.budgets or None, r.job_user)
        self._sessions.tenant_changed(r.name, weight, bool(r.budgets))
        if secret is not None:
            self._sessions.end_tenant(r.name, "its credential was rotated")
        return {"credential": secret}

    def _tenant_remove(self, r: TenantRemove) -> None:
        self._registry.remove(r.name)
        self._sessions.end_tenant(r.name, "its tenant was removed", removed=True)

    # -- islands and hosts --------------------------------------------------------------------------------
    def _schedules(self) -> list[dict]:
        out = []
        for i in self._health.healthy():
            try:
                out.append(ray.get(i.scheduler.tenant_schedule.remote(self._fleet.sign(i.index, 0, "tenant_schedule")),
                                   timeout=ORDER_TIMEOUT))
            except Exception:  # a host that does not answer is the health check's to report
                continue
        return out

    def _host_stats(self) -> list[list[dict | None]]:
        refs = [[h.stats.remote(self._fleet.sign(i.index, k, "stats")) for k, h in enumerate(i.hosts)]
                for i in self._fleet.islands()]
        out = []
        for row in refs:
            stats = []
            for ref in row:
                try:
                    stats.append(ray.get(ref, timeout=ORDER_TIMEOUT))
                except Exception:  # reported as not alive
                    stats.append(None)
            out.append(stats)
        return out

    def _probe_network(self, r: ProbeNetwork) -> float:
        (si, sh), (di, dh) = r.src, r.dst
        islands = self._fleet.islands()
        for i, h in (r.src, r.dst):
            if i >= len(islands) or h >= len(islands[i].hosts):
                raise ResourceError(f"no host {h} on island {i}; the cluster has {len(islands)} island(s) of "
                                    f"{self._fleet.topology.hosts_per_island} host(s)")
        host = islands[si].hosts[sh]
        return ray.get(host.probe_network.remote(self._fleet.sign(si, sh, "probe_network", di, dh, r.nbytes), di, dh,
                                                 r.nbytes), timeout=PROBE_TIMEOUT)

    def _usage(self) -> dict:
        self._health.take_census()
        return {str(i): {t: list(v) for t, v in c.items()} for i, c in self._health.census().items()}

    # -- suspend and resume (they wait on the islands) ----------------------------------------------------
    def _suspend(self, r: Suspend) -> dict:
        directory = r.dir or self.snapshot_dir()
        if not isinstance(directory, str):
            raise PathwaysError("name the directory to suspend into (pathways suspend DIR), or start the runtime "
                                "with `pathways up --suspend-dir DIR`")
        return self._suspension.suspend(directory, self._timeout(r.timeout))

    def _resume(self, r: Resume) -> dict:
        directory = r.dir or self._suspension.directory
        if not directory and self._suspend_dir:
            directory = snapshot.newest(self._suspend_dir)
        if not isinstance(directory, str):
            raise PathwaysError("name the directory to resume from (pathways resume DIR): this runtime was not "
                                "suspended, and its --suspend-dir holds no finished suspend")
        return self._suspension.resume(directory, self._timeout(r.timeout))

    def _timeout(self, timeout: float | None) -> float:
        return self._suspend_timeout if timeout is None else float(timeout)
