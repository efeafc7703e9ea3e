"""The client's share of each host's parked bytes: put values it sent that no put op has taken yet.

A put's bytes go straight to each host that holds a piece of it and wait there, counted against the tenant's
``parked_bytes`` budget, until the put's message reaches its turn in the island's order. Putting a large tree
(a model's state) back to back sends faster than the island takes, and the host would refuse the rest. So the
client keeps what it has in flight to each host within the budget: before it sends more, it waits for its
oldest puts there to be taken (their arrays ready). One client's puts to an island are taken in the order it
sent them, so a put the user already dropped is waited for through a later one still held; where none is (a
loop that drops each put at once), the host's own check of the budget is what remains.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

from pathways.errors import PathwaysError, ResourceError

Place = tuple[int, int]  # (island, host)
ENTRIES = 1024  # puts remembered per host: past it, the oldest is waited for as if the bytes were full


class ParkedWindow:
    """Bytes of this client's untaken puts per host, kept within ``limit`` (the tenant's ``parked_bytes``)."""

    def __init__(self, limit: int, timeout: float) -> None:
        self.limit = int(limit)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sent: dict[Place, deque[tuple[weakref.ref, int]]] = {}
        self._held: dict[Place, int] = {}

    def make_room(self, sizes: dict[Place, int], what: str) -> None:
        """Wait until ``sizes`` more bytes fit on each host (each oldest put taken waits at most ``timeout``).

        Raises:
            ResourceError: one host's pieces of this value alone are over the budget.
        """
        for place, nbytes in sizes.items():
            if nbytes > self.limit:
                raise ResourceError(
                    f"{what}: its pieces for island {place[0]} host {place[1]} are {nbytes} bytes, over your "
                    f"parked_bytes budget of {self.limit} bytes (what a host holds of a put before the put takes "
                    "it); shard the value over more devices, put it in parts, or ask the cluster's admin to raise "
                    "it (pathways tenants set NAME --budget parked_bytes=N)")
            while (put := self._put_to_wait_for(place, nbytes)) is not None:
                try:
                    put.block_until_ready(self.timeout)
                except PathwaysError:
                    pass  # that put failed: its bytes are not parked, and its owner hears why when it reads it

    def _put_to_wait_for(self, place: Place, nbytes: int) -> Any:
        """A put to wait for so that ``nbytes`` more fit at ``place`` (None: they fit). Once that put is taken so
        are all before it: they are uncounted now, together with it, and one wait makes room for many puts."""
        with self._lock:
            sent = self._sent.get(place)
            if not sent:
                return None
            need = self._held[place] + nbytes - self.limit
            cut = len(sent) // 2 if len(sent) >= ENTRIES else 0
            if need <= 0 and cut == 0:
                return None
            k, freed = 0, 0
            while k < len(sent) and (freed < need or k < cut):
                freed += sent[k][1]
                k += 1
            array = None
            while sent and (k > 0 or array is None):  # up to the k-th put, then on to one still alive
                ref, size = sent.popleft()
                self._held[place] -= size
                k -= 1
                array = ref()
            return array

    def sent(self, array: Any, sizes: dict[Place, int]) -> None:
        """``array``'s pieces went out to these hosts; they count until a wait finds it, or a later put, taken."""
        with self._lock:
            for place, nbytes in sizes.items():
                self._sent.setdefault(place, deque()).append((weakref.ref(array), nbytes))
                self._held[place] = self._held.get(place, 0) + nbytes
