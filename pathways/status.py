"""Cluster state as one typed snapshot: islands, hosts, health, allocations, per-host counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from pathways.topology import Topology


@dataclass(frozen=True)
class HostStatus:
    island: int
    host: int
    node: str
    devices: list[str]
    alive: bool
    buffers: int = 0
    buffer_bytes: int = 0
    compiles: int = 0
    cache_hits: int = 0
    queue_depth: int = 0
    completed: int = 0
    busy_s: float = 0.0


@dataclass(frozen=True)
class IslandStatus:
    index: int
    healthy: bool
    reason: str
    hosts: list[HostStatus]


@dataclass(frozen=True)
class ClusterStatus:
    topology: Topology
    islands: list[IslandStatus]
    allocations: list[dict]
    clients: dict[str, dict] = field(default_factory=dict)

    def host(self, island: int, host: int = 0) -> HostStatus:
        return self.islands[island].hosts[host]

    def __str__(self) -> str:
        lines = [f"topology: {self.topology}"]
        for isl in self.islands:
            health = "healthy" if isl.healthy else f"UNHEALTHY ({isl.reason})"
            lines.append(f"island {isl.index}: {health}")
            for h in isl.hosts:
                lines.append(f"  host {h.host} node {h.node[:12]} devices {len(h.devices)} "
                             f"buffers {h.buffers} ({h.buffer_bytes} B) compiles {h.compiles} "
                             f"hits {h.cache_hits} queue {h.queue_depth} done {h.completed}"
                             + ("" if h.alive else " DEAD"))
        by_tenant: dict[str, list[str]] = {}
        for a in self.allocations:
            by_tenant.setdefault(a["tenant"], []).append(f"{a['key']}{tuple(a['shape'])}@island{a['island']}")
        for tenant, slices in sorted(by_tenant.items()):
            lines.append(f"tenant {tenant}: {', '.join(slices)}")
        return "\n".join(lines)


def status(timeout: float = 10.0) -> ClusterStatus:
    """A snapshot of the cluster this process is attached to (pw.init first)."""
    from client.session import current

    session = current()
    state = session.rm_call("state", "reply", {"ok": True, "value": None})
    islands = []
    for isl, client in zip(state["islands"], session.islands):
        refs = [h.stats.remote() for h in client.hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        hosts = []
        for info, ref in zip(isl["hosts"], refs):
            stats: dict = {}
            alive = ref in ready
            if alive:
                try:
                    stats = ray.get(ref)
                except Exception:  # a dead host is reported, not raised
                    alive = False
            hosts.append(HostStatus(island=info["island"], host=info["host"], node=info["node"],
                                    devices=info["devices"], alive=alive,
                                    **{k: stats[k] for k in ("buffers", "buffer_bytes", "compiles", "cache_hits",
                                                             "queue_depth", "completed", "busy_s") if k in stats}))
        islands.append(IslandStatus(isl["index"], isl["healthy"], isl["reason"], hosts))
    return ClusterStatus(Topology.from_wire(state["topology"]), islands, state["allocations"], state["clients"])
