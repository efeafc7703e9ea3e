"""The receive side of a host: what peers deliver is filed by receive id until a recv op lands it.

Pieces often arrive before the recv op that takes them is admitted (sends
never wait), so they wait in a mailbox keyed by the receive id, tagged with
the host that sent them. A recv op accepts only pieces from the source island
and hosts its plan names; anything else is refused and its lease returned.
Every mailbox is bounded: pieces for a receive that already finished (or
failed) go straight back to their sender, and a mailbox no recv op claims
within the op timeout is dropped, so a sender never keeps lent memory for a
receive that will not come. Mailboxes belong to the tenant whose client minted
the receive id, and count against its ``mailboxes`` and ``parked_bytes``
budgets: a piece that would take the tenant over one is refused, and its
receive fails at once with a ResourceError naming the budget; no other
tenant's receive is affected.

A receive is landed as soon as all its pieces are here and its recv op was
admitted (``expect`` with the landing), on a landing thread, while the
executor still works through earlier ops: shards lent by a sender on this
node are copied out of it, pieces that arrived whole are regathered into the
devices' regions. A weight sync's many receives then land while the executor
spends its time on each op's bookkeeping, instead of after it. A landing
thread takes every receive that is ready when it comes free (up to
``BATCH_BYTES``) and lands them as one unit (``transfer.assemble_all``): one
hand-off for the lot, the cores copying across the receives' boundaries. The
landed array counts against the tenant's ``parked_bytes`` until its recv op
takes it, in place of the pieces it was made of (over that budget it waits for
the op, which lands it then).

On a multi-host island a recv op must not hold the island's order while its
data is on the way (two islands exchanging data could each wait on the
other): the executor parks the run, and this side reports when the data has
landed here (``watch`` / ``take_landed``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pathways.budgets import Budgets, over
from pathways.errors import IslandFailedError, to_wire
from pathways.messages import Deliver
from pathways.ops import MAX_SHARDS, Expect, Recv, Region
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.transfer import PLANS, Landing, all_lent, all_scattered, assemble, assemble_all
from resource_manager.host.transport.direct import Lent
from resource_manager.host.transport.network.scatter import Scattered
from resource_manager.host.transport.peers import Peers

Sender = tuple[int, int]  # (island, host)
MAX_MAILBOXES = 1 << 16
FINISHED = 1 << 16  # receive ids remembered as done, so late pieces go straight back
LANDERS = 2  # batches landed ahead of their ops at once (one copies while the other hands its buffers to JAX)
BATCH_BYTES = 64 << 20  # the most bytes a landing thread takes at once (more wait for the next batch)
GATHER_BYTES = 1 << 20  # a receive whose pieces are in this host's memory is landed ahead of its op from this size
log = logging.getLogger(__name__)


@dataclass
class Mailbox:
    """What arrived for one receive id, by sender: a piece from one host never displaces another's."""

    tenant: str
    pieces: dict[tuple[Sender, Region], Any] = field(default_factory=dict)  # np.ndarray | Lent | Scattered
    failure: Failure | None = None
    since: float = field(default_factory=time.monotonic)
    nbytes: int = 0

    def count(self, allowed: frozenset[Sender]) -> int:
        """Pieces from the ``allowed`` senders."""
        return sum(1 for sender, _ in self.pieces if sender in allowed)


@dataclass
class _Watch:
    """A parked recv op waiting for its pieces on this host (multi-host islands)."""

    seq: int
    pc: int
    count: int
    allowed: frozenset[Sender]
    src: int
    since: float = field(default_factory=time.monotonic)


def _piece_bytes(piece: Any) -> int:
    """Bytes a delivered piece holds in this host's memory (a lent one stays in its sender's, which counts it)."""
    return 0 if isinstance(piece, Lent) else int(getattr(piece, "nbytes", 0))


class Receiver:
    """Files delivered pieces and runs recv ops. Thread-safe: it owns its lock, and tells the executor that
    something landed through ``touch``."""

    def __init__(self, island: int, host: int, table: BufferTable, pool: BufferPool, peers: Peers,
                 op_timeout: float, touch: Callable[[], None],
                 owner: Callable[[int], tuple[str, Budgets] | None] | None = None) -> None:
        self.island, self.host = island, host
        self.table, self.pool, self.peers = table, pool, peers
        self._lock = threading.RLock()
        self.op_timeout = op_timeout
        self._touch = touch
        self._owner = owner or (lambda key: ("", Budgets()))
        self.mailbox: dict[int, Mailbox] = {}
        self._held: dict[str, list[int]] = {}  # tenant -> [mailboxes, parked bytes]
        self._refusals: OrderedDict[int, Failure] = OrderedDict()  # receives failed by a budget
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._watches: dict[int, _Watch] = {}
        self._landed: list[tuple[int, int]] = []
        self._ready: dict[int, tuple[frozenset[Sender], int, Landing]] = {}  # admitted: senders, count, landing
        self._landing: dict[int, Future] = {}  # receives being landed ahead of their op
        self._queued: deque[tuple[int, Landing, dict, Future]] = deque()  # of those, the ones no lander took yet
        self._draining = 0  # landing threads at work
        self._landers = ThreadPoolExecutor(max_workers=LANDERS, thread_name_prefix="landing")
        self.failed_islands: set[int] = set()
        self.bytes_in = 0
        self.bytes_in_direct = 0
        self.refused = 0
        self.early = 0  # receives landed ahead of their op
        self.batches = 0  # landings of ready receives as one unit

    # -- filing -------------------------------------------------------------------------------------------
    def deliver(self, msg: Deliver, pieces: Sequence[Any], sender: Sender) -> None:
        """File pieces from ``sender`` for receive ``msg.key``; the executor is told unless the receive's op, admitted,
        still waits for more of them (a weight sync's receive gets several pieces: waking the executor for each
        cost the receiving thread a hand-over of the interpreter lock per piece)."""
        with self._lock:
            waiting = self._file(msg, pieces, sender)
        if not waiting:
            self._touch()

    def _file(self, msg: Deliver, pieces: Sequence[Any], sender: Sender) -> bool:
        """File the pieces (the lock held); True when the receive's op was admitted and still waits for pieces that
        have not come, so nothing the executor runs can change yet."""
        key = msg.key
        box = self.mailbox.get(key)
        if key in self._finished or key in self._refusals or key in self._landing or \
                (box is None and len(self.mailbox) >= MAX_MAILBOXES):
            self._give_back(pieces)  # (a receive being landed has all its pieces: what comes now is extra)
            return False
        nbytes = sum(_piece_bytes(p) for p in pieces)
        if box is None:
            owner = self._owner(key)
            if owner is None:  # no session minted this id: nobody will ever claim it
                self._give_back(pieces)
                return False
            tenant, budgets = owner
            held = self._held.setdefault(tenant, [0, 0])
            if held[0] >= budgets.mailboxes:
                self._refuse(key, pieces, over("mailboxes", held[0], 1, budgets.mailboxes, "receives"))
                return False
            box = self.mailbox[key] = Mailbox(tenant)
            held[0] += 1
        held = self._held[box.tenant]
        budget = self._owner(key)
        limit = budget[1].parked_bytes if budget is not None else 0
        if held[1] + nbytes > limit:
            self._drop_box(key)
            self._refuse(key, pieces, over("parked_bytes", held[1], nbytes, limit, "bytes"))
            return False
        if msg.failure is not None:
            box.failure = Failure(*msg.failure)
        for shard, data in zip(msg.shards, pieces):
            if len(box.pieces) >= MAX_SHARDS:
                self._give_back([data])
                continue
            old = box.pieces.pop((sender, shard), None)
            if old is not None:
                self._give_back([old])
                box.nbytes -= _piece_bytes(old)
                held[1] -= _piece_bytes(old)
            box.pieces[(sender, shard)] = data
            box.nbytes += _piece_bytes(data)
            held[1] += _piece_bytes(data)
            if isinstance(data, (np.ndarray, Scattered)):
                self.bytes_in += data.nbytes
        watch = self._watches.get(key)
        if watch is not None and self._complete(box, watch.count, watch.allowed):
            self._land_watch(key)
        ready = self._ready.get(key)
        if ready is None:
            return False
        self._land_early(key, box)
        return watch is None and not self._complete(box, ready[1], ready[0])

    def _land_early(self, key: int, box: Mailbox) -> None:
        """Queue a receive for a landing thread, if its op was admitted, every piece is here, and its tenant's
        ``parked_bytes`` hold the array (the lock held): lent pieces are copied out of their sender, pieces that
        arrived whole (over the network) are regathered into the devices' regions (from ``GATHER_BYTES``), while
        the executor still works through earlier ops. Pieces scattered into the devices' regions as they arrived
        wait for the op: it has (nearly) nothing left to copy."""
        allowed, count, landing = self._ready[key]
        if key in self._landing or box.failure is not None or box.count(allowed) < count:
            return
        pieces = {region: data for (sender, region), data in box.pieces.items() if sender in allowed}
        extra = landing.nbytes - sum(_piece_bytes(p) for p in pieces.values())  # pieces here become the array
        if (landing.nbytes < GATHER_BYTES and not all_lent(pieces)) or (all_scattered(pieces) and extra < GATHER_BYTES):
            return  # a few bytes to copy in this host's memory, or none: its op lands them sooner than a hand-off
        held = self._held[box.tenant]
        budget = self._owner(key)
        if budget is None or held[1] + max(0, extra) > budget[1].parked_bytes:
            return  # its op lands it, under the host_bytes budget it checks then
        box.nbytes += extra
        held[1] += extra
        future = self._landing[key] = Future()
        self._queued.append((key, landing, pieces, future))
        if self._draining < LANDERS:
            self._draining += 1
            self._landers.submit(self._drain)

    def _drain(self) -> None:
        """Land queued receives, all that are queued at once (up to ``BATCH_BYTES``), until none are left."""
        while True:
            with self._lock:
                batch: list[tuple[int, Landing, dict, Future]] = []
                nbytes = 0
                while self._queued and (not batch or nbytes + self._queued[0][1].nbytes <= BATCH_BYTES):
                    item = self._queued.popleft()
                    if item[3].set_running_or_notify_cancel():  # not dropped, nor taken by its op, while it waited
                        batch.append(item)
                        nbytes += item[1].nbytes
                if not batch and not self._queued:
                    self._draining -= 1
                    return
            self._land(batch)

    def _land(self, batch: list[tuple[int, Landing, dict, Future]]) -> None:
        """Land ``batch`` as one unit; if that fails, each receive on its own, so only the one whose sender failed
        fails (its op raises the error)."""
        try:
            arrays = assemble_all([(landing, pieces) for _, landing, pieces, _ in batch], self.pool.take)
        except Exception as exc:  # for its recv op to raise
            if len(batch) > 1:
                for item in batch:
                    self._land([item])
            else:
                batch[0][3].set_exception(exc)
            return
        with self._lock:
            self.batches += 1
            for (key, _, pieces, future), array in zip(batch, arrays):
                pieces.clear()
                if self._landing.get(key) is future:
                    self._free_gathered(key)
                future.set_result(array)

    def _free_gathered(self, key: int) -> None:
        """Let go of a landed receive's pieces that were in this host's memory (their bytes were counted toward the
        array when it was queued); they stay named, as ``None``, so the receive still counts as complete (the lock
        held)."""
        box = self.mailbox.get(key)
        if box is not None:
            for slot, data in box.pieces.items():
                if _piece_bytes(data):
                    box.pieces[slot] = None

    def _refuse(self, key: int, pieces: Sequence[Any], error: Exception) -> None:
        """Refuse what arrived for ``key`` over its tenant's budget; its receive fails with ``error`` when it
        runs (or at once, if it is waiting)."""
        self.refused += len(pieces)
        self._give_back(pieces)
        if key not in self._refusals:
            log.warning("island %d host %d refused receive %d: %s", self.island, self.host, key, error)
        self._refusals[key] = Failure(*to_wire(error))
        while len(self._refusals) > FINISHED:
            self._refusals.popitem(last=False)
        watch = self._watches.get(key)
        if watch is not None:
            self._land_watch(key)

    def _drop_box(self, key: int) -> Mailbox | None:
        """Remove a mailbox and take its tenant's counts back."""
        box = self.mailbox.pop(key, None)
        if box is not None:
            held = self._held[box.tenant]
            held[0] -= 1
            held[1] -= box.nbytes
            if held == [0, 0]:
                del self._held[box.tenant]
        return box

    def held(self, tenant: str) -> tuple[int, int]:
        """(mailboxes, parked bytes) ``tenant`` holds on this host now."""
        with self._lock:
            mailboxes, nbytes = self._held.get(tenant, (0, 0))
            return mailboxes, nbytes

    def _give_back(self, pieces: Sequence[Any]) -> None:
        lent = [p for p in pieces if isinstance(p, Lent)]
        if lent:
            self.peers.give_back(lent)

    def _finish(self, key: int) -> None:
        self._finished[key] = None
        while len(self._finished) > FINISHED:
            self._finished.popitem(last=False)
        if self.peers.network is not None:  # late pieces over the network are refused, partial ones released
            self.peers.network.finished(key)
        self._ready.pop(key, None)
        early = self._landing.pop(key, None)  # a copy still under way is dropped with its result
        if early is not None:
            early.cancel()  # (one not yet started never starts)

    def expect(self, key: int, op: Recv, expect: Expect | None = None, landing: Landing | None = None) -> None:
        """A fragment with this receive was admitted: the network path may take its pieces (the plan's only), and
        with ``expect`` and ``landing`` (what lands on this host, and where) lent pieces may be copied as soon as
        they are all here."""
        if self.peers.network is not None:
            self.peers.network.expect(key, op, None if landing is None else landing.regions)
        if expect is None or landing is None:
            return
        with self._lock:
            if key in self._finished or key in self._refusals:
                return
            self._ready[key] = (frozenset((op.src, s) for s in expect.senders), expect.count, landing)
            while len(self._ready) > MAX_MAILBOXES:  # bounded like the mailboxes: the oldest lands by its op
                self._ready.pop(next(iter(self._ready)))
            box = self.mailbox.get(key)
            if box is not None:
                self._land_early(key, box)

    def drop(self, key: int) -> None:
        """The receive failed or will never run: return what was lent for it, refuse what comes later."""
        with self._lock:
            box = self._drop_box(key)
            self._finish(key)
            self._watches.pop(key, None)
        if box is not None:
            self._give_back(list(box.pieces.values()))

    @staticmethod
    def _complete(box: Mailbox, count: int, allowed: frozenset[Sender]) -> bool:
        return box.failure is not None or box.count(allowed) >= count

    # -- recv ops -----------------------------------------------------------------------------------------
    def recv(self, key: int, op: Recv, expect: Expect, landing: Landing, tenant: str, label: str,
             final: bool) -> bool:
        """Land receive ``key`` as a buffer of ``tenant``; False while its pieces are still on the way
        (``final``: they will not come any more, so that is a failure)."""
        allowed = frozenset((op.src, s) for s in expect.senders)
        with self._lock:
            refused = self._refusals.pop(key, None)
            if refused is not None:
                box = self._drop_box(key)
                if box is not None:
                    self._give_back(list(box.pieces.values()))
                self._finish(key)
                self.table.put(key, tenant, refused)
                return True
            box = self.mailbox.get(key)
            if box is not None:
                self._refuse_foreign(key, box, allowed)
            if box is None or not self._complete(box, expect.count, allowed):
                if op.src in self.failed_islands:
                    raise IslandFailedError(f"island {op.src} failed before its transfer to island {self.island} "
                                            f"(program {label!r}) arrived")
                if final:
                    raise IslandFailedError(f"island {self.island} waited {self.op_timeout:.0f}s for a transfer from "
                                            f"island {op.src} (program {label!r}); that island is dead or stuck")
                return False
            self._drop_box(key)
            early = self._landing.pop(key, None)
            if early is not None and early.cancel():
                early = None  # no lander took it yet: landed here instead
            self._finish(key)
        if box.failure is not None:
            self._give_back(list(box.pieces.values()))
            self.table.put(key, tenant, box.failure)
            return True
        try:
            if early is not None:
                array = early.result(timeout=self.op_timeout)
                self.early += 1
            else:
                array = assemble(landing, {region: data for (_, region), data in box.pieces.items()},
                                 self.pool.take)
        except TimeoutError as exc:
            raise IslandFailedError(f"copying the shards island {op.src} lent to island {self.island} (program "
                                    f"{label!r}) took over {self.op_timeout:.0f}s") from exc
        except OSError as exc:
            raise IslandFailedError(f"copying the shards island {op.src} lent to island {self.island} "
                                    f"(program {label!r}) failed: {exc}; the sending host died") from exc
        finally:
            self._give_back(list(box.pieces.values()))
        lent = [p for p in box.pieces.values() if isinstance(p, Lent)]
        if lent:
            nbytes = sum(math.prod(b - a for a, b in p.index) for p in lent) * landing.dtype.itemsize
            self.bytes_in += nbytes
            self.bytes_in_direct += nbytes
        self.table.put(key, tenant, array)
        return True

    def _refuse_foreign(self, key: int, box: Mailbox, allowed: frozenset[Sender]) -> None:
        foreign = [k for k in box.pieces if k[0] not in allowed]
        if not foreign:
            return
        self.refused += len(foreign)
        log.warning("island %d host %d refused %d piece(s) for receive %d from hosts %s that its plan does not "
                    "name", self.island, self.host, len(foreign), key, sorted({sender for sender, _ in foreign}))
        dropped = [box.pieces.pop(k) for k in foreign]
        nbytes = sum(_piece_bytes(p) for p in dropped)
        box.nbytes -= nbytes
        self._held[box.tenant][1] -= nbytes
        self._give_back(dropped)

    # -- parked recv ops (multi-host islands) -----------------------------------------------------------
    def watch(self, seq: int, pc: int, key: int, op: Recv, expect: Expect | None) -> None:
        """Report (seq, pc) through ``take_landed`` once this host's pieces for ``key`` are here (at once if
        none come here), or the wait timed out."""
        with self._lock:
            if expect is None:
                self._landed.append((seq, pc))
                return
            allowed = frozenset((op.src, s) for s in expect.senders)
            self._watches[key] = _Watch(seq, pc, expect.count, allowed, op.src)
            box = self.mailbox.get(key)
            if (box is not None and self._complete(box, expect.count, allowed)) or op.src in self.failed_islands:
                self._land_watch(key)

    def _land_watch(self, key: int) -> None:
        watch = self._watches.pop(key)
        self._landed.append((watch.seq, watch.pc))

    def take_landed(self) -> list[tuple[int, int]]:
        """(seq, pc) of parked recv ops whose data landed or will not come, since the last call."""
        with self._lock:
            landed, self._landed = self._landed, []
            return landed

    def expire(self) -> float:
        """Time out watches and unclaimed mailboxes; returns seconds until the next one may expire."""
        now = time.monotonic()
        horizon = now - self.op_timeout
        with self._lock:
            for key, watch in list(self._watches.items()):
                if watch.since < horizon:
                    self._land_watch(key)
            stale = [k for k, box in self.mailbox.items() if box.since < horizon - self.op_timeout]
            boxes = []
            for key in stale:
                boxes.append(self._drop_box(key))
                self._finish(key)
            oldest = min([w.since for w in self._watches.values()], default=now + self.op_timeout)
        for box in boxes:
            self._give_back(list(box.pieces.values()))
        return max(0.001, oldest + self.op_timeout - now)

    def island_failed(self, island: int) -> None:
        """``island`` failed: receives from it stop waiting (parked ones are reported landed, to fail when they run)."""
        with self._lock:
            self.failed_islands.add(island)
            for key, watch in list(self._watches.items()):
                if watch.src == island:
                    self._land_watch(key)
        self._touch()

    def island_restored(self, island: int) -> None:
        """A failed island restarted: receives from its new hosts may wait for them again."""
        with self._lock:
            self.failed_islands.discard(island)

    def stats(self) -> dict[str, int]:
        """The receive side's counters: open mailboxes, bytes received (and of those copied from lent memory),
        pieces refused, receives landed ahead of their op and the batches they landed in, and the copy plans of lent
        pieces (kept, their bytes, made, reused)."""
        return {"mailbox": len(self.mailbox), "bytes_in": self.bytes_in, "bytes_in_direct": self.bytes_in_direct,
                "refused_pieces": self.refused, "landed_early": self.early, "landing_batches": self.batches,
                **PLANS.stats()}
