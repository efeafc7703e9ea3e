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
    busy_fraction: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    peak_buffer_bytes: int = 0
    ip: str = ""
    data: str = ""  # the host's data server (ip:port) for peers on other nodes; "" when it runs none


@dataclass(frozen=True)
class IslandStatus:
    index: int
    healthy: bool
    reason: str
    hosts: list[HostStatus]
    queue_depth: int = 0  # fragments queued at the scheduler plus those running on the hosts
    tenant_time_s: dict[str, float] = field(default_factory=dict)  # island time each tenant received
    tenant_recent_s: dict[str, float] = field(default_factory=dict)  # the same over the last 10 s

    @property
    def tenant_share(self) -> dict[str, float]:
        """Each tenant's share of the island time since the cluster started."""
        return _shares(self.tenant_time_s)

    @property
    def recent_share(self) -> dict[str, float]:
        """Each tenant's share of the island time over the last 10 s (what the weights steer now)."""
        return _shares(self.tenant_recent_s)


def _shares(times: dict[str, float]) -> dict[str, float]:
    total = sum(times.values())
    return {t: v / total for t, v in times.items()} if total else {}


@dataclass(frozen=True)
class ClusterStatus:
    topology: Topology
    islands: list[IslandStatus]
    allocations: list[dict]
    clients: dict[str, dict] = field(default_factory=dict)
    tenants: dict[str, dict] = field(default_factory=dict)
    reclaimed: list[dict] = field(default_factory=list)

    def host(self, island: int, host: int = 0) -> HostStatus:
        return self.islands[island].hosts[host]

    def __str__(self) -> str:
        lines = [f"topology: {self.topology}"]
        for isl in self.islands:
            health = "healthy" if isl.healthy else f"UNHEALTHY ({isl.reason})"
            shares = ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(isl.tenant_share.items()))
            recent = ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(isl.recent_share.items()))
            lines.append(f"island {isl.index}: {health}, queue depth {isl.queue_depth}"
                         + (f", island time (last 10 s): {recent}" if recent else "")
                         + (f", (since start): {shares}" if shares else ""))
            for h in isl.hosts:
                lines.append(f"  host {h.host} on node {h.node[:8]} ({h.ip}) devices {len(h.devices)} "
                             f"busy {100 * h.busy_fraction:.0f}% queue {h.queue_depth} done {h.completed} "
                             f"buffers {h.buffers} ({_bytes(h.buffer_bytes)}) in {_bytes(h.bytes_in)} "
                             f"out {_bytes(h.bytes_out)} compiles {h.compiles} cache hits {h.cache_hits}"
                             + ("" if h.alive else " DEAD"))
        by_tenant: dict[str, list[str]] = {}
        for a in self.allocations:
            by_tenant.setdefault(a["tenant"], []).append(f"{a['key']}{tuple(a['shape'])}@island{a['island']}")
        for tenant in sorted(set(by_tenant) | set(self.tenants)):
            info = self.tenants.get(tenant, {})
            quota = info.get("quota")
            lines.append(f"tenant {tenant} (weight {info.get('weight', 1.0):g}, quota "
                         f"{'none' if quota is None else quota}, clients {info.get('clients', 0)}): "
                         f"{', '.join(by_tenant.get(tenant, [])) or 'no slices'}")
        return "\n".join(lines)


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def status(timeout: float = 10.0) -> ClusterStatus:
    """A snapshot of the cluster this process is attached to (pw.init first)."""
    from client.session import current

    session = current()
    state = session.rm_call("state", "reply", {"ok": True, "value": None})
    islands = []
    for isl, client in zip(state["islands"], session.islands):
        refs = [h.stats.remote() for h in client.hosts]
        sched_ref = client.scheduler.schedule_stats.remote()
        ready, _ = ray.wait(refs + [sched_ref], num_returns=len(refs) + 1, timeout=timeout)
        try:
            sched = ray.get(sched_ref) if sched_ref in ready else {}
        except Exception:  # a dead scheduler: the island is reported, not raised
            sched = {}
        hosts = []
        for info, ref in zip(isl["hosts"], refs):
            stats: dict = {}
            alive = ref in ready
            if alive:
                try:
                    stats = ray.get(ref)
                except Exception:  # a dead host is reported, not raised
                    alive = False
            keys = ("buffers", "buffer_bytes", "compiles", "cache_hits", "queue_depth", "completed", "busy_s",
                    "busy_fraction", "bytes_in", "bytes_out", "peak_buffer_bytes")
            hosts.append(HostStatus(island=info["island"], host=info["host"], node=info["node"],
                                    devices=info["devices"], alive=alive, ip=info.get("ip", ""),
                                    data=info.get("data", ""),
                                    **{k: stats[k] for k in keys if k in stats}))
        depth = sched.get("queued", 0) + max((h.queue_depth for h in hosts), default=0)
        islands.append(IslandStatus(isl["index"], isl["healthy"], isl["reason"], hosts, depth,
                                    sched.get("tenant_time_s", {}), sched.get("tenant_time_recent_s", {})))
    return ClusterStatus(Topology.from_wire(state["topology"]), islands, state["allocations"], state["clients"],
                         state.get("tenants", {}), state.get("reclaimed", []))
