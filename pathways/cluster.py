"""Cluster state as one typed snapshot: islands, hosts, health, allocations, per-host counters.

A tenant's snapshot names only its own slices, clients and losses; the rest
of the cluster appears as counts. The admin's names everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pathways.topology import Topology


@dataclass(frozen=True)
class HostStatus:
    """One island host: where it runs, whether it answered, and its counters (buffers, compiles, work, traffic).

    ``busy_s`` is the total time the host spent executing ops, ``busy_fraction`` its share of the last few
    seconds; ``bytes_in``/``bytes_out`` count what it received from and sent to other islands' hosts. Counters
    name no tenant.
    """

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
    busy_fraction: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    peak_buffer_bytes: int = 0
    ip: str = ""
    data: str = ""  # the host's network data server (ip:port) for peers on other nodes; "" when it runs none


@dataclass(frozen=True)
class IslandStatus:
    """One island: its health, its hosts, its queue, how its time was shared between tenants, and its restarts."""

    index: int
    healthy: bool
    reason: str
    hosts: list[HostStatus]
    queue_depth: int = 0  # fragments queued at the scheduler plus those running on the hosts
    tenant_time_s: dict[str, float] = field(default_factory=dict)  # island time each (named) tenant received
    tenant_recent_s: dict[str, float] = field(default_factory=dict)  # the same over the last 10 s
    others_time_s: float = 0.0  # island time of the tenants this snapshot does not name
    others_recent_s: float = 0.0
    epoch: int = 0  # how many times the island restarted
    restarts: list[dict] = field(default_factory=list)  # when, why, and what of yours was lost

    @property
    def tenant_share(self) -> dict[str, float]:
        """Each named tenant's share of the island time since the cluster started."""
        return _shares(self.tenant_time_s, self.others_time_s)

    @property
    def recent_share(self) -> dict[str, float]:
        """Each named tenant's share of the island time over the last 10 s (what the weights steer now)."""
        return _shares(self.tenant_recent_s, self.others_recent_s)


def _shares(times: dict[str, float], others: float = 0.0) -> dict[str, float]:
    total = sum(times.values()) + others
    return {t: v / total for t, v in times.items()} if total else {}


@dataclass(frozen=True)
class ClusterStatus:
    """What ``pw.status()`` returns: the topology, each island's status, the slices allocated, and the tenants.

    A tenant's snapshot names only its own slices (``allocations``), clients, tenant record and losses, with the
    rest in ``others`` as counts; the admin's names everything. ``str()`` gives a readable summary.
    """

    topology: Topology
    islands: list[IslandStatus]
    allocations: list[dict]
    clients: dict[str, dict] = field(default_factory=dict)
    tenants: dict[str, dict] = field(default_factory=dict)
    reclaimed: list[dict] = field(default_factory=list)
    others: dict = field(default_factory=dict)  # other tenants' slices and devices, as counts
    cluster: dict = field(default_factory=dict)  # state ("running", "suspending", "suspended", "resuming")

    @property
    def state(self) -> str:
        """Whether the cluster runs, or is suspended by its admin (or on the way)."""
        return self.cluster.get("state", "running")

    def host(self, island: int, host: int = 0) -> HostStatus:
        """The status of host ``host`` of island ``island``."""
        return self.islands[island].hosts[host]

    def __str__(self) -> str:
        lines = [f"topology: {self.topology}" + ("" if self.state == "running" else f"; cluster {self.state.upper()}"
                                                  + (f" into {self.cluster['suspended_to']}"
                                                     if self.cluster.get("suspended_to") else ""))]
        for isl in self.islands:
            health = "healthy" if isl.healthy else f"UNHEALTHY ({isl.reason})"
            shares = ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(isl.tenant_share.items()))
            recent = ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(isl.recent_share.items()))
            if isl.epoch:
                health += f", restarted {isl.epoch} time(s)"
            lines.append(f"island {isl.index}: {health}, queue depth {isl.queue_depth}"
                         + (f", island time (last 10 s): {recent}" if recent else "")
                         + (f", (since start): {shares}" if shares else ""))
            for h in isl.hosts:
                lines.append(f"  host {h.host} on node {h.node[:8]} ({h.ip}) devices {len(h.devices)} "
                             f"busy {100 * h.busy_fraction:.0f}% queue {h.queue_depth} done {h.completed} "
                             f"buffers {h.buffers} ({format_bytes(h.buffer_bytes)}) in {format_bytes(h.bytes_in)} "
                             f"out {format_bytes(h.bytes_out)} compiles {h.compiles} cache hits {h.cache_hits}"
                             + ("" if h.alive else " DEAD"))
            for r in isl.restarts:
                lost = ", ".join(f"{t}: {n} buffers ({format_bytes(b)})"
                                 for t, (n, b) in r["lost"].items()) or "nothing"
                lines.append(f"  restarted at {time.strftime('%H:%M:%S', time.localtime(r['at']))} after: "
                             f"{r['reason']}; lost: {lost}")
        by_tenant: dict[str, list[str]] = {}
        for a in self.allocations:
            by_tenant.setdefault(a["tenant"], []).append(f"{a['key']}{tuple(a['shape'])}@island{a['island']}")
        for tenant in sorted(set(by_tenant) | set(self.tenants)):
            info = self.tenants.get(tenant, {})
            quota = info.get("quota")
            lines.append(f"tenant {tenant} (weight {info.get('weight', 1.0):g}, quota "
                         f"{'none' if quota is None else quota}, clients {info.get('clients', 0)}): "
                         f"{', '.join(by_tenant.get(tenant, [])) or 'no slices'}")
        if self.others.get("slices"):
            lines.append(f"other tenants: {self.others['slices']} slices, {self.others['devices']} devices")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """A byte count for people: B, KiB, MiB or GiB."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
