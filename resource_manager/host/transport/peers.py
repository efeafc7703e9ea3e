"""Who a host's peers are, the shards it lent them, and the table that picks how a delivery reaches each.

The resource manager tells every host the runtime's hosts (actor handle, node, process id, socket path, data
address); a host talks to no one else. A delivery goes by the first transport of ``ROUTE`` (``transport.interface``)
that carries it: the same-node channel (``channel``: small shards inside the frame, large ones lent, kept alive
here until their lease comes back), the network path to a host on another node (``network``), else a signed Ray
actor call through the object store (``ray``), which reaches every peer. Leases come back the same way: the
first transport of the route that can return them does, from a thread of their own (``Returns``): a recv op that
copied lent shards hands their leases over and goes on, and leases that pile up meanwhile go back together, one
frame per sender (returning them on the op's thread cost a wake-up of the sender per receive).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways.messages import Deliver
from resource_manager.host.transport.direct import Lent
from resource_manager.host.transport.interface import Sent, Transport

ROUTE = ("channel", "network", "ray")  # the transports a delivery tries, in order; the first that carries it wins
CLOSE_S = 5.0  # how long closing waits for leases still to go back
log = logging.getLogger(__name__)
Lease = tuple[tuple[int, int], str, int]  # (the sender that lent it, where it takes leases back, the lease)


class Returns:
    """Leases on their way back to their senders, sent by one thread of their own: ``put`` never waits for a
    socket. What piles up while a send is under way goes in the next one, grouped per sender. The queue holds no
    more leases than were lent to this host (each sender bounds what it lends by its receivers' budgets)."""

    def __init__(self, send: Callable[[tuple[int, int], str, list[int]], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._queue: deque[Lease] = deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.sent = 0  # groups of leases handed to a transport

    def put(self, leases: Sequence[Lease]) -> None:
        """Queue ``leases`` to go back (after ``close``: sent on the caller's thread)."""
        with self._cond:
            if not self._closed:
                self._queue.extend(leases)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="lease-returns", daemon=True)
                    self._thread.start()
                self._cond.notify()
                return
        self._flush(list(leases))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._busy = list(self._queue), True
                self._queue.clear()
            try:
                self._flush(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _flush(self, batch: list[Lease]) -> None:
        by_sender: dict[tuple[tuple[int, int], str], list[int]] = {}
        for peer, reply, lease in batch:
            by_sender.setdefault((peer, reply), []).append(lease)
        for (peer, reply), leases in by_sender.items():
            try:
                self._send(peer, reply, leases)
                self.sent += 1
            except Exception:  # a sender that is gone: its island's failure releases what it lent
                log.exception("returning %d lease(s) to host %d of island %d failed", len(leases), peer[1], peer[0])

    def wait_sent(self, timeout: float) -> bool:
        """Wait until every queued lease went back (tests, and closing); False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = CLOSE_S) -> None:
        """Send what is queued (within ``timeout``), then stop the thread; later leases go back on their caller."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


@dataclass(frozen=True)
class PeerInfo:
    """One of the runtime's hosts, as the resource manager started it."""

    island: int
    host: int
    node: str
    pid: int
    channel: str  # its same-node socket ("" when it has none)
    data: str  # its network data server, ip:port ("" when it runs none)
    handle: Any


class Peers:
    """This host's view of the other hosts: who they are, how to reach each (``ROUTE``), and what it lent them."""

    def __init__(self, island: int, host: int, node: str) -> None:
        self.island, self.host, self.node = island, host, node
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._lent: dict[int, tuple[list[np.ndarray], int]] = {}
        self._hosts: dict[tuple[int, int], PeerInfo] = {}
        self._by_pid: dict[int, PeerInfo] = {}
        self.transports: dict[str, Transport] = {}
        self._route: tuple[Transport, ...] = ()
        self.returns = Returns(self._return)

    def use(self, *transports: Transport | None) -> None:
        """The transports this host has (those it could not open are None): their order is ``ROUTE``'s."""
        for transport in transports:
            if transport is not None:
                if transport.name not in ROUTE:
                    raise ValueError(f"transport {transport.name!r} has no place in the route {ROUTE}")
                self.transports[transport.name] = transport
        self._route = tuple(self.transports[name] for name in ROUTE if name in self.transports)

    @property
    def network(self) -> Any:
        """The network path (``network.path.NetworkPath``), or None: the receive side registers receives with it."""
        return self.transports.get("network")

    # -- who the peers are --------------------------------------------------------------------------------
    def set_hosts(self, hosts: Sequence[PeerInfo]) -> set[int]:
        """The runtime's hosts (after a start or an island's restart); links to changed hosts are probed anew.
        Returns the islands whose hosts were replaced."""
        replaced = set()
        channel = self.transports.get("channel")
        with self._lock:
            for info in hosts:
                old = self._hosts.get((info.island, info.host))
                if old is not None and old.pid != info.pid:
                    if channel is not None:
                        channel.forget((info.island, info.host))
                    replaced.add(info.island)
                self._hosts[(info.island, info.host)] = info
            self._by_pid = {i.pid: i for i in self._hosts.values() if i.node == self.node}
        network = self.network
        if network is not None:
            for island in replaced:
                network.island_restored(island)
        return replaced

    def directory(self) -> dict[tuple[int, int], dict]:
        """Every runtime host's node and data address, by (island, host): where the network path may send."""
        with self._lock:
            return {key: {"node": i.node, "data": i.data} for key, i in self._hosts.items()}

    def info(self, island: int, host: int) -> PeerInfo | None:
        """Host ``(island, host)`` as the resource manager started it, or None."""
        return self._hosts.get((island, host))

    def handle(self, island: int, host: int) -> Any:
        """The actor handle of host ``(island, host)``; KeyError if the resource manager never named it."""
        info = self._hosts.get((island, host))
        if info is None:
            raise KeyError(f"no host {host} on island {island} is known to island {self.island}")
        return info.handle

    def on_this_node(self, pid: int) -> PeerInfo | None:
        """The runtime host with process id ``pid`` on this node (what a socket's peer credentials name)."""
        return self._by_pid.get(pid)

    # -- sending ------------------------------------------------------------------------------------------
    def linked(self, island: int, hosts: Sequence[int]) -> bool:
        """Whether every one of these peers is known to take frames on the same-node channel (a send is then
        cheap enough to make on the caller's thread)."""
        channel = self.transports.get("channel")
        return channel is not None and channel.linked(island, hosts)

    def send(self, island: int, host: int, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> bool:
        """Deliver ``msg`` and its ``arrays`` to a peer host by the first transport of the route that carries it;
        returns whether the shards were lent."""
        peer = (island, host)
        for transport in self._route:
            sent = transport.send(peer, msg, arrays, timeout)
            if sent is not Sent.PASSED:
                return sent is Sent.LENT
        raise ConnectionError(f"no transport reaches host {host} of island {island}")

    def give_back(self, pieces: Sequence[Lent]) -> None:
        """The receiver's side: return the leases of lent pieces to their senders, copied or not (queued for
        ``returns``' thread: the caller does not wait for them to go)."""
        if pieces:
            self.returns.put([(piece.src, piece.reply, piece.lease) for piece in pieces])

    def _return(self, peer: tuple[int, int], reply: str, leases: list[int]) -> None:
        """Leases back to the host that lent them, by the first transport of the route that can."""
        for transport in self._route:
            if transport.give_back(peer, reply, leases):
                return

    # -- lending ------------------------------------------------------------------------------------------
    def keep(self, arrays: list[np.ndarray], island: int) -> int:
        """Keep ``arrays`` alive for a reader on ``island``; the lease that names them."""
        with self._lock:
            lease = next(self._ids)
            self._lent[lease] = (arrays, island)
        return lease

    def release(self, leases: Sequence[int]) -> None:
        """Let go of the arrays lent under ``leases`` (their receiver has copied them, or never will)."""
        with self._lock:
            for lease in leases:
                self._lent.pop(int(lease), None)

    def drop_island(self, island: int) -> None:
        """A failed island will never read what was lent to it, nor finish what it was sending here."""
        network = self.network
        if network is not None:
            network.drop_island(island)
        with self._lock:
            for k in [k for k, (_, dst) in self._lent.items() if dst == island]:
                del self._lent[k]

    @property
    def lent_bytes(self) -> int:
        """Bytes this host keeps alive for same-node readers now."""
        with self._lock:
            return sum(a.nbytes for arrays, _ in self._lent.values() for a in arrays)

    def stats(self) -> dict:
        """Every transport's counters."""
        out: dict = {}
        for transport in self._route:
            out.update(transport.stats())
        return out

    def close(self) -> None:
        """Send the leases still queued, then close every transport."""
        self.returns.close()
        for transport in self._route:
            transport.close()
