"""Host values clients sent for their puts, waiting for the put to take its place in the island's order.

A put travels in two parts: the message, in the client's stream to the island's host 0 (it is ordered with
the client's programs), and the value's bytes, straight from the client to each host that holds a piece of it
(each host receives only its own shards). The bytes usually arrive first; they wait here, owned by the
client's tenant and counted against its ``parked_bytes`` budget, until the put op takes them. Bytes no put
claims within ``ttl`` seconds (its message was refused, or its client died) are dropped. An upload refused
here (over the tenant's budget, malformed) leaves its reason, so its put fails with it at once instead of
waiting for bytes that will not come.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pathways.budgets import over
from pathways.errors import TenantAccessError
from pathways.ops import Region
from resource_manager.host.buffers import Failure

Pieces = dict[Region, np.ndarray]
REFUSALS = 4096  # refused uploads remembered per host


@dataclass
class _Upload:
    tenant: str
    pieces: Pieces
    nbytes: int
    since: float = field(default_factory=time.monotonic)


class Uploads:
    """Uploaded put values by buffer id; thread-safe. ``wake`` is called when one arrives (a put op may wait)."""

    def __init__(self, ttl: float, wake: Callable[[], None]) -> None:
        self.ttl = ttl
        self._wake = wake
        self._lock = threading.Lock()
        self._by_id: dict[int, _Upload] = {}
        self._bytes: dict[str, int] = {}
        self._refused: OrderedDict[int, tuple[str, Failure]] = OrderedDict()

    def reserve(self, buffer_id: int, tenant: str, nbytes: int, budget: int) -> None:
        """Check that ``tenant`` may park ``nbytes`` more here before they are read off the socket: ResourceError
        naming the budget if not, TenantAccessError if the id is already taken."""
        with self._lock:
            if buffer_id in self._by_id:
                raise TenantAccessError(f"put {buffer_id} was already uploaded; a put's value is sent once")
            held = self._bytes.get(tenant, 0)
            if held + nbytes > budget:
                raise over("parked_bytes", held, nbytes, budget, "bytes")
            self._bytes[tenant] = held + nbytes
            self._by_id[buffer_id] = _Upload(tenant, {}, nbytes)

    def fill(self, buffer_id: int, pieces: Pieces) -> None:
        """The reserved upload's pieces have arrived whole."""
        with self._lock:
            upload = self._by_id.get(buffer_id)
            if upload is None:
                return
            upload.pieces = pieces
        self._wake()

    def cancel(self, buffer_id: int) -> None:
        """Give up on a reserved upload (its bytes did not arrive)."""
        with self._lock:
            self._drop(buffer_id)

    def refuse(self, buffer_id: int, tenant: str, failure: Failure) -> None:
        """The upload for put ``buffer_id`` was refused: its put fails with ``failure``."""
        with self._lock:
            self._refused[buffer_id] = (tenant, failure)
            while len(self._refused) > REFUSALS:
                self._refused.popitem(last=False)
        self._wake()

    def take(self, buffer_id: int, tenant: str) -> Pieces | Failure | None:
        """The pieces of put ``buffer_id`` of ``tenant``, removed (or why they were refused); None while they
        have not arrived."""
        with self._lock:
            refused = self._refused.get(buffer_id)
            if refused is not None and refused[0] == tenant:
                del self._refused[buffer_id]
                return refused[1]
            upload = self._by_id.get(buffer_id)
            if upload is None or upload.tenant != tenant or not upload.pieces:
                return None
            self._drop(buffer_id)
            return upload.pieces

    def _drop(self, buffer_id: int) -> None:
        upload = self._by_id.pop(buffer_id, None)
        if upload is not None:
            self._bytes[upload.tenant] -= upload.nbytes
            if not self._bytes[upload.tenant]:
                del self._bytes[upload.tenant]

    def expire(self) -> int:
        """Drop uploads nothing claimed within ``ttl``; returns how many."""
        horizon = time.monotonic() - self.ttl
        with self._lock:
            stale = [i for i, u in self._by_id.items() if u.since < horizon]
            for i in stale:
                self._drop(i)
        return len(stale)

    def drop_client(self, client_of: Callable[[int], int], client: int) -> None:
        """Drop every upload of ``client`` (its session ended)."""
        with self._lock:
            for i in [i for i in self._by_id if client_of(i) == client]:
                self._drop(i)

    def saved(self) -> tuple[list[tuple[int, str, Pieces]], list[tuple[int, str, Failure]]]:
        """What a snapshot keeps: the uploads that arrived whole (id, tenant, pieces) and the refusals."""
        with self._lock:
            return ([(i, u.tenant, dict(u.pieces)) for i, u in self._by_id.items() if u.pieces],
                    [(i, t, f) for i, (t, f) in self._refused.items()])

    def restore(self, buffer_id: int, tenant: str, pieces: Pieces) -> None:
        """An upload saved by a snapshot, parked again (its tenant had it before; no budget is checked)."""
        with self._lock:
            nbytes = sum(int(p.nbytes) for p in pieces.values())
            self._by_id[buffer_id] = _Upload(tenant, pieces, nbytes)
            self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes

    def held(self, tenant: str) -> int:
        """Bytes ``tenant`` has parked here."""
        with self._lock:
            return self._bytes.get(tenant, 0)
