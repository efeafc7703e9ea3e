"""``pw.status()``: a snapshot of the cluster as this client's tenant may see it (or the admin, whole).

The resource manager says what exists (islands, health, restarts, this
tenant's slices and clients; other tenants as counts); each host adds its
counters, which name no tenant; each island's scheduler adds this tenant's
share of its time, with everyone else's as one sum.
"""

from __future__ import annotations

from typing import Any

import ray

from client.session import current
from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
from pathways.topology import Topology

HOST_FIELDS = ("buffers", "buffer_bytes", "compiles", "cache_hits", "queue_depth", "completed", "busy_s",
               "busy_fraction", "bytes_in", "bytes_out", "peak_buffer_bytes")


def status(timeout: float = 10.0) -> ClusterStatus:
    """A snapshot of the cluster as this client's tenant may see it (``pw.init`` first).

    It names this tenant's own slices, clients and losses, and shows other tenants only as counts (the
    whole cluster is ``pathways status`` with the admin credential). ``print(pw.status())`` gives a
    readable summary.

    Args:
        timeout: seconds to wait for the hosts' and schedulers' counters; a host that does not answer in
            time is reported as not alive.

    Returns:
        A ``pw.ClusterStatus``: topology, islands with their health, hosts and counters, this tenant's
        slices and share of each island's time.

    Raises:
        PathwaysError: ``pw.init`` was not called, or the resource manager does not answer.
    """
    session = current()
    state = session.request("state", {})
    mac = session.sign("schedule_stats")
    schedules = [i.scheduler.schedule_stats.remote(session.client_id, mac) for i in session.islands]
    return snapshot(state, [i.hosts for i in session.islands], schedules, timeout)


def admin_status(admin: Any, timeout: float = 10.0) -> ClusterStatus:
    """The whole cluster, every tenant named (``admin``: a ``pw.Admin``)."""
    by_island = {s["island"]: s for s in admin.schedules()}
    state = admin.state()
    return snapshot(state, admin.hosts(), [by_island.get(i["index"], {}) for i in state["islands"]], timeout)


def snapshot(state: dict, hosts_by_island: list[list[Any]], schedules: list, timeout: float) -> ClusterStatus:
    """The typed snapshot from a resource manager's ``state``, every host's counters, and each island's
    scheduler counters (object refs to wait for, or dicts already read)."""
    stats_refs = [[h.stats.remote() for h in hosts] for hosts in hosts_by_island]
    pending = [r for refs in stats_refs for r in refs] + [s for s in schedules if isinstance(s, ray.ObjectRef)]
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
    ready = set(ready)

    def read(ref: Any) -> dict | None:
        if not isinstance(ref, ray.ObjectRef):
            return ref
        if ref not in ready:
            return None
        try:
            return ray.get(ref)
        except Exception:  # a dead host or scheduler is reported, not raised
            return None

    islands = []
    for isl, refs, sched_ref in zip(state["islands"], stats_refs, schedules):
        sched = read(sched_ref) or {}
        hosts = []
        for info, ref in zip(isl["hosts"], refs):
            stats = read(ref)
            hosts.append(HostStatus(island=info["island"], host=info["host"], node=info["node"],
                                    devices=info["devices"], alive=stats is not None, ip=info.get("ip", ""),
                                    data=info.get("data", ""),
                                    **{f: (stats or {})[f] for f in HOST_FIELDS if f in (stats or {})}))
        depth = sched.get("queued", 0) + max((h.queue_depth for h in hosts), default=0)
        restarts = [r for r in state.get("restarts", []) if r["island"] == isl["index"]]
        islands.append(IslandStatus(isl["index"], isl["healthy"], isl["reason"], hosts, depth,
                                    sched.get("tenant_time_s", {}), sched.get("tenant_time_recent_s", {}),
                                    sched.get("others_time_s", 0.0), sched.get("others_time_recent_s", 0.0),
                                    isl.get("epoch", 0), restarts))
    return ClusterStatus(Topology.from_wire(state["topology"]), islands, state["allocations"], state["clients"],
                         state.get("tenants", {}), state.get("reclaimed", []), state.get("others", {}))
