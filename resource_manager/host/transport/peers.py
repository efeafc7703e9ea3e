"""How a host's shards reach peer hosts, and who its peers are.

The resource manager tells every host the runtime's hosts (actor handle, node,
process id, socket path); a host talks to no one else. A peer on this node
that passed a probe gets frames on the channel: small shards inside the frame,
large ones lent (kept alive here until their lease comes back; the receiver
copies them out of this process, whose pid it takes from the socket, not from
the frame). Other peers get a Ray actor call with the shards attached, through
the object store, signed with the runtime key so that no other process can
deliver in a host's name; a peer on another node gets its shards over the
network path (``resource_manager.host.transport.network``) when both run it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways import auth, wire
from pathways.messages import Deliver, Lending
from resource_manager.host.transport.channel import Channel
from resource_manager.host.transport.direct import PROBE, Lent, _readv
from resource_manager.host.transport.network.path import NetworkPath

MIN_BYTES = 100 * 1024  # below this a same-node peer gets the shards inside the frame: cheaper than a lease
log = logging.getLogger(__name__)


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
    """This host's view of the other hosts: where to send, and the shards it lent to same-node peers."""

    def __init__(self, island: int, host: int, node: str, channel: Channel | None, runtime_key: bytes) -> None:
        self.island, self.host, self.node = island, host, node
        self.pid = os.getpid()
        self.channel = channel
        self.network: NetworkPath | None = None  # set once the host's network path is open
        self._key = runtime_key
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._lent: dict[int, tuple[list[np.ndarray], int]] = {}
        self._hosts: dict[tuple[int, int], PeerInfo] = {}
        self._by_pid: dict[int, PeerInfo] = {}
        self._links: dict[tuple[int, int], str] = {}
        self._probe = np.frombuffer(PROBE, np.uint8).copy()

    # -- who the peers are --------------------------------------------------------------------------------
    def set_hosts(self, hosts: Sequence[PeerInfo]) -> set[int]:
        """The runtime's hosts (after a start or an island's restart); links to changed hosts are probed anew.
        Returns the islands whose hosts were replaced."""
        replaced = set()
        with self._lock:
            for info in hosts:
                old = self._hosts.get((info.island, info.host))
                if old is not None and old.pid != info.pid:
                    self._links.pop((info.island, info.host), None)
                    replaced.add(info.island)
                self._hosts[(info.island, info.host)] = info
            self._by_pid = {i.pid: i for i in self._hosts.values() if i.node == self.node}
        if self.network is not None:
            for island in replaced:
                self.network.island_restored(island)
        return replaced

    def directory(self) -> dict[tuple[int, int], dict]:
        """Every runtime host's node and data address, by (island, host): where the network path may send."""
        with self._lock:
            return {key: {"node": i.node, "data": i.data} for key, i in self._hosts.items()}

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
    def link(self, island: int, host: int, timeout: float) -> str:
        """The channel address of host ``(island, host)`` if it is on this node and can read this process,
        else "": asked once per peer, then remembered."""
        key = (island, host)
        known = self._links.get(key)
        if known is None:
            known = ""
            info = self._hosts.get(key)
            if info is not None and info.node == self.node and self.channel is not None and _readv is not None:
                import ray

                addr = self._probe.ctypes.data
                mac = auth.sign(self._key, "probe", island, host, self.node, self.pid, addr)
                try:
                    known = ray.get(info.handle.probe_direct.remote(mac, self.node, self.pid, addr, PROBE),
                                    timeout=timeout) or ""
                except Exception:  # an unreachable peer fails its transfer on the Ray path instead
                    known = ""
            self._links[key] = known
        return known

    def linked(self, island: int, hosts: Sequence[int]) -> bool:
        """Whether every one of these peers is known to take frames on the channel."""
        return all(self._links.get((island, host)) for host in hosts)

    def send(self, island: int, host: int, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> bool:
        """Deliver ``msg`` and its ``arrays`` to a peer host; returns whether the shards were lent."""
        link = self.link(island, host, timeout)
        lend = bool(link) and sum(a.nbytes for a in arrays) >= MIN_BYTES
        if link:
            if lend:
                frame, attached = self.lend(msg, arrays, island), []
            else:
                frame = Deliver(msg.key, msg.src, msg.host, msg.shards, msg.failure, None,
                                arrays[0].dtype.name if arrays else None)
                attached = arrays
            try:
                self.channel.send(link, frame.encode(), attached)
                return lend
            except OSError:  # the peer's socket is gone: Ray says whether the peer is
                if lend:
                    self.release([frame.direct.lease])
        elif arrays and self.network is not None and self.network.push(island, host, msg.key, msg.shards, arrays):
            return False  # a peer on another node, over the network path
        meta = msg.encode()
        self.handle(island, host).deliver.remote(meta, auth.sign(self._key, "deliver", island, host, meta), *arrays)
        return False

    def give_back(self, pieces: Sequence[Lent]) -> None:
        """The receiver's side: return the leases of lent pieces to their senders, copied or not."""
        by_sender: dict[tuple[tuple[int, int], str], list[int]] = {}
        for piece in pieces:
            by_sender.setdefault((piece.src, piece.reply), []).append(piece.lease)
        for ((island, host), reply), leases in by_sender.items():
            payload = wire.encode("returned", {"leases": leases})
            if reply and self.channel is not None:
                try:
                    self.channel.send(reply, payload)
                    continue
                except OSError:
                    pass
            try:
                mac = auth.sign(self._key, "returned", island, host, payload)
                self.handle(island, host).release_lent.remote(payload, mac)
            except KeyError:
                pass  # the sender is gone with its island

    # -- lending ------------------------------------------------------------------------------------------
    def lend(self, msg: Deliver, arrays: list[np.ndarray], island: int) -> Deliver:
        """Keep ``arrays`` alive for a reader on ``island``; ``msg`` with the lease that names them."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        with self._lock:
            lease = next(self._ids)
            self._lent[lease] = (arrays, island)
        lending = Lending(lease, tuple(a.ctypes.data for a in arrays), self.channel.address if self.channel else "")
        return Deliver(msg.key, msg.src, msg.host, msg.shards, None, lending, None)

    def release(self, leases: Sequence[int]) -> None:
        """Let go of the arrays lent under ``leases`` (their receiver has copied them, or never will)."""
        with self._lock:
            for lease in leases:
                self._lent.pop(int(lease), None)

    def drop_island(self, island: int) -> None:
        """A failed island will never read what was lent to it, nor finish what it was sending here."""
        if self.network is not None:
            self.network.drop_island(island)
        with self._lock:
            for k in [k for k, (_, dst) in self._lent.items() if dst == island]:
                del self._lent[k]

    @property
    def lent_bytes(self) -> int:
        """Bytes this host keeps alive for same-node readers now."""
        with self._lock:
            return sum(a.nbytes for arrays, _ in self._lent.values() for a in arrays)
