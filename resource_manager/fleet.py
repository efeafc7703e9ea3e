"""The islands as started, and what the resource manager sends their hosts: orders and calls signed with the
runtime key for the one host each goes to.

An order (``pathways.messages.CONTROL``) is numbered once, and a host refuses a number it has seen, so a recorded
order cannot be played again. An island is replaced whole: after a failure (a new epoch) or when a suspended cluster
resumes (the epoch it had); every host then learns the new peer table.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import ray

from pathways import auth
from pathways.errors import PathwaysError
from pathways.messages import PeerTable
from pathways.topology import Topology
from resource_manager.island import Island, restart_island, start_islands, stop_island

ORDER_TIMEOUT = 10.0  # how long an order waits for a host to take it
Host = tuple[int, int, Any]  # (island, host, actor)
log = logging.getLogger(__name__)


class Fleet:
    """Every island's hosts and the runtime key. Its lock guards the island list; it calls no other part."""

    def __init__(self, topology: Topology, runtime_key: bytes, runtime_id: str, op_timeout: float,
                 gap_timeout: float, start_timeout: float) -> None:
        self.topology = topology
        self.runtime_id = runtime_id
        self._key = runtime_key
        self._timeouts = (op_timeout, gap_timeout)
        self._lock = threading.Lock()
        self._orders = itertools.count(1)  # next() is atomic: numbers are never shared
        self._islands = start_islands(topology, runtime_key, runtime_id, op_timeout, gap_timeout, start_timeout)
        self.tell_peers(self._islands)

    # -- the islands --------------------------------------------------------------------------------------
    def islands(self) -> list[Island]:
        """Every island as it runs now, by index."""
        with self._lock:
            return list(self._islands)

    def island(self, index: int) -> Island:
        """Island ``index`` as it runs now."""
        with self._lock:
            return self._islands[index]

    def restart(self, island: Island, timeout: float, epoch: int | None = None) -> Island:
        """New hosts for ``island`` (its old ones stopped), at the next epoch or at ``epoch``; not yet in service
        (``install``). Slow: it waits for the hosts to start."""
        return restart_island(self.topology, island, self._key, self.runtime_id, *self._timeouts, timeout,
                              epoch=epoch)

    def install(self, new: Island) -> None:
        """``new`` replaces the island of its index."""
        with self._lock:
            self._islands[new.index] = new

    def replace_all(self, islands: list[Island]) -> None:
        """New hosts for every island (a resume); every host learns the peer table."""
        with self._lock:
            self._islands = list(islands)
        self.tell_peers(islands)

    def stop_all(self) -> None:
        """Stop every island's hosts (what they held is gone with them)."""
        for island in self.islands():
            stop_island(island)

    # -- what the hosts are sent --------------------------------------------------------------------------
    @staticmethod
    def hosts(islands: list[Island]) -> list[Host]:
        """Every host of ``islands``, as (island, host, actor)."""
        return [(i.index, k, h) for i in islands for k, h in enumerate(i.hosts)]

    def sign(self, island: int, host: int, purpose: str, *parts: Any) -> bytes:
        """The runtime key's MAC for a call to host ``host`` of ``island``."""
        return auth.sign(self._key, purpose, island, host, *parts)

    def order(self, hosts: list[Host], order: Any, handles: list | None = None, wait: bool = True) -> None:
        """Send ``order`` to each host, signed for that host, numbered once; with ``wait``, until each took it (a
        dying host is the health check's to report)."""
        payload, seq = order.encode(), next(self._orders)
        refs = [h.control.remote(payload, seq, auth.sign(self._key, "control", i, k, seq, payload), handles)
                for i, k, h in hosts]
        if not wait:
            return
        for ref in refs:
            try:
                ray.get(ref, timeout=ORDER_TIMEOUT)
            except Exception as exc:  # a dying host is the health check's to report
                log.warning("a host did not take %s: %s", type(order).__name__, exc)

    def tell_peers(self, islands: list[Island]) -> None:
        """Send the hosts of ``islands`` every host of the runtime: who a host may talk to, and how."""
        everyone = self.islands()
        hosts = [{"island": h["island"], "host": h["host"], "node": h["node"], "pid": h["pid"],
                  "channel": h["channel"], "data": h["data"]} for i in everyone for h in i.host_info]
        self.order(self.hosts(islands), PeerTable(hosts), [h for i in everyone for h in i.hosts])

    def call(self, method: str, args: Any, timeout: float, tolerate: bool = False) -> list:
        """``method`` on every host (``args(island, host)`` its arguments, signed for that host); the results in
        order, the first failure raised naming the host (left out with ``tolerate``)."""
        calls = []
        for island in self.islands():
            for k, actor in enumerate(island.hosts):
                a = args(island.index, k)
                calls.append((island.index, k, getattr(actor, method).remote(
                    self.sign(island.index, k, method, *a), *a)))
        return call_all(calls, timeout, tolerate)


def call_all(calls: list[tuple[int, int, Any]], timeout: float, tolerate: bool = False) -> list:
    """The results of (island, host, object ref) calls, in order; the first failure raised (naming the host),
    or left out with ``tolerate``."""
    out = []
    deadline = time.monotonic() + timeout
    for island, host, ref in calls:
        try:
            out.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except Exception as exc:
            if tolerate:
                continue
            cause = getattr(exc, "cause", None)
            detail = str(cause) if isinstance(cause, PathwaysError) else f"{type(exc).__name__}: {exc}"
            raise PathwaysError(f"island {island} host {host}: {detail.splitlines()[0][:400]}") from None
    return out
