"""The ``pathways`` command's tables, and the cluster's status as tables (the admin's view or one tenant's)."""

from __future__ import annotations

import time
from typing import Any


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Rows under headers, each column as wide as its widest cell."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def clock(t: float | None) -> str:
    """A wall-clock time as local 'YYYY-mm-dd HH:MM:SS', or '-' for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def short(s: str, n: int) -> str:
    """``s`` cut to at most ``n`` characters, ending in '...' when cut."""
    return s if len(s) <= n else s[: n - 3] + "..."


def render_status(st: Any, address: str, refusals: list[dict] | None = None) -> str:
    """Islands, hosts, tenants as tables: every tenant by name in the admin's view (``refusals`` given), else
    the tenant's own with everyone else as counts."""
    from pathways.cluster import format_bytes

    view = "whole cluster (admin)" if refusals is not None else "your tenant's view"
    phase = "" if st.state == "running" else f"; {st.state.upper()}" + (
        f" into {st.cluster['suspended_to']} (`pathways resume` restores it)" if st.cluster.get("suspended_to") else "")
    out = [f"cluster {address}: {st.topology}; {view}{phase}", ""]
    rows = []
    for isl in st.islands:
        times = dict(isl.tenant_time_s)
        if isl.others_time_s:
            times["(others)"] = isl.others_time_s
        total = sum(times.values())
        share = ", ".join(f"{t} {100 * s / total:.0f}% ({s:.1f}s)" for t, s in sorted(times.items())) if total else "-"
        alive = sum(h.alive for h in isl.hosts)
        rows.append([isl.index, "healthy" if isl.healthy else f"FAILED: {isl.reason}", f"{alive}/{len(isl.hosts)}",
                     sum(len(h.devices) for h in isl.hosts), isl.queue_depth, share])
    out += [table(["ISLAND", "HEALTH", "HOSTS", "DEVICES", "QUEUE", "SHARE OF ISLAND TIME"], rows), ""]
    rows = [[f"{isl.index}/{h.host}", h.node[:12], len(h.devices), "yes" if h.alive else "NO",
             f"{h.buffers} ({format_bytes(h.buffer_bytes)})", h.compiles, h.cache_hits, h.queue_depth, h.completed,
             f"{h.busy_s:.1f}s ({100 * h.busy_fraction:.0f}%)"]
            for isl in st.islands for h in isl.hosts]
    out += [table(["HOST", "NODE", "DEVICES", "ALIVE", "BUFFERS", "COMPILES", "HITS", "QUEUE", "DONE", "BUSY"],
                  rows), ""]
    slices: dict[str, list[str]] = {}
    for a in st.allocations:
        slices.setdefault(a["tenant"], []).append(f"{a['key']}{tuple(a['shape'])}@island{a['island']}")
    rows = [[name, f"{info['weight']:g}", "-" if info.get("quota") is None else info["quota"], info["clients"],
             info["devices"], ", ".join(slices.get(name, [])) or "-"] for name, info in sorted(st.tenants.items())]
    out.append(table(["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES", "SLICES"], rows) if rows else "no tenants")
    if refusals is None and st.others.get("tenants"):
        out.append(f"other tenants: {st.others['tenants']}, holding {st.others.get('slices', 0)} slices "
                   f"({st.others.get('devices', 0)} devices)")
    for r in refusals or []:
        out.append(f"refused at {clock(r['at'])}: a second use of the ticket of job {r['job']}"
                   + (f" (presented by job {r['by_job']})" if r.get("by_job") else ""))
    return "\n".join(out)
