"""A host's buffer table: client-minted ids -> resident arrays (or the error that replaced them).

Deletes wait for pending ops: a free that arrives while an earlier fragment
still has to write or read the buffer marks it doomed, and the last of those
ops drops it. A fetch waiting for a buffer is woken when that buffer arrives,
not by every other write: a busy island serving several clients' fetches
would otherwise wake each of them on every op.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pathways.errors import TenantAccessError


@dataclass(frozen=True)
class Failure:
    """Stands in for a buffer whose producer failed; readers re-raise it."""

    kind: str
    message: str


@dataclass
class Entry:
    tenant: str
    value: Any  # jax.Array | Failure
    nbytes: int = field(init=False)  # read on every put and drop: jax.Array.nbytes is a Python property

    def __post_init__(self) -> None:
        self.nbytes = 0 if isinstance(self.value, Failure) else int(self.value.nbytes)


class BufferTable:
    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._entries: dict[int, Entry] = {}
        self._uses: Counter[int] = Counter()
        self._doomed: set[int] = set()
        self._waiters: dict[int, list[threading.Event]] = {}
        self._bytes = 0  # of every entry, kept on each change so stats and the peak cost O(1)
        self._peak = 0

    def _set(self, buffer_id: int, entry: Entry) -> None:
        old = self._entries.get(buffer_id)
        self._entries[buffer_id] = entry
        self._bytes += entry.nbytes - (old.nbytes if old is not None else 0)
        self._peak = max(self._peak, self._bytes)

    def _drop(self, buffer_id: int) -> None:
        old = self._entries.pop(buffer_id, None)
        if old is not None:
            self._bytes -= old.nbytes

    def put(self, buffer_id: int, tenant: str, value: Any) -> None:
        with self._cond:
            entry = self._entries.get(buffer_id)
            if entry is not None and entry.tenant != tenant:
                raise TenantAccessError(f"buffer {buffer_id} is not owned by tenant {tenant!r}; refusing to write it")
            self._set(buffer_id, Entry(tenant, value))
            for event in self._waiters.pop(buffer_id, ()):
                event.set()

    def lookup(self, buffer_id: int, tenant: str) -> Entry | None:
        """The entry if it exists; refuses another tenant's buffer without revealing it."""
        entry = self._entries.get(buffer_id)
        if entry is not None and entry.tenant != tenant:
            raise TenantAccessError(
                f"buffer {buffer_id} is not owned by tenant {tenant!r}; a program may only read its own buffers")
        return entry

    def wait(self, buffer_id: int, tenant: str, timeout: float) -> Entry | None:
        """The entry once it exists, or None after ``timeout`` seconds."""
        with self._cond:
            if buffer_id in self._entries:
                return self.lookup(buffer_id, tenant)
            event = threading.Event()
            self._waiters.setdefault(buffer_id, []).append(event)
        arrived = event.wait(timeout)
        with self._cond:
            if not arrived:
                waiters = self._waiters.get(buffer_id, [])
                if event in waiters:
                    waiters.remove(event)
                if not waiters:
                    self._waiters.pop(buffer_id, None)
            return self.lookup(buffer_id, tenant)

    def add_uses(self, ids: list[int]) -> None:
        self._uses.update(ids)

    def done_using(self, ids: list[int]) -> None:
        for i in ids:
            self._uses[i] -= 1
            if self._uses[i] <= 0:
                del self._uses[i]
                if i in self._doomed:
                    self._doomed.discard(i)
                    self._drop(i)

    def sole_use(self, buffer_id: int) -> bool:
        """True when no pending op other than the one asking (which counts one use) reads or writes the buffer."""
        return self._uses.get(buffer_id, 0) <= 1

    def donated(self, ids: list[int]) -> None:
        """Buffers a call consumed (donated to XLA): they leave the table now; their memory is the outputs'."""
        with self._cond:
            for i in ids:
                self._doomed.discard(i)
                self._drop(i)

    def free(self, ids: list[int], tenant: str) -> None:
        with self._cond:  # re-entrant: the executor frees while holding it
            for i in ids:
                entry = self._entries.get(i)
                if entry is not None and entry.tenant != tenant:
                    continue  # never touch another tenant's buffer, and say nothing about it
                if self._uses.get(i, 0) > 0:
                    self._doomed.add(i)
                else:
                    self._drop(i)

    def free_client(self, client: int, tenant: str, id_bits: int) -> None:
        """Free every buffer minted by one client (its ids share a prefix), e.g. at its shutdown."""
        with self._cond:
            ids = [i for i, e in self._entries.items() if i >> id_bits == client and e.tenant == tenant]
        self.free(ids, tenant)

    def free_tenant(self, tenant: str) -> int:
        with self._cond:
            ids = [i for i, e in self._entries.items() if e.tenant == tenant]
            for i in ids:
                self._drop(i)
            return len(ids)

    def clear(self) -> None:
        with self._cond:
            self._entries.clear()
            self._doomed.clear()
            self._bytes = 0

    def __contains__(self, buffer_id: int) -> bool:
        return buffer_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most bytes resident at once since the last ``reset_peak``."""
        return self._peak

    def reset_peak(self) -> int:
        """Start a new peak at the current bytes; returns the peak that ends."""
        with self._cond:
            peak, self._peak = self._peak, self._bytes
            return peak

    def by_tenant(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = {}
        for e in list(self._entries.values()):
            agg = out.setdefault(e.tenant, [0, 0])
            agg[0] += 1
            agg[1] += e.nbytes
        return {t: (n, b) for t, (n, b) in out.items()}
