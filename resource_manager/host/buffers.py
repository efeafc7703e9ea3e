"""A host's buffer table: client-minted ids -> resident arrays (or the error that replaced them).

Deletes wait for pending ops: a free that arrives while an earlier fragment
still has to write or read the buffer marks it doomed, and the last of those
ops drops it. A fetch waiting for a buffer is told when that buffer arrives (a callback,
so no thread waits for it), not by every other write: a busy island serving
several clients' fetches would otherwise wake each of them on every op.

A message refused whole (it failed validation) has no ops to fail its outputs
one by one: its id range is recorded as failed, and a wait for any id in it
returns that failure. Once the host can no longer run (its executor died),
every wait returns that failure at once.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pathways.budgets import over
from pathways.errors import TenantAccessError

FAILED_RANGES = 4096  # refused messages remembered per host


@dataclass(frozen=True)
class Failure:
    """Stands in for a buffer whose producer failed; readers re-raise it."""

    kind: str
    message: str


class Entry:
    """One buffer: the tenant that owns it, its value (a ``jax.Array``, or the Failure that replaced it) and its
    bytes (read on every put and drop; ``jax.Array.nbytes`` is a Python property, so a caller that knows them
    says so)."""

    __slots__ = ("tenant", "value", "nbytes")

    def __init__(self, tenant: str, value: Any, nbytes: int | None = None) -> None:
        self.tenant, self.value = tenant, value
        if nbytes is None:
            nbytes = 0 if isinstance(value, Failure) else int(value.nbytes)
        self.nbytes = nbytes


class BufferTable:
    """Buffers by id, each owned by a tenant; bytes and their peak are counted per tenant and in all.

    Every lookup names the tenant, and another tenant's buffer is refused (or, for frees, ignored). A
    buffer with pending uses (``add_uses``) is only doomed by a free; the last ``done_using`` drops it.
    The table owns its lock; the callbacks ``when_ready`` registers run with it held, so they only hand
    work on. Lookups read without it (one dict read each).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[int, Entry] = {}
        self._uses: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._waiters: dict[int, list[Callable[[], None]]] = {}  # called (the lock held) when the id arrives
        self._failed: deque[tuple[int, int, str, Failure]] = deque(maxlen=FAILED_RANGES)
        self._dead: Failure | None = None
        self._bytes = 0  # of every entry, kept on each change so stats and the peak cost O(1)
        self._peak = 0
        self._tenant_bytes: Counter[str] = Counter()
        self._tenant_peak: dict[str, int] = {}

    # -- entries --------------------------------------------------------------------------------------------
    def _drop(self, buffer_id: int) -> Entry | None:
        old = self._entries.pop(buffer_id, None)
        if old is not None:
            self._bytes -= old.nbytes
            self._tenant_bytes[old.tenant] -= old.nbytes
        return old

    def put(self, buffer_id: int, tenant: str, value: Any, nbytes: int | None = None) -> None:
        """Store ``value`` (of ``nbytes``, when the caller knows them) as buffer ``buffer_id`` of ``tenant`` and wake
        the waits for it; TenantAccessError if another tenant owns that id."""
        with self._lock:
            self._store(buffer_id, tenant, value, nbytes)

    def put_all(self, ids: Sequence[int], tenant: str, values: Sequence[Any], nbytes: Sequence[int] = ()) -> None:
        """``put`` each of ``values`` (of ``nbytes``, when known) as the buffer of the same position in ``ids``, under
        one hold of the lock: an op's outputs."""
        with self._lock:
            if len(ids) == 1:  # most ops have one output
                self._store(ids[0], tenant, values[0], nbytes[0] if nbytes else None)
                return
            for k, (buffer_id, value) in enumerate(zip(ids, values)):
                self._store(buffer_id, tenant, value, nbytes[k] if nbytes else None)

    def _store(self, buffer_id: int, tenant: str, value: Any, nbytes: int | None) -> None:
        """``put``'s work, the lock held."""
        entries = self._entries
        old = entries.get(buffer_id)
        if old is not None:
            if old.tenant != tenant:
                raise TenantAccessError(f"buffer {buffer_id} is not owned by tenant {tenant!r}; refusing to write it")
            self._tenant_bytes[tenant] -= old.nbytes
            self._bytes -= old.nbytes
        entry = entries[buffer_id] = Entry(tenant, value, nbytes)
        total = self._bytes = self._bytes + entry.nbytes
        if total > self._peak:
            self._peak = total
        held = self._tenant_bytes[tenant] = self._tenant_bytes[tenant] + entry.nbytes
        if held > self._tenant_peak.get(tenant, 0):
            self._tenant_peak[tenant] = held
        if self._waiters:
            for call in self._waiters.pop(buffer_id, ()):
                call()

    def lookup(self, buffer_id: int, tenant: str) -> Entry | None:
        """The entry if it exists (or the failure that stands for it); refuses another tenant's buffer
        without revealing it."""
        entry = self._entries.get(buffer_id)
        if entry is None:
            failure = self._failure_of(buffer_id, tenant)
            return None if failure is None else Entry(tenant, failure)
        if entry.tenant != tenant:
            raise TenantAccessError(
                f"buffer {buffer_id} is not owned by tenant {tenant!r}; a program may only read its own buffers")
        return entry

    def _failure_of(self, buffer_id: int, tenant: str) -> Failure | None:
        if self._dead is not None:
            return self._dead
        for lo, hi, owner, failure in self._failed:
            if lo <= buffer_id < hi and owner == tenant:
                return failure
        return None

    def take(self, buffer_id: int, tenant: str) -> Any:
        """Remove a buffer and return its value (an input donated to XLA); the caller made sure nothing
        else uses it."""
        with self._lock:
            entry = self.lookup(buffer_id, tenant)
            if entry is None:
                return None
            self._drop(buffer_id)
            self._doomed.discard(buffer_id)
            return entry.value

    def used_elsewhere(self, buffer_id: int) -> bool:
        """Whether an op other than the one running now still reads or writes this buffer."""
        return self._uses.get(buffer_id, 0) > 1

    def hold(self, ids: list[int]) -> None:
        """Count one more use of these buffers (a send still reading them in the background): no free drops
        them and no call donates them until ``release``."""
        self.add_uses(ids)

    def release(self, ids: list[int]) -> None:
        """End the uses ``hold`` counted; a buffer freed meanwhile is dropped now."""
        self.done_using(ids)

    def fail_range(self, lo: int, hi: int, tenant: str, failure: Failure) -> None:
        """Ids ``lo`` to ``hi - 1`` of a refused message: waits for any of them return ``failure``."""
        with self._lock:
            self._failed.append((lo, hi, tenant, failure))
            for buffer_id in [i for i in self._waiters if lo <= i < hi]:
                for call in self._waiters.pop(buffer_id):
                    call()

    def die(self, failure: Failure) -> None:
        """The host can no longer run: every present and future wait returns ``failure``."""
        with self._lock:
            self._dead = failure
            for calls in self._waiters.values():
                for call in calls:
                    call()
            self._waiters.clear()

    def when_ready(self, buffer_id: int, tenant: str, call: Callable[[], None]) -> Entry | None:
        """The entry if it exists (or the failure that stands for it); otherwise None, and ``call`` runs (with
        the table's lock held: it must only hand work on) once it does, unless ``forget`` comes first."""
        with self._lock:
            found = self.lookup(buffer_id, tenant)
            if found is None:
                self._waiters.setdefault(buffer_id, []).append(call)
            return found

    def forget(self, buffer_id: int, call: Callable[[], None]) -> None:
        """Drop a ``when_ready`` callback that has not run (its wait timed out)."""
        with self._lock:
            calls = self._waiters.get(buffer_id)
            if calls is not None and call in calls:
                calls.remove(call)
                if not calls:
                    del self._waiters[buffer_id]

    def wait(self, buffer_id: int, tenant: str, timeout: float) -> Entry | None:
        """The entry once it exists, or None after ``timeout`` seconds (blocks the calling thread)."""
        event = threading.Event()
        found = self.when_ready(buffer_id, tenant, event.set)
        if found is not None or timeout <= 0:
            self.forget(buffer_id, event.set)
            return found
        if not event.wait(timeout):
            self.forget(buffer_id, event.set)
        with self._lock:
            return self.lookup(buffer_id, tenant)

    # -- uses and frees -------------------------------------------------------------------------------------
    def add_uses(self, ids: list[int]) -> None:
        """Count one more pending use of each id (an admitted op that reads or writes it)."""
        with self._lock:
            uses = self._uses
            for i in ids:
                uses[i] = uses.get(i, 0) + 1

    def free_then_use(self, frees: Sequence[int], tenant: str, ids: list[int]) -> None:
        """A call's admission under one hold of the lock: ``free`` what it drops, then ``add_uses`` of what it
        reads and writes (a call of a group, after the calls before it counted theirs)."""
        with self._lock:
            if frees:
                self.free(frees, tenant)
            uses = self._uses
            for i in ids:
                uses[i] = uses.get(i, 0) + 1

    def done_using(self, ids: Sequence[int], frees: Sequence[int] = (), tenant: str = "") -> None:
        """End one use of each id, dropping the doomed ones nothing uses any more; then free ``tenant``'s ``frees``
        (an op done with the last use of what its fragment drops, in one step)."""
        with self._lock:
            uses = self._uses
            for i in ids:
                left = uses[i] - 1
                if left > 0:
                    uses[i] = left
                    continue
                del uses[i]
                if i in self._doomed:
                    self._doomed.discard(i)
                    self._drop(i)
            if frees:
                self.free(frees, tenant)

    def free(self, ids: Sequence[int], tenant: str) -> None:
        """Drop ``tenant``'s buffers ``ids``, or doom those a pending op still uses (the last use drops them); ids of
        another tenant are ignored without a word."""
        with self._lock:
            for i in ids:
                entry = self._entries.get(i)
                if entry is not None and entry.tenant != tenant:
                    continue  # never touch another tenant's buffer, and say nothing about it
                if self._uses.get(i, 0) > 0:
                    self._doomed.add(i)
                else:
                    self._drop(i)

    def free_client(self, client: int, tenant: str, id_bits: int) -> int:
        """Free every buffer minted by one client (its ids share a prefix), e.g. at its shutdown."""
        with self._lock:
            ids = [i for i, e in self._entries.items() if i >> id_bits == client and e.tenant == tenant]
        self.free(ids, tenant)
        return len(ids)

    def free_tenant(self, tenant: str) -> int:
        """Drop every buffer of ``tenant`` at once (the tenant was removed); returns how many."""
        with self._lock:
            ids = [i for i, e in self._entries.items() if e.tenant == tenant]
            for i in ids:
                self._drop(i)
            return len(ids)

    def items(self) -> list[tuple[int, str, Any]]:
        """Every buffer as (id, tenant, value): what a snapshot saves."""
        with self._lock:
            return [(i, e.tenant, e.value) for i, e in self._entries.items()]

    def failed_ranges(self) -> list[tuple[int, int, str, Failure]]:
        """The id ranges of refused messages still remembered, as (lo, hi, tenant, failure)."""
        with self._lock:
            return list(self._failed)

    def clear(self) -> None:
        """Drop every buffer."""
        with self._lock:
            self._entries.clear()
            self._doomed.clear()
            self._bytes = 0
            self._tenant_bytes.clear()

    # -- accounting -----------------------------------------------------------------------------------------
    def __contains__(self, buffer_id: int) -> bool:
        return buffer_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes resident now, over every tenant."""
        return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most bytes resident at once since the last ``reset_peak``."""
        return self._peak

    def check_room(self, tenant: str, nbytes: int, limit: int) -> None:
        """ResourceError naming the ``host_bytes`` budget if ``tenant`` would hold more than ``limit`` bytes here
        with ``nbytes`` more; checked before an op allocates its outputs, so an op over budget never runs."""
        held = self._tenant_bytes.get(tenant, 0)
        if nbytes and held + nbytes > limit:
            raise over("host_bytes", held, nbytes, limit, "bytes")

    def tenant_usage(self, tenant: str) -> dict[str, int]:
        """One tenant's buffers, bytes, and peak bytes since its last ``reset_peak``."""
        with self._lock:
            count = sum(1 for e in self._entries.values() if e.tenant == tenant)
            return {"buffers": count, "buffer_bytes": self._tenant_bytes.get(tenant, 0),
                    "peak_buffer_bytes": self._tenant_peak.get(tenant, 0)}

    def reset_peak(self, tenant: str | None = None) -> int:
        """Start a new peak (one tenant's, or the host's) at the current bytes; returns the peak that ends."""
        with self._lock:
            if tenant is None:
                peak, self._peak = self._peak, self._bytes
                return peak
            peak = self._tenant_peak.get(tenant, 0)
            self._tenant_peak[tenant] = self._tenant_bytes.get(tenant, 0)
            return peak

    def by_tenant(self) -> dict[str, tuple[int, int]]:
        """(buffers, bytes) each tenant holds now."""
        out: dict[str, list[int]] = {}
        for e in list(self._entries.values()):
            agg = out.setdefault(e.tenant, [0, 0])
            agg[0] += 1
            agg[1] += e.nbytes
        return {t: (n, b) for t, (n, b) in out.items()}
