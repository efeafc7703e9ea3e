"""A host's network path: its data server, its links to peers, where peers are, and when not to use it.

It is the ``network`` transport of ``transport.peers.ROUTE``: a delivery the same-node channel did not take
comes here (``send``). The path carries it when the peer is a host on another Ray node whose data server the
resource manager advertised (its host info has ``data``: ``ip:port``, in the table of hosts the resource
manager hands every host); addresses come only from the resource manager, never from a client's message.
Otherwise, or when the send fails, ``push`` says no with a log line saying why, and the delivery goes through
Ray's object store (the next transport of the route), as it would without the path. A peer that could not be
reached is left to the object store for ``RETRY_S`` before the next try, so an unreachable data port costs one
connect timeout, not one per send. What arrives whole goes to the receive side (``transport.interface.Inbound``)
from the thread that landed it.

Configuration is the deployment's, read from each host's environment when it starts (``NetworkConfig``);
``PATHWAYS_NETWORK=off`` turns the path off. See docs/network.md.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pathways.messages import Deliver
from pathways.ops import Recv
from pathways.sharding import Index
from resource_manager.host.transport.interface import Inbound, Peer, Sent, Transport
from resource_manager.host.transport.network.frames import Identity
from resource_manager.host.transport.network.links import Links, NetworkError
from resource_manager.host.transport.network.receives import Arrived, Receives, expected_from_op
from resource_manager.host.transport.network.server import Alloc, DataServer

log = logging.getLogger(__name__)

RETRY_S = 30.0
REFETCH_S = 5.0
# Connections per peer by default: one per two cores, up to 4. A flow's copies into and out of the kernel take a
# core, and the host's executor, its landing and TCP's own work need the rest: on 2 cores a weight sync over 4
# connections took 15-20% more CPU than over 2, and over 2 more than over 1 (docs/performance.md).
STREAMS = max(1, min(4, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
                     // 2))
Directory = Callable[[], dict[Identity, dict]]


def _ports(text: str) -> range | None:
    if not text:
        return None
    low, _, high = text.partition("-")
    return range(int(low), int(high or low) + 1)


@dataclass(frozen=True)
class NetworkConfig:
    """The data path's settings on one host (environment variables in parentheses).

    enabled: use the path at all (``PATHWAYS_NETWORK``: ``off``/``0``/``false`` turn it off).
    streams: connections per peer a large send spreads over (``PATHWAYS_NETWORK_STREAMS``; default ``STREAMS``:
    one per two cores of the host, 1 to 4).
    ports: the range the data server binds in (``PATHWAYS_NETWORK_PORTS``, e.g. ``47000-47100``; default any).
    max_rate: cap on the host's outgoing bytes/s, 0 for none (``PATHWAYS_NETWORK_MAX_RATE``).
    chunk_bytes: bytes per data frame. ceiling: the largest shard a peer may announce. unclaimed_limit: bytes
    landed for receives this host has not admitted yet.
    """

    enabled: bool = True
    streams: int = STREAMS
    ports: range | None = None
    max_rate: float = 0.0
    chunk_bytes: int = 8 << 20
    ceiling: int = 16 << 30
    unclaimed_limit: int = 4 << 30

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> NetworkConfig:
        """The settings from ``PATHWAYS_NETWORK*`` variables in ``env``; ValueError on a malformed number or range."""
        enabled = env.get("PATHWAYS_NETWORK", "on").strip().lower() not in ("off", "0", "false", "no")
        return cls(enabled=enabled, streams=max(1, int(env.get("PATHWAYS_NETWORK_STREAMS", STREAMS))),
                   ports=_ports(env.get("PATHWAYS_NETWORK_PORTS", "").strip()),
                   max_rate=float(env.get("PATHWAYS_NETWORK_MAX_RATE", 0) or 0))


class NetworkPath(Transport):
    """This host's end of the data path (see the module docstring)."""

    name = "network"

    def __init__(self, identity: Identity, node: str, ip: str, secret: bytes, config: NetworkConfig, alloc: Alloc,
                 inbound: Inbound, directory: Directory, stale_s: float) -> None:
        self.identity, self.node = identity, node
        self.config = config
        self._inbound = inbound
        self.receives = Receives(self._landed, config.unclaimed_limit, stale_s)
        self.server = DataServer(identity, secret, ip, self.receives, alloc, config.ceiling, config.ports)
        self.links = Links(identity, secret, config.streams, config.chunk_bytes, rate=config.max_rate)
        self.address = self.server.address
        self._directory = directory
        self._lock = threading.Lock()
        self._hosts: dict[Identity, dict] = {}
        self._fetched = -math.inf
        self._down: dict[Identity, float] = {}
        self._said: set[tuple[Identity, str]] = set()
        self.fallbacks = 0

    # -- sending --------------------------------------------------------------------------------------------
    def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
        if arrays and self.push(peer[0], peer[1], msg.key, msg.shards, arrays):
            return Sent.SENT
        return Sent.PASSED  # a failure delivery, or a peer this path does not reach now

    def push(self, island: int, host: int, key: int, shards: Sequence[Index], arrays: Sequence[np.ndarray]) -> bool:
        """Carry shards for receive ``key`` to a peer on another node; False: use the object store."""
        peer = (island, host)
        address = self.route(peer)
        if address is None:
            return False
        pieces = [(s, np.ascontiguousarray(a)) for s, a in zip(shards, arrays)]
        if any(a.nbytes == 0 for _, a in pieces):
            return False  # empty arrays carry no bytes; the object store path handles them
        try:
            self.links.send(peer, address, key, pieces)
            return True
        except NetworkError as exc:
            with self._lock:
                self._down[peer] = time.monotonic() + RETRY_S
                self.fallbacks += 1
            log.warning("host %d of island %d: sending to host %d of island %d over the network failed (%s); "
                        "this and its next sends for %.0fs go through the object store", self.identity[1],
                        self.identity[0], host, island, exc, RETRY_S)
            return False

    def route(self, peer: Identity) -> str | None:
        """The data address of ``peer`` if this path should carry data to it, else None (why is logged once)."""
        with self._lock:
            if self._down.get(peer, 0.0) > time.monotonic():
                return None
        info = self._info(peer)
        if info is None:
            self._say(peer, "the resource manager lists no such host")
            return None
        if info.get("node") == self.node:
            return None  # same node: the channel (or the object store when reads are not permitted)
        address = info.get("data") or ""
        if not address:
            self._say(peer, "it runs no data server (PATHWAYS_NETWORK=off there, or it failed to start)")
            return None
        return address

    def _info(self, peer: Identity) -> dict | None:
        with self._lock:
            info = self._hosts.get(peer)
            if info is not None or time.monotonic() - self._fetched < REFETCH_S:
                return info
            self._fetched = time.monotonic()
        try:
            hosts = self._directory()
        except Exception as exc:  # the manager is unreachable: the object store still works
            self._say(peer, f"the resource manager could not be asked for addresses ({exc})")
            return None
        with self._lock:
            self._hosts = hosts
            return hosts.get(peer)

    def _say(self, peer: Identity, why: str) -> None:
        with self._lock:
            if (peer, why) in self._said:
                return
            self._said.add((peer, why))
        log.warning("host %d of island %d sends to host %d of island %d through the object store: %s",
                    self.identity[1], self.identity[0], peer[1], peer[0], why)

    def probe(self, island: int, host: int, nbytes: int) -> float:
        """Seconds for ``nbytes`` raw bytes to reach the peer over one fresh connection (a baseline)."""
        address = self.route((island, host))
        if address is None:
            raise NetworkError(f"no network path to host {host} of island {island}")
        return self.links.probe((island, host), address, nbytes)

    # -- receiving ------------------------------------------------------------------------------------------
    def _landed(self, key: int, sender: Identity, shard: Index, array: Arrived) -> None:
        """A piece its plan routes from ``sender`` arrived whole (authenticated and checked by ``receives``)."""
        self._inbound.deliver(Deliver(key, sender[0], sender[1], (shard,)), (array,), sender)

    def expect(self, key: int, op: Recv, regions: tuple[Index, ...] | None = None) -> None:
        """A recv op was admitted here: accept the pieces its plan routes to this host, landing them straight in
        ``regions`` (the distinct regions of the local devices, when known)."""
        expected = expected_from_op(op, self.identity[1], regions)
        if expected is not None:
            self.receives.expect(key, expected)

    def finished(self, key: int) -> None:
        """The receive completed or failed: refuse its late pieces and release what was landing for it."""
        self.receives.finished(key)
        self.server.drop(key=key)

    def island_restored(self, island: int) -> None:
        """``island`` has new hosts (new data addresses in the table of hosts): forget its old addresses, and
        that they could not be reached, so that the next send asks the table again."""
        with self._lock:
            self._hosts = {peer: info for peer, info in self._hosts.items() if peer[0] != island}
            self._down = {peer: until for peer, until in self._down.items() if peer[0] != island}
            self._fetched = -math.inf

    def drop_island(self, island: int) -> None:
        """An island failed: release everything its hosts were sending here, and forget its connections."""
        self.receives.drop_island(island)
        self.server.drop(island=island)
        with self._lock:
            peers = [p for p in self._hosts if p[0] == island]
        for peer in peers:
            self.links.drop_peer(peer)

    def stats(self) -> dict:
        """The path's counters: its address, fallbacks to the object store, and the server's, links' and receives'."""
        out = {"net_address": self.address, "net_fallbacks": self.fallbacks}
        out.update(self.server.stats())
        out.update(self.links.stats())
        out.update(self.receives.stats())
        return out

    def close(self) -> None:
        """Stop the data server and close every link."""
        self.server.close()
        self.links.close()


def open_network_path(identity: Identity, node: str, ip: str, secret: bytes | None, alloc: Alloc, inbound: Inbound,
                      directory: Directory, stale_s: float,
                      config: NetworkConfig | None = None) -> NetworkPath | None:
    """The host's network path, or None (with a log line saying why) when it is off or cannot start."""
    try:
        config = config or NetworkConfig.from_env()
    except ValueError as exc:
        log.warning("the network data path is off: bad PATHWAYS_NETWORK_* setting (%s)", exc)
        return None
    if not config.enabled:
        log.info("the network data path is off (PATHWAYS_NETWORK); other nodes' hosts use the object store")
        return None
    if not secret:
        log.warning("the network data path is off: the resource manager gave this host no secret")
        return None
    try:
        return NetworkPath(identity, node, ip, secret, config, alloc, inbound, directory, stale_s)
    except (OSError, ValueError) as exc:
        log.warning("the network data path is off: its data server could not start on %s (%s)", ip, exc)
        return None


def landing_alloc(take: Callable[[Sequence[int], np.dtype], np.ndarray]) -> Alloc:
    """Landing buffers from the host's pool, marked so a piece that is one device's region is adopted as is."""
    from resource_manager.host.transfer import Landed

    def alloc(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        return take(shape, dtype).view(Landed)

    return alloc

