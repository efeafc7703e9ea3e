"""Which pieces a host accepts from which peer: exactly those the lowered plan routes to it.

A recv op names its source island and (from ``pathways.sharding.plan_transfer``) the routes of the transfer:
which host of the source island sends which shards to which host here. When an island admits a fragment,
its recv ops are registered here (``expect``), and a piece that arrives over the network is accepted only if
its authenticated sender is a host the plan names for that receive and the shard is one that host was told
to send, with the receive's dtype. Anything else is refused and logged. A receive that finished (or failed)
is forgotten, and late pieces for it are refused as well. A receive registered with where it lands on this host
(a ``scatter.Target``) has its pieces read straight into the devices' regions (``server``).

Pieces may arrive before their fragment is admitted here (the sending island ran ahead). They are landed
anyway, under a budget of unclaimed bytes, and staged until the receive is registered, checked then, and
dropped if no receive claims them within ``stale_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pathways.ops import Recv
from pathways.sharding import Index, dtype_from_wire
from resource_manager.host.transport.network.frames import Identity
from resource_manager.host.transport.network.scatter import Scattered, Target

log = logging.getLogger(__name__)

Arrived = np.ndarray | Scattered  # a shard that arrived whole: in a buffer of its own, or in its receive's target
Accept = Callable[[int, Identity, Index, Arrived], None]  # (key, sending host, shard, piece): an accepted piece
LATER = "later"  # not registered yet: land, then stage
OK = "ok"
REMEMBER_DONE = 65536  # finished receives remembered, so late pieces for them are refused, not staged


@dataclass(frozen=True)
class Expected:
    """One registered receive on this host: the source island, and per sending host the shards the plan names
    for it (``None``: the op carried no routes; then any host of the island may send any region in bounds)."""

    src_island: int
    senders: dict[int, frozenset[Index]] | None
    dtype: np.dtype
    shape: tuple[int, ...]
    target: Target | None = None  # where its pieces land, when known: then straight there (``scatter``)


@dataclass
class _Staged:
    sender: Identity
    shard: Index
    array: Arrived
    since: float = field(default_factory=time.monotonic)


def expected_from_op(op: Recv, host: int, regions: tuple[Index, ...] | None = None) -> Expected | None:
    """What a recv op lets peers send to host ``host``; None when nothing of it lands here. ``regions``: the
    distinct regions of its local devices, which pieces then land in directly."""
    expect = op.expected(host)
    if expect is None:
        return None
    dtype = dtype_from_wire(op.aval.dtype)
    return Expected(op.src, dict(expect.shards), dtype, tuple(op.aval.shape),
                    None if regions is None else Target(regions, dtype))


def _in_bounds(shard: Index, shape: tuple[int, ...]) -> bool:
    return len(shard) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(shard, shape))


class Receives:
    """The registry of this host's expected receives, and the pieces that came before their receive did.

    ``deliver`` files an accepted piece for the recv op; it is never called with this registry's lock held,
    so it may take the executor's lock even when ``expect`` is called under it.
    """

    def __init__(self, deliver: Accept, unclaimed_limit: int, stale_s: float) -> None:
        self._deliver = deliver
        self.unclaimed_limit = unclaimed_limit
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._expected: dict[int, Expected] = {}
        self._staged: dict[int, list[_Staged]] = {}
        self._done: OrderedDict[int, None] = OrderedDict()
        self.unclaimed_bytes = 0  # landing or staged for receives not registered yet
        self.refused = 0
        self.staged = 0
        self.dropped_bytes = 0

    # -- what the executor tells: a receive is admitted, or finished --------------------------------------
    def expect(self, key: int, expected: Expected) -> None:
        """Register a receive; pieces staged for it are checked now, and delivered or refused."""
        with self._lock:
            if key in self._done:
                return
            self._expected[key] = expected
            staged = self._staged.pop(key, [])
            for s in staged:
                self.unclaimed_bytes -= s.array.nbytes
        for s in staged:
            self._hand_over(s.sender, key, s.shard, s.array)

    def finished(self, key: int) -> None:
        """The receive completed or failed: forget it; pieces for it from now on are refused."""
        with self._lock:
            self._expected.pop(key, None)
            self._done[key] = None
            if len(self._done) > REMEMBER_DONE:
                self._done.popitem(last=False)
            self._drop_staged(lambda k, s: k == key)

    def drop_island(self, island: int) -> None:
        """An island failed: its staged pieces will never be claimed."""
        with self._lock:
            self._drop_staged(lambda k, s: s.sender[0] == island)

    # -- what the data server asks --------------------------------------------------------------------------
    def verdict(self, sender: Identity, key: int, shard: Index, dtype: np.dtype) -> str:
        """``OK`` (registered, and the plan names this piece for this sender), ``LATER`` (not registered
        yet), or why the piece is refused."""
        with self._lock:
            if key in self._done:
                return f"receive {key} already finished"
            expected = self._expected.get(key)
        if expected is None:
            return LATER
        return self._check(expected, sender, key, shard, dtype)

    @staticmethod
    def _check(expected: Expected, sender: Identity, key: int, shard: Index, dtype: np.dtype) -> str:
        island, host = sender
        if island != expected.src_island:
            return f"receive {key} comes from island {expected.src_island}, not island {island}"
        if dtype != expected.dtype:
            return f"receive {key} is {expected.dtype.name}, not {dtype.name}"
        if expected.senders is None:
            return OK if _in_bounds(shard, expected.shape) else f"shard {shard} is outside receive {key}"
        shards = expected.senders.get(host)
        if shards is None:
            return f"the plan of receive {key} names no shards from host {host} of island {island}"
        if shard not in shards:
            return f"the plan of receive {key} does not route shard {shard} from host {host} of island {island}"
        return OK

    def target(self, key: int) -> Target | None:
        """Where receive ``key``'s pieces land on this host, if it is registered with that."""
        with self._lock:
            expected = self._expected.get(key)
        return None if expected is None else expected.target

    def reserve(self, nbytes: int) -> bool:
        """Room to land a piece for a receive not registered yet, within the budget of unclaimed bytes."""
        with self._lock:
            self._sweep()
            if self.unclaimed_bytes + nbytes > self.unclaimed_limit:
                return False
            self.unclaimed_bytes += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        """Return ``nbytes`` of the unclaimed budget (a reserved piece that will not be landed)."""
        with self._lock:
            self.unclaimed_bytes -= nbytes

    def landed(self, sender: Identity, key: int, shard: Index, array: Arrived, reserved: bool) -> None:
        """A piece arrived whole: deliver it if its receive is registered (checked again: it may have finished
        meanwhile), else stage it. ``reserved``: it was landed under the unclaimed budget."""
        with self._lock:
            registered = key in self._expected or key in self._done
            if not registered:
                if not reserved:
                    self.unclaimed_bytes += array.nbytes
                self._staged.setdefault(key, []).append(_Staged(sender, shard, array))
                self.staged += 1
                return
            if reserved:
                self.unclaimed_bytes -= array.nbytes
        self._hand_over(sender, key, shard, array)

    def _hand_over(self, sender: Identity, key: int, shard: Index, array: Arrived) -> None:
        with self._lock:
            expected = self._expected.get(key)
        why = "it already finished" if expected is None else self._check(expected, sender, key, shard, array.dtype)
        if why != OK:
            self.refuse(sender, key, shard, why, array.nbytes)
            return
        self._deliver(key, sender, shard, array)

    def refuse(self, sender: Identity, key: int, shard: Index, why: str, nbytes: int) -> None:
        """Count and log a refused piece of ``nbytes`` from ``sender`` for receive ``key``, saying ``why``."""
        with self._lock:
            self.refused += 1
            self.dropped_bytes += nbytes
        log.warning("refused %d bytes of shard %s for receive %d from host %d of island %d: %s", nbytes, shard, key,
                    sender[1], sender[0], why)

    # -- housekeeping (with the lock held) ------------------------------------------------------------------
    def _drop_staged(self, match: Callable[[int, _Staged], bool]) -> None:
        for key in list(self._staged):
            keep = []
            for s in self._staged[key]:
                if match(key, s):
                    self.unclaimed_bytes -= s.array.nbytes
                    self.dropped_bytes += s.array.nbytes
                else:
                    keep.append(s)
            if keep:
                self._staged[key] = keep
            else:
                del self._staged[key]

    def _sweep(self) -> None:
        if not self._staged:
            return
        old = time.monotonic() - self.stale_s
        stale = {k for k, pieces in self._staged.items() if any(s.since < old for s in pieces)}
        if stale:
            log.warning("dropping pieces for receives %s: no fragment claimed them within %.0fs", sorted(stale),
                        self.stale_s)
            self._drop_staged(lambda k, s: s.since < old)

    def stats(self) -> dict:
        """The registry's counters: receives expected, pieces staged, unclaimed bytes, pieces refused, bytes dropped."""
        with self._lock:
            return {"net_expected": len(self._expected), "net_staged": sum(len(v) for v in self._staged.values()),
                    "net_unclaimed_bytes": self.unclaimed_bytes, "net_refused": self.refused,
                    "net_dropped_bytes": self.dropped_bytes}
