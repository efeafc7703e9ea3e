"""The transport every peer can be reached by: a Ray actor call to the peer host, shards through the object store.

It is the last of every route (``peers.ROUTE``): a peer on another node without the network path, a same-node
peer whose channel failed or may not read this process, and every failure delivery. Each call is signed with the
runtime key, bound to the receiving host, so no other process can deliver in a host's name; the receiving
actor checks the signature and hands the call to ``receive``. The same signed calls carry an island's order to
its other hosts (``RayUplink``, for ``order.IslandOrder``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pathways import auth, wire
from pathways.errors import WireFormatError
from pathways.messages import Deliver, Returned
from resource_manager.host.rows import Landed, signed_parts
from resource_manager.host.transport.interface import Inbound, Peer, Sent, Transport


class Handles(Protocol):
    """Where the runtime's hosts' actors are."""

    def handle(self, island: int, host: int) -> Any:
        """The actor handle of host ``(island, host)``; KeyError if the resource manager never named it."""


class RayTransport(Transport):
    """Deliveries as signed actor calls (``deliver``), leases back as ``release_lent``."""

    name = "ray"

    def __init__(self, key: bytes, handles: Handles, inbound: Inbound) -> None:
        self._key, self._handles, self._inbound = key, handles, inbound

    def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
        meta = msg.encode()
        island, host = peer
        self._handles.handle(island, host).deliver.remote(meta, auth.sign(self._key, "deliver", island, host, meta),
                                                          *arrays)
        return Sent.SENT

    def give_back(self, peer: Peer, reply: str, leases: list[int]) -> bool:
        payload = Returned(tuple(leases)).encode()
        island, host = peer
        try:
            mac = auth.sign(self._key, "returned", island, host, payload)
            self._handles.handle(island, host).release_lent.remote(payload, mac)
        except KeyError:
            pass  # the sender is gone with its island
        return True

    def receive(self, meta: bytes, pieces: Sequence[np.ndarray]) -> None:
        """A delivery that came as an actor call (its signature already checked): to the receive side."""
        msg = Deliver.from_wire(wire.decode(meta, "deliver"))
        if msg.direct is not None or len(pieces) != len(msg.shards):
            raise WireFormatError(f"deliver: {len(msg.shards)} shard indices but {len(pieces)} arrays")
        self._inbound.deliver(msg, pieces, (msg.src, msg.host))

    def close(self) -> None:
        """Nothing to close: Ray owns the actor calls."""


class RayUplink:
    """An island's order to its other hosts (``order.Uplink``), as signed actor calls from host ``index``."""

    def __init__(self, key: bytes, island: int, n_hosts: int, handles: Handles) -> None:
        self._key, self.island, self.n_hosts, self._handles = key, island, n_hosts, handles

    def rows(self, rows: list[tuple]) -> None:
        """Host 0's rows (``rows.encode``) to each other host of the island (``enqueue_batch``)."""
        parts = signed_parts(rows)
        for host in range(1, self.n_hosts):
            mac = auth.sign(self._key, "enqueue", self.island, host, *parts)
            self._handles.handle(self.island, host).enqueue_batch.remote(rows, mac)

    def landed(self, landed: Landed) -> None:
        """This host's landed receives to host 0 (``landed``)."""
        mac = auth.sign(self._key, "landed", self.island, 0, *landed.signed_parts())
        self._handles.handle(self.island, 0).landed.remote(landed, mac)
