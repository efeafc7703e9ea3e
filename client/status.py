"""``pw.status()``: a snapshot of the cluster as this client's tenant may see it (or the admin, whole).

The resource manager says what exists (islands, health, restarts, this
tenant's slices and clients; other tenants as counts); each host adds its
counters, which name no tenant; each island's scheduler adds this tenant's
share of its time, with everyone else's as one sum.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from client.session import current
from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
from pathways.requests import HostStats, ScheduleStats, State
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
    state = session.request(lambda rid: State(rid), "pw.status")
    hosts = [[session.ask(i.index, h, lambda rid: HostStats(rid)) for h in range(len(i.hosts))]
             for i in session.islands]
    schedules = [session.ask(i.index, 0, lambda rid: ScheduleStats(rid)) for i in session.islands]
    return snapshot(state, [[_read(f, timeout) for f in row] for row in hosts], [_read(f, timeout) for f in schedules])


def admin_status(admin: Any) -> ClusterStatus:
    """The whole cluster, every tenant named (``admin``: a ``pw.Admin``). A suspended cluster's hosts are
    stopped: they are shown as not alive."""
    state = admin.state()
    if state["cluster"]["state"] != "running":
        return snapshot(state, [[None] * len(i["hosts"]) for i in state["islands"]], [None] * len(state["islands"]))
    by_island = {s["island"]: s for s in admin.schedules()}
    return snapshot(state, admin.host_stats(), [by_island.get(i["index"]) for i in state["islands"]])


def _read(future: Future, timeout: float) -> dict | None:
    try:
        return future.result(timeout=timeout)
    except Exception:  # a dead or slow host is reported as not alive, not raised
        return None


def snapshot(state: dict, host_stats: list[list[dict | None]], schedules: list[dict | None]) -> ClusterStatus:
    """The typed snapshot from a resource manager's ``state``, every host's counters (None: it did not answer),
    and each island's scheduler counters."""
    islands = []
    for isl, stats_row, sched in zip(state["islands"], host_stats, schedules):
        sched = sched or {}
        hosts = []
        for info, stats in zip(isl["hosts"], stats_row):
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
                         state.get("tenants", {}), state.get("reclaimed", []), state.get("others", {}),
                         state.get("cluster", {}))
