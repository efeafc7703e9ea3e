"""What clients and the admin are shown of the cluster, read from the parts that hold it.

A tenant sees its own slices, sessions and losses by name and everyone else's only as counts; the admin sees the
whole cluster. Nothing here is kept: every answer is read anew.
"""

from __future__ import annotations

import os

from pathways.topology import Topology
from resource_manager.health import IslandHealth
from resource_manager.phase import ClusterPhase
from resource_manager.registry import Registry
from resource_manager.sessions import Sessions
from resource_manager.slices import Slices
from resource_manager.suspension import Suspension
from resource_manager.tickets import Tickets

SHOWN = 20  # restarts, reclaimed sessions and refused tickets a state shows, the last ones


def cluster_state(phase: ClusterPhase, health: IslandHealth) -> dict:
    """The cluster's phase and generation (which every suspend and resume moves on), and its islands: what a
    client's watch and renewals are answered with."""
    now, generation = phase.read()
    return {"state": now, "generation": generation, "islands": health.public()}


class ClusterView:
    """Reads the registry, sessions, slices, island health, tickets, phase and suspension; holds nothing."""

    def __init__(self, topology: Topology, runtime_id: str, started: float, suspend_dir: str | None,
                 registry: Registry, sessions: Sessions, slices: Slices, health: IslandHealth, tickets: Tickets,
                 phase: ClusterPhase, suspension: Suspension) -> None:
        self.topology, self.runtime_id, self.started = topology, runtime_id, started
        self._suspend_dir = suspend_dir
        self._registry, self._sessions, self._slices, self._health = registry, sessions, slices, health
        self._tickets, self._phase, self._suspension = tickets, phase, suspension

    def ready(self) -> dict:
        """The runtime's topology and identity: what a client checks before it opens a session."""
        return {"topology": self.topology.to_wire(), "started": self.started, "runtime": self.runtime_id}

    def cluster_state(self) -> dict:
        """``cluster_state`` of this cluster."""
        return cluster_state(self._phase, self._health)

    def tenants(self) -> list[dict]:
        """Every tenant's public record, with its sessions and the devices its slices take now."""
        clients = self._sessions.listing().values()
        slices = self._slices.listing()
        out = []
        for t in self._registry.listing():
            t["clients"] = sum(1 for s in clients if s.tenant == t["name"])
            t["devices"] = sum(len(a.devices) for a in slices if a.tenant == t["name"])
            out.append(t)
        return out

    def state(self, tenant: str | None) -> dict:
        """The cluster as ``tenant`` may see it (its own slices, clients and losses by name; others as counts),
        or whole for the admin (``tenant`` None)."""
        def mine(t: str | None) -> bool:
            return tenant is None or t == tenant

        slices = self._slices.listing()
        allocs = [a for a in slices if mine(a.tenant)]
        others = [a for a in slices if not mine(a.tenant)]
        tenants = {t["name"]: t for t in self.tenants() if mine(t["name"])}
        unseen = {t["name"] for t in self._registry.listing() if not mine(t["name"])} if tenant is not None else set()
        restarts = [{**r, "lost": {t: v for t, v in r["lost"].items() if mine(t)}} for r in self._health.restarts()]
        phase, generation = self._phase.read()
        suspension = self._suspension
        return {
            "topology": self.topology.to_wire(), "started": self.started, "islands": self._health.public(),
            "allocations": [a.to_wire() for a in allocs],
            "others": {"slices": len(others), "devices": sum(len(a.devices) for a in others),
                       "tenants": len({a.tenant for a in others} | unseen)},
            "clients": {str(c): {"tenant": s.tenant, "pid": s.pid, "since": s.since, "job": s.job}
                        for c, s in self._sessions.listing().items() if mine(s.tenant)},
            "tenants": tenants, "restarts": restarts[-SHOWN:],
            "reclaimed": [r for r in self._sessions.reclaimed() if mine(r["tenant"])][-SHOWN:],
            "refusals": self._tickets.refusals()[-SHOWN:] if tenant is None else [],
            "cluster": {"state": phase, "generation": generation,
                        **({"suspended_to": suspension.directory, "last": suspension.last, "pid": os.getpid(),
                            "suspend_dir": self._suspend_dir} if tenant is None else {})},
        }
