"""Waiting for the islands' answers: results as they come, an island's failure as soon as it is known, and a
timeout that says where the unfinished work stopped.

The hosts enforce a wait's timeout themselves (they answer ``FETCH_TIMED_OUT``); this side allows
``RPC_GRACE_S`` more for the answer to travel, and checks the islands' health every poll interval meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_all

from client.link import LinkClosed
from pathways.errors import ClusterSuspendedError, IslandFailedError
from pathways.names import FETCH_TIMED_OUT

RPC_GRACE_S = 5.0  # a host's answer may take this long beyond the wait it enforces
SHOWN = 8  # stalled runs a timeout's message names


def results(futures: list[Future], timeout: float, poll: float, what: str, check: Callable[[], None],
            timed_out: Callable[[], Exception]) -> list:
    """The futures' results, in order. Every ``poll`` seconds while some are pending, ``check()`` raises if an
    island they depend on failed; after ``timeout`` (plus ``RPC_GRACE_S``), or when a host says its own wait
    timed out, ``timed_out()`` is raised. A broken link raises IslandFailedError (after ``check()``, which says
    why where it knows); any other error of a future is raised as it is."""
    deadline = time.monotonic() + timeout + RPC_GRACE_S
    pending = set(futures)
    while pending:
        remaining = deadline - time.monotonic()
        done, pending = wait_all(pending, timeout=max(0.0, min(poll, remaining)), return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            break
        if pending and time.monotonic() >= deadline:
            raise timed_out()
        if pending:
            check()
    out = []
    for future in futures:
        if not future.done():
            continue
        exc = future.exception()
        if isinstance(exc, (LinkClosed, ClusterSuspendedError)):
            check()
            raise IslandFailedError(f"{what} failed: {exc}") from None
        if exc is not None:
            raise exc.with_traceback(None)
        value = future.result()
        if isinstance(value, str) and value == FETCH_TIMED_OUT:
            raise timed_out()
        out.append(value)
    return out


def timed_out(what: str, timeout: float, islands: frozenset[int], reports: list[Future],
              poll: float) -> IslandFailedError:
    """The timeout error, saying where this tenant's unfinished fragments on ``islands`` stopped: ``reports``
    are the hosts' answers to ``Stalled`` (each awaited at most ``poll`` seconds; a host that does not answer
    is left out: the health check speaks of it, not this message)."""
    lines = []
    for future in reports:
        try:
            report = future.result(timeout=poll)
        except Exception:  # the host is gone or slow
            continue
        lines.extend(stalled_lines(report))
    detail = "; ".join(lines[:SHOWN]) + (f"; and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")
    return IslandFailedError(f"{what} timed out after {timeout:.1f}s; islands {sorted(islands)} are alive but "
                             f"did not produce it (overloaded or stuck)" + (f": {detail}" if detail else ""))


def stalled_lines(report: dict) -> list[str]:
    """One host's ``Stalled`` answer in words: where each unfinished program stands, and what waits in order."""
    where = f"island {report['island']} host {report['host']}"
    lines = []
    for run in report["runs"]:
        missing = run["missing"]
        waits = (f"waits for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                 if missing else "is running")
        op = run["kind"] if run["name"] == run["kind"] else f"{run['kind']} {run['name']}"
        lines.append(f"{where}: program {run['program']!r} (sequence {run['seq']}) at op {run['op']} ({op}) {waits}")
    if report["held"]:
        lines.append(f"{where}: {report['held']} messages wait for an earlier one to arrive")
    return lines
