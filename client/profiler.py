"""``pw.trace(path)``: record what every host and the client do, into one Chrome trace / Perfetto file.

Each island is a process in the trace and each host a thread, so the same
fragment order on every host of an island (gang scheduling) is visible at a
glance. Host clocks are corrected by the offset measured NTP-style (ping the
host, take its clock at the round trip's midpoint) before the events are merged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from client.session import Session, current

CLIENT_PID = 1


def clock_offsets(session: Session, rounds: int = 5) -> dict[tuple[int, int], float]:
    """Seconds to subtract from each host's wall clock to put it on the client's (best of ``rounds``)."""
    offsets: dict[tuple[int, int], float] = {}
    for island in session.islands:
        for h, host in enumerate(island.hosts):
            best = None
            for _ in range(rounds):
                t0 = time.time()
                remote = ray.get(host.ping.remote(), timeout=session.timeouts.poll * 10)
                t1 = time.time()
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, remote - (t0 + t1) / 2)
            offsets[(island.index, h)] = best[1]
    return offsets


def chrome_events(raw: list, pid: int, tid: int, offset: float) -> list[dict]:
    """Recorded events as Chrome trace "complete" events of process ``pid`` and thread ``tid``, with the host
    clock's ``offset`` (seconds) removed."""
    return [{"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": (start - offset) * 1e6,
             "dur": max(dur, 0.0) * 1e6, "args": args} for name, cat, start, dur, args in raw]


@contextmanager
def trace(path: str | os.PathLike) -> Iterator[None]:
    """Record every island's hosts and this client while the block runs; write a trace file at ``path``.

        with pw.trace("step.json"):
            step(params, batch)

    Open the file in https://ui.perfetto.dev (or chrome://tracing): each island is a process, each host a
    thread, and the client (tracing, lowering, dispatch) a process of its own; host clocks are aligned to
    the client's. Spans of other tenants that shared the islands meanwhile appear as anonymous "another
    tenant" spans. Islands this client saw fail are left out.

    Args:
        path: where to write the Chrome trace (JSON), when the block ends (also when it raises).
    """
    session = current()
    hosts = [(isl.index, h, host) for isl in session.islands if isl.index not in session.dead
             for h, host in enumerate(isl.hosts)]
    offsets = clock_offsets(session)
    start_mac, stop_mac = session.sign("trace_start"), session.sign("trace_stop")
    ray.get([host.trace_start.remote(session.client_id, start_mac) for _, _, host in hosts],
            timeout=session.timeouts.poll * 10)
    token = session.events.start()
    try:
        yield
    finally:
        client_events = session.events.stop(token)
        recorded = ray.get([host.trace_stop.remote(session.client_id, stop_mac) for _, _, host in hosts],
                           timeout=session.timeouts.fetch)
        write_trace(path, session, hosts, recorded, client_events, offsets)


def write_trace(path: Any, session: Session, hosts: list, recorded: list, client_events: list,
                offsets: dict) -> None:
    """Write the client's and every host's events to ``path`` as one Chrome trace (JSON): one process per
    island, one thread per host, and the client as its own process."""
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": CLIENT_PID, "args": {"name": f"client ({session.tenant})"}},
        {"name": "thread_name", "ph": "M", "pid": CLIENT_PID, "tid": 0, "args": {"name": "trace / lower / dispatch"}},
    ]
    events += chrome_events(client_events, CLIENT_PID, 0, 0.0)
    for (island, h, _), raw in zip(hosts, recorded):
        pid = 100 + island
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"island {island}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": h, "args": {"name": f"host {h}"}})
        events += chrome_events(raw, pid, h, offsets[(island, h)])
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "metadata": {"clock_offsets_s": {f"{i}/{h}": o for (i, h), o in offsets.items()}}}, f)
