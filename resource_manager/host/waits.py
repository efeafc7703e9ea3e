"""The waits of a host's runs: how long the executor's loop may sleep before one times out, and what a stuck
client is told about them. No state: the executor passes its runs (read under its lock)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from resource_manager.host.handlers import Handler
from resource_manager.host.run import Run


def next_deadline(runs: Iterable[Run], op_timeout: float, until_expiry: float) -> float:
    """Seconds the loop may sleep: at most 1 s and ``until_expiry`` (the receiver's), and not past the moment the
    longest-waiting run's op times out (at least 1 ms)."""
    waits = [r.waiting_since for r in runs if r.waiting_since is not None]
    if not waits:
        return min(1.0, until_expiry)
    return max(0.001, min(1.0, until_expiry, min(waits) + op_timeout - time.monotonic()))


def stalled(runs: Iterable[Run], by_op: dict[type, Handler]) -> list[dict]:
    """What each unfinished run of ``runs`` waits for (its handler says what is missing), and since when."""
    out = []
    for run in runs:
        if run.pc >= run.end:
            continue
        op = run.ops[run.pc]
        missing = by_op[type(op)].missing(run, op)
        since = run.waiting_since
        out.append({"seq": run.seq, "program": run.label, "op": run.pc, "kind": op.KIND, "name": op.label(),
                    "missing": missing, "parked": run.parked,
                    "waiting_s": 0.0 if since is None else round(time.monotonic() - since, 3)})
    return out
