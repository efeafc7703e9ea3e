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

from client.session import Session, current
from pathways.requests import Ping, TraceStart, TraceStop

CLIENT_PID = 1


def clock_offsets(session: Session, hosts: list[tuple[int, int]], rounds: int = 5) -> dict[tuple[int, int], float]:
    """Seconds to subtract from each host's wall clock to put it on the client's (best of ``rounds``)."""
    offsets: dict[tuple[int, int], float] = {}
    for island, h in hosts:
        best = None
        for _ in range(rounds):
            t0 = time.time()
            remote = session.ask(island, h, lambda rid: Ping(rid)).result(timeout=session.timeouts.poll * 10)
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, remote - (t0 + t1) / 2)
        offsets[(island, h)] = best[1]
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
    hosts = [(isl.index, h) for isl in session.islands if isl.index not in session.islands.dead
             for h in range(len(isl.hosts))]
    offsets = clock_offsets(session, hosts)
    session.wait([session.ask(i, h, lambda rid: TraceStart(rid)) for i, h in hosts],
                 frozenset(i for i, _ in hosts), session.timeouts.poll * 10, "starting a trace")
    token = session.events.start()
    try:
        yield
    finally:
        client_events = session.events.stop(token)
        recorded = session.wait([session.ask(i, h, lambda rid: TraceStop(rid)) for i, h in hosts],
                                frozenset(i for i, _ in hosts), session.timeouts.fetch, "collecting a trace")
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
    for (island, h), raw in zip(hosts, recorded):
        pid = 100 + island
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"island {island}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": h, "args": {"name": f"host {h}"}})
        events += chrome_events(raw, pid, h, offsets[(island, h)])
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "metadata": {"clock_offsets_s": {f"{i}/{h}": o for (i, h), o in offsets.items()}}}, f)
