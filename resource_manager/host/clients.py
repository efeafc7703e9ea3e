"""A host's client endpoint: tenants' processes talk to the host here, never through Ray.

Each connection was proven for one session in its handshake (``resource_manager.endpoint``); its requests
(``pathways.requests.HOST_REQUESTS``) go through one table from request class to handler. A connection has
its reader (this module's ``serve``) and its own writer thread with a bounded queue, so a client that stops
reading its answers only stalls itself. No request holds a thread while it waits: a fetch of a value that is
not there yet registers a callback with the buffer table and a deadline here, within the tenant's
``pending_fetches`` budget, and its answer is written when the value arrives or the deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pathways import wire
from pathways.budgets import over
from pathways.errors import PathwaysError, TenantAccessError, WireFormatError, from_wire, to_wire
from pathways.messages import client_of
from pathways.names import FETCH_TIMED_OUT
from pathways.ops import MAX_SHARDS, region_of
from pathways.protocol.connection import Connection
from pathways.protocol.frames import FrameError, OverBudget
from pathways.protocol.handshake import Identity
from pathways.requests import (
    HOST_REQUESTS,
    Answer,
    Batch,
    Fetch,
    HostStats,
    Ping,
    Position,
    PutData,
    ScheduleStats,
    Stalled,
    TraceStart,
    TraceStop,
    Usage,
)
from pathways.sharding import dtype_from_wire
from resource_manager.endpoint import Caller, Endpoint, refuse_frame
from resource_manager.host.buffers import Failure
from resource_manager.host.grants import Session
from resource_manager.host.order import IslandOrder
from resource_manager.host.transfer import Landed, local_pieces
from resource_manager.host.views import HostViews

if TYPE_CHECKING:
    from resource_manager.host.wiring import Parts

MAX_MESSAGE = 1 << 30  # a batch may carry executables
WRITER_QUEUE = 1024  # answers waiting to be written on one connection
MAX_FETCH_WAIT_S = 24 * 3600.0
log = logging.getLogger(__name__)


class Writer:
    """One connection's answers, written in order by a thread of its own.

    Answers the reader queues take room (``WRITER_QUEUE`` at most): a client that stops reading its answers
    stops having its requests read. A fetch's late answer (its value arrived) takes none: those are bounded by
    the tenant's ``pending_fetches`` budget, and queueing them never blocks whoever made the value.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.waiting: list[tuple[int, Callable[[], None], _Pending, str]] = []  # this connection's fetches that wait
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(WRITER_QUEUE)
        self._thread = threading.Thread(target=self._run, name="client-writer", daemon=True)
        self._thread.start()

    def answer(self, rid: int, make: Callable[[], tuple[Any, list]]) -> None:
        """Queue the answer to ``rid``: ``make()`` (run on the writer thread) gives its value and data buffers,
        or raises the error to answer instead. Blocks while the queue is full."""
        self._room.acquire()
        self._queue.put((rid, make, True))

    def answer_now(self, rid: int) -> None:
        """Answer ``rid`` with its receipt from the reader's own thread: nothing to make, due at once, so no hand-off
        to the writer's thread (answers are matched by number, not order). Blocks while the client does not read,
        as ``answer`` does."""
        self._conn.send(Answer(rid, True, None).encode())

    def answer_later(self, rid: int, make: Callable[[], tuple[Any, list]]) -> None:
        """Queue a waiting fetch's answer; never blocks."""
        self._queue.put((rid, make, False))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            rid, make, roomed = item
            try:
                value, data = make()
                payload = Answer(rid, True, value).encode()
            except Exception as exc:  # the error is the answer; the connection goes on
                payload, data = Answer(rid, False, list(to_wire(exc))).encode(), []
            finally:
                if roomed:
                    self._room.release()
            try:
                self._conn.send(payload, data)
            except OSError:
                self._conn.close()
                return

    def close(self) -> None:
        """Stop after what is queued (the connection is ending)."""
        self._queue.put(None)


class _Pending:
    """A fetch waiting for its value: answered exactly once, by the value's arrival or by its deadline (both
    decide under the buffer table's lock)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class ClientService:
    """The host's endpoint for clients, and the per-tenant bookkeeping of what they wait for."""

    def __init__(self, order: IslandOrder, views: HostViews, parts: Parts, identity: Identity, ip: str) -> None:
        self.order, self.views, self.parts = order, views, parts
        self.island, self.index = identity.island, identity.host
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # tenant -> fetches waiting on this host
        self._deadlines: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Event()
        self.fetches = 0
        self.timed_out = 0
        self._handlers: dict[type, Callable[[Connection, Writer, Session, Any, int], None]] = {
            Batch: self._batch, PutData: self._put_data, Fetch: self._fetch, Stalled: self._stalled,
            Usage: self._usage, TraceStart: self._trace_start, TraceStop: self._trace_stop,
            HostStats: self._host_stats, ScheduleStats: self._schedule_stats, Ping: self._ping,
            Position: self._position,
        }
        self.endpoint = Endpoint(identity, ip, self._caller, self._serve, anonymous=False, max_payload=MAX_MESSAGE,
                                 max_data=parts.limits.memory_bytes, name=f"host-{identity.island}.{identity.host}")
        threading.Thread(target=self._expire, name="fetch-deadlines", daemon=True).start()

    @property
    def address(self) -> str:
        """Where clients connect: ``pathways://IP:PORT``."""
        return self.endpoint.address

    def _caller(self, client: int) -> Caller | None:
        session = self.parts.grants.session(client)
        if session is None:
            return None
        budgets = self.parts.grants.budgets(session.tenant)
        return Caller(session.key, session.tenant, budgets.connections, budgets.frame_bytes)

    def close_session(self, client: int) -> None:
        """The session ended: close its connections (its pending fetches are dropped with them)."""
        self.endpoint.close_session(client)

    # -- one connection -----------------------------------------------------------------------------------
    def _serve(self, conn: Connection, caller: Caller | None) -> None:
        session = self.parts.grants.session(conn.session)
        if session is None:
            return
        writer = Writer(conn)
        try:
            while True:
                frame = conn.recv()
                try:
                    request = wire.parse(frame.payload, *HOST_REQUESTS)
                except PathwaysError as exc:
                    conn.skip(frame.data)
                    writer.answer(-1, _raiser(WireFormatError(f"a request this host cannot read: {exc}")))
                    continue
                if self.parts.grants.session(session.client) is None:
                    return  # the session ended meanwhile
                self._handlers[type(request)](conn, writer, session, request, frame.data)
        except OverBudget as exc:
            refuse_frame(conn, exc)
        except (ConnectionError, OSError, FrameError) as exc:
            log.debug("island %d host %d: a connection of client %d ended: %s", self.island, self.index,
                      session.client, exc)
        finally:
            writer.close()
            for buffer_id, answer, pending, tenant in writer.waiting:  # nobody will read their answers
                self.parts.table.forget(buffer_id, answer)  # after this, ``answer`` can no longer run
                if not pending.done:
                    pending.done = True
                    self._release(tenant)

    # -- the stream and uploads -----------------------------------------------------------------------------
    def _batch(self, conn: Connection, writer: Writer, session: Session, batch: Batch, data: int) -> None:
        conn.skip(data)
        try:
            self.order.submit(session, batch.first, batch.msgs)
        except PathwaysError as exc:  # the batch as a whole is wrong (numbering): this client's own problem
            writer.answer(batch.rid, _raiser(exc))
            return
        writer.answer_now(batch.rid)

    def _position(self, conn: Connection, writer: Writer, session: Session, request: Position, data: int) -> None:
        conn.skip(data)
        admission = self.order.admission
        if admission is None:
            writer.answer(request.rid, _raiser(PathwaysError(f"host {self.index} keeps no client streams; "
                                                             "host 0 does")))
            return
        position = admission.position(session.client)
        writer.answer(request.rid, lambda: (position, []))

    def _put_data(self, conn: Connection, writer: Writer, session: Session, put: PutData, data: int) -> None:
        try:
            shapes, nbytes = self._check_put(session, put)
            if nbytes != data:
                raise WireFormatError(f"put_data: the shards take {nbytes} bytes but the frame carries {data}")
            self.parts.uploads.reserve(put.id, session.tenant, nbytes,
                                       self.parts.grants.budgets(session.tenant).parked_bytes)
        except PathwaysError as exc:
            conn.skip(data)
            if client_of(put.id) == session.client:
                self.parts.uploads.refuse(put.id, session.tenant, Failure(*to_wire(exc)))  # its put fails with it
            return
        dtype = dtype_from_wire(put.dtype)
        pieces = {}
        try:
            for region, shape in zip(put.shards, shapes):
                array = self.parts.pool.take(shape, dtype).view(Landed)  # a device's whole region is adopted as is
                conn.read_into(memoryview(array.reshape(-1).view(np.uint8)))
                pieces[region_of(region)] = array
        except BaseException:
            self.parts.uploads.cancel(put.id)
            raise
        self.parts.uploads.fill(put.id, pieces)

    def _check_put(self, session: Session, put: PutData) -> tuple[list[tuple[int, ...]], int]:
        if client_of(put.id) != session.client or put.id <= 0:
            raise TenantAccessError(f"put {put.id} is not one of your client's ids")
        if not put.shards or len(put.shards) > MAX_SHARDS:
            raise WireFormatError(f"put_data: 1 to {MAX_SHARDS} shards, not {len(put.shards)}")
        try:
            dtype = dtype_from_wire(put.dtype)
        except Exception:  # numpy and ml_dtypes raise various types on unknown names
            raise WireFormatError(f"put_data: unknown dtype {put.dtype!r}") from None
        shapes, total = [], 0
        for region in put.shards:
            if not all(len(r) == 2 and 0 <= r[0] < r[1] for r in region):
                raise WireFormatError(f"put_data: {region} is not a list of [start, stop) ranges")
            shape = tuple(b - a for a, b in region)
            shapes.append(shape)
            total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if total > self.parts.limits.memory_bytes:
            raise PathwaysError(f"put_data: {total} bytes do not fit this host")
        return shapes, total

    # -- fetches --------------------------------------------------------------------------------------------
    def _fetch(self, conn: Connection, writer: Writer, session: Session, fetch: Fetch, data: int) -> None:
        conn.skip(data)
        tenant = session.tenant
        if client_of(fetch.id) != session.client:
            writer.answer(fetch.rid, _raiser(TenantAccessError(f"buffer {fetch.id} is not one of your client's "
                                                               "buffers")))
            return
        self.fetches += 1
        budget = self.parts.grants.budgets(tenant).pending_fetches
        with self._lock:
            held = self._pending.get(tenant, 0)
            if held < budget:
                self._pending[tenant] = held + 1
        if held >= budget:
            writer.answer(fetch.rid, _raiser(over("pending_fetches", held, 1, budget, "fetches")))
            return
        pending = _Pending()

        def answer() -> None:  # the value is there (called with the buffer table's lock held: only queue work)
            if not pending.done:
                pending.done = True
                self._release(tenant)
                writer.answer_later(fetch.rid, lambda: self._read(fetch, tenant))

        if self.parts.table.when_ready(fetch.id, tenant, answer) is not None:
            self._release(tenant)
            writer.answer(fetch.rid, lambda: self._read(fetch, tenant))
            return
        writer.waiting.append((fetch.id, answer, pending, tenant))
        if len(writer.waiting) > 64:  # forget the answered ones now and then: the list stays short
            writer.waiting[:] = [w for w in writer.waiting if not w[2].done]

        def expire() -> None:
            self.parts.table.forget(fetch.id, answer)  # after this, ``answer`` can no longer run
            if not pending.done:
                pending.done = True
                self._release(tenant)
                self.timed_out += 1
                writer.answer_later(fetch.rid, lambda: (FETCH_TIMED_OUT, []))

        self._at(time.monotonic() + min(fetch.timeout, MAX_FETCH_WAIT_S), expire)

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._pending[tenant] -= 1
            if not self._pending[tenant]:
                del self._pending[tenant]

    def _read(self, fetch: Fetch, tenant: str) -> tuple[Any, list]:
        """The answer to a fetch whose value is there: this host's distinct shards, as regions and bytes."""
        entry = self.parts.table.lookup(fetch.id, tenant)
        if entry is None:
            raise PathwaysError(f"buffer {fetch.id} was freed before it could be read")
        value = entry.value
        if isinstance(value, Failure):
            raise from_wire(value.kind, value.message)
        if fetch.ready_only:
            value.block_until_ready()
            return None, []
        pieces = local_pieces(value)
        datas = [np.ascontiguousarray(np.asarray(p)) for p in pieces.values()]
        return ({"shape": list(value.shape), "dtype": str(value.dtype), "pieces": [list(map(list, r)) for r in pieces]},
                datas)

    def _at(self, when: float, call: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._deadlines, (when, next(self._order), call))
        self._wake.set()

    def _expire(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    due.append(heapq.heappop(self._deadlines)[2])
                wait = self._deadlines[0][0] - now if self._deadlines else 1.0
            for call in due:
                try:
                    call()
                except Exception:  # one deadline's failure never stops the others
                    log.exception("a fetch deadline failed")
            self._wake.wait(min(max(wait, 0.001), 1.0))
            self._wake.clear()

    # -- small requests ---------------------------------------------------------------------------------------
    def _stalled(self, conn: Connection, writer: Writer, session: Session, req: Stalled, data: int) -> None:
        conn.skip(data)
        writer.answer(req.rid, lambda: (self.views.stalled(session.tenant), []))

    def _usage(self, conn: Connection, writer: Writer, session: Session, req: Usage, data: int) -> None:
        conn.skip(data)
        writer.answer(req.rid, lambda: (self.views.usage(session.tenant, req.reset_peak), []))

    def _trace_start(self, conn: Connection, writer: Writer, session: Session, req: TraceStart, data: int) -> None:
        conn.skip(data)
        writer.answer(req.rid, lambda: (self.views.trace_start(session.client), []))

    def _trace_stop(self, conn: Connection, writer: Writer, session: Session, req: TraceStop, data: int) -> None:
        conn.skip(data)
        writer.answer(req.rid, lambda: (self.views.trace_stop(session.client, session.tenant), []))

    def _host_stats(self, conn: Connection, writer: Writer, session: Session, req: HostStats, data: int) -> None:
        conn.skip(data)
        writer.answer(req.rid, lambda: (self.views.stats(), []))

    def _schedule_stats(self, conn: Connection, writer: Writer, session: Session, req: ScheduleStats,
                        data: int) -> None:
        conn.skip(data)
        if self.order.scheduler is None:
            writer.answer(req.rid, _raiser(PathwaysError("only host 0 of an island holds its scheduler")))
            return
        writer.answer(req.rid, lambda: (self.views.schedule_stats(session.tenant), []))

    def _ping(self, conn: Connection, writer: Writer, session: Session, req: Ping, data: int) -> None:
        conn.skip(data)
        dead = self.views.dead
        if dead is not None:
            writer.answer(req.rid, _raiser(PathwaysError(dead)))
            return
        writer.answer(req.rid, lambda: (time.time(), []))

    def stats(self) -> dict:
        """The endpoint's counters (no tenant named)."""
        with self._lock:
            pending = sum(self._pending.values())
        return {**{f"client_{k}": v for k, v in self.endpoint.stats().items()}, "fetches": self.fetches,
                "fetches_pending": pending, "fetches_timed_out": self.timed_out}


def _raiser(exc: Exception) -> Callable[[], tuple[Any, list]]:
    """An answer that is ``exc``, keeping only its kind and message: an exception keeps its traceback's frames, and
    with them the request that failed (a batch of a gigabyte, say) for as long as the answer waits to be written."""
    kind, message = to_wire(exc)

    def make() -> tuple[Any, list]:
        raise from_wire(kind, message)
    return make
