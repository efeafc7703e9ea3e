"""Who a host's peers are, the shards it lent them, and the table that picks how a delivery reaches each.

The resource manager tells every host the runtime's hosts (actor handle, node, process id, socket path, data
address); a host talks to no one else. A delivery goes by the first transport of ``ROUTE`` (``transport.interface``)
that carries it: the same-node channel (``channel``: small shards inside the frame, large ones lent, kept alive
here until their lease comes back), the network path to a host on another node (``network``), else a signed Ray
actor call through the object store (``ray``), which reaches every peer. Leases come back the same way: the
first transport of the route that can return them does.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways.messages import Deliver
from resource_manager.host.transport.direct import Lent
from resource_manager.host.transport.interface import Sent, Transport

ROUTE = ("channel", "network", "ray")  # the transports a delivery tries, in order; the first that carries it wins


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
        """The receiver's side: return the leases of lent pieces to their senders, copied or not."""
        by_sender: dict[tuple[tuple[int, int], str], list[int]] = {}
        for piece in pieces:
            by_sender.setdefault((piece.src, piece.reply), []).append(piece.lease)
        for (peer, reply), leases in by_sender.items():
            for transport in self._route:
                if transport.give_back(peer, reply, leases):
                    break

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
        """Close every transport."""
        for transport in self._route:
            transport.close()
