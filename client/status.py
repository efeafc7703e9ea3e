"""``pw.status()``: a snapshot of the cluster as this client's tenant may see it.

The resource manager says what exists (islands, health, restarts, this
tenant's slices and clients; other tenants as counts); each host adds its
counters, which name no tenant; each island's scheduler adds this tenant's
share of its time, with everyone else's as one sum.
"""

from __future__ import annotations

import ray

from client.session import Session, current
from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
from pathways.topology import Topology

HOST_FIELDS = ("buffers", "buffer_bytes", "compiles", "cache_hits", "queue_depth", "completed", "busy_s",
               "busy_fraction", "bytes_in", "bytes_out", "peak_buffer_bytes")


def status(timeout: float = 10.0) -> ClusterStatus:
    """A snapshot of the cluster this process is attached to (``pw.init`` first); waits at most ``timeout``
    seconds for the hosts' counters (a host that does not answer is reported as not alive)."""
    session = current()
    state = session.request("state", {})
    return snapshot(session, state, timeout)


def snapshot(session: Session, state: dict, timeout: float, schedules: list[dict] | None = None) -> ClusterStatus:
    """The typed snapshot from a resource manager's ``state`` plus every host's counters (``schedules``: the
    admin's per-tenant island times, else this tenant's)."""
    islands = []
    for k, (isl, client) in enumerate(zip(state["islands"], session.islands)):
        refs = [h.stats.remote() for h in client.hosts]
        if schedules is None:
            sched_ref = client.scheduler.schedule_stats.remote(session.client_id, session.sign("schedule_stats"))
        else:
            sched_ref = None
        ready, _ = ray.wait(refs + ([sched_ref] if sched_ref else []), num_returns=len(refs) + bool(sched_ref),
                            timeout=timeout)
        sched: dict = {}
        if schedules is not None:
            sched = next((s for s in schedules if s.get("island") == k), {})
        elif sched_ref in ready:
            try:
                sched = ray.get(sched_ref)
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
            hosts.append(HostStatus(island=info["island"], host=info["host"], node=info["node"],
                                    devices=info["devices"], alive=alive, ip=info.get("ip", ""),
                                    **{f: stats[f] for f in HOST_FIELDS if f in stats}))
        queued = sched.get("queued", 0)
        depth = queued + max((h.queue_depth for h in hosts), default=0)
        restarts = [r for r in state.get("restarts", []) if r["island"] == isl["index"]]
        islands.append(IslandStatus(isl["index"], isl["healthy"], isl["reason"], hosts, depth,
                                    sched.get("tenant_time_s", {}), sched.get("tenant_time_recent_s", {}),
                                    sched.get("others_time_s", 0.0), sched.get("others_time_recent_s", 0.0),
                                    isl.get("epoch", 0), restarts))
    return ClusterStatus(Topology.from_wire(state["topology"]), islands, state["allocations"], state["clients"],
                         state.get("tenants", {}), state.get("reclaimed", []), state.get("others", {}))
