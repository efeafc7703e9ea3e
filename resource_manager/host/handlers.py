"""What each op does on a host: exec, put, send, reshard (and recv, through the receive side).

A handler returns False while its inputs are not there yet; an input that
holds a failure makes it raise ``Failed`` with that failure, which the
executor writes to the op's outputs. Host-local facts about a template's ops
(this host's routes, where a receive lands, whether it takes part at all) are
worked out on the op's first run and kept here, keyed by the template, never
written into the shared op objects.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from pathways.budgets import Budgets
from pathways.errors import ProgramError, to_wire
from pathways.events import EventLog
from pathways.messages import Deliver
from pathways.ops import Exec, Op, Recv, Reshard, Route, Send, SliceDesc, Template
from pathways.sharding import dtype_from_wire
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.buffers import BufferTable, Entry, Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.executables import Compiled, ExecutableCache
from resource_manager.host.receive import Receiver
from resource_manager.host.run import Place, Run
from resource_manager.host.transfer import Landing, assemble, local_pieces
from resource_manager.host.transport.peers import Peers
from resource_manager.host.uploads import Uploads

PREPARED = 1024  # templates whose host-local op facts are kept
log = logging.getLogger(__name__)


class Failed(Exception):
    """An op's input holds a failure (or the op cannot run): its outputs get ``failure``."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class Handlers:
    """The op handlers of one host, given the parts they use."""

    def __init__(self, island: int, host: int, devices: LocalDevices, table: BufferTable, exes: ExecutableCache,
                 peers: Peers, pool: BufferPool, receiver: Receiver, uploads: Uploads, events: EventLog,
                 op_timeout: float, budgets: Callable[[str], Budgets] = lambda tenant: Budgets()) -> None:
        self.island, self.host = island, host
        self.budgets = budgets
        self.devices, self.table, self.exes, self.uploads = devices, table, exes, uploads
        self.peers, self.pool, self.receiver, self.events = peers, pool, receiver, events
        self.op_timeout = op_timeout
        self._prepared: OrderedDict[Template, list[Any]] = OrderedDict()
        self._sender = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"send-{island}.{host}")
        self.bytes_out = 0
        # One table from op class to what it does; each takes (run, op, final).
        self._handlers: dict[type, Callable[[Run, Any, bool], bool]] = {
            Exec: self._exec, Send: self._send, Recv: self._recv, Reshard: self._reshard, Place: self._place,
        }

    def run(self, run: Run, op: Op, final: bool) -> bool:
        """Run ``op`` of ``run``; False while its inputs are missing (``final``: a resumed receive)."""
        handler = self._handlers.get(type(op))
        if handler is None:
            raise ProgramError(f"unknown op {op!r}")
        return handler(run, op, final)

    def stop(self) -> None:
        """Stop the background senders; sends not yet started are dropped."""
        self._sender.shutdown(wait=False, cancel_futures=True)

    # -- host-local facts about a template's ops -----------------------------------------------------------
    def _local(self, run: Run, op: Op) -> Any:
        template = run.template
        facts = self._prepared.get(template)
        if facts is None:
            facts = self._prepared[template] = [None] * len(template.ops)
            while len(self._prepared) > PREPARED:
                self._prepared.popitem(last=False)
        k = run.pc
        fact = facts[k]
        if fact is None:
            fact = facts[k] = self._work_out(template, op)
        return fact

    def _work_out(self, template: Template, op: Op) -> Any:
        if isinstance(op, Exec):
            desc = template.slices[op.slice]
            if not self.devices.participates(desc):
                return False
            return desc, self.devices.mesh(desc), self.exes.key(op.exe, desc, op.in_specs, op.out_specs)
        if isinstance(op, Send):
            return [r for r in op.routes if r.host == self.host]
        if isinstance(op, Recv):
            expect = op.expected(self.host)
            if expect is None:
                return (None, None)
            return (expect, self.landing(template.slices[op.slice], op.spec, op.aval.shape,
                                         dtype_from_wire(op.aval.dtype)))
        desc = template.slices[op.slice]
        return self.devices.sharding(desc, op.spec) if self.devices.participates(desc) else False

    def landing(self, desc: SliceDesc, spec: tuple, shape: Any, dtype: np.dtype) -> Landing:
        """Where an array of ``shape`` and ``dtype``, sharded by ``spec`` over ``desc``, lands on this host."""
        shape = tuple(shape)
        return Landing(shape, np.dtype(dtype), self.devices.sharding(desc, spec),
                       self.devices.wanted(desc, shape, spec))

    # -- inputs -------------------------------------------------------------------------------------------
    def _entries(self, run: Run, slots: tuple[int, ...]) -> list[Entry] | None:
        entries = []
        lookup, tenant = self.table.lookup, run.tenant
        for buffer_id in run.ids(slots):
            entry = lookup(buffer_id, tenant)
            if entry is None:
                return None
            if type(entry.value) is Failure:
                raise Failed(entry.value)
            entries.append(entry)
        return entries

    # -- ops ----------------------------------------------------------------------------------------------
    def _exec(self, run: Run, op: Exec, final: bool = False) -> bool:
        local = self._local(run, op)
        if local is False:
            return True  # a slice on other hosts of this island: nothing of it lives here
        entries = self._entries(run, op.inputs)
        if entries is None:
            return False
        donate = self._donatable(run, op) if op.donate else ()
        compiled = self._compiled(run, op, local, donate)
        self._launch(run, op, compiled, entries, donate, self.budgets(run.tenant).host_bytes)
        return True

    def launcher(self, run: Run, op: Exec) -> Callable[[Run], bool] | None:
        """``_exec`` for the calls of a group, with what they share (the executable, the budget) worked out once:
        the callable runs ``op`` with the run's current call's ids, False while an input is missing. None where the
        op runs nothing on this host or donates (each call then goes through ``run``)."""
        local = self._local(run, op)
        if local is False or op.donate:
            return None
        compiled = self._compiled(run, op, local, ())
        budget = self.budgets(run.tenant).host_bytes
        entries_of, launch, inputs = self._entries, self._launch, op.inputs

        def run_call(run: Run) -> bool:
            entries = entries_of(run, inputs)
            if entries is None:
                return False
            launch(run, op, compiled, entries, (), budget)
            return True
        return run_call

    def _compiled(self, run: Run, op: Exec, local: tuple, donate: tuple[int, ...]) -> Compiled:
        desc, mesh, key = local
        compiled = self.exes.cached(run.tenant, key, donate)
        if compiled is None:  # compiling is charged like the run, but no measure of what later runs cost
            start = time.perf_counter()
            compiled = self.exes.get(run.tenant, op.exe, mesh, desc, op.in_specs, op.out_specs, donate, key)
            run.compile_s += time.perf_counter() - start
        return compiled

    def _launch(self, run: Run, op: Exec, compiled: Compiled, entries: list[Entry], donate: tuple[int, ...],
                budget: int) -> None:
        tenant, table = run.tenant, self.table
        freed = sum(entries[p].nbytes for p in donate) if donate else 0
        table.check_room(tenant, compiled.resident_bytes - freed, budget)
        results = compiled.call(*[e.value for e in entries])
        # One launch at a time: XLA's CPU collectives deadlock when many multi-device launches are in
        # flight, and blocking makes the island time charged to each tenant (and traced) real.
        for value in results:
            if not value.is_ready():  # a small computation is done when the call returns: no need to let go of the GIL
                value.block_until_ready()
        for position in donate:
            table.take(run.rid(op.inputs[position]), tenant)
        table.put_all(run.ids(op.outputs), tenant, results, compiled.out_nbytes)

    def _donatable(self, run: Run, op: Exec) -> tuple[int, ...]:
        """The donated inputs XLA may really take: read by no other pending op, and passed only once here."""
        if not op.donate:
            return ()
        ids = run.ids(op.inputs)
        return tuple(p for p in op.donate if ids.count(ids[p]) == 1 and not self.table.used_elsewhere(ids[p]))

    def _reshard(self, run: Run, op: Reshard, final: bool = False) -> bool:
        sharding = self._local(run, op)
        if sharding is False:
            return True
        entries = self._entries(run, (op.source,))
        if entries is None:
            return False
        self.table.put(run.rid(op.out), run.tenant, jax.device_put(entries[0].value, sharding))
        return True

    def _place(self, run: Run, op: Place, final: bool = False) -> bool:
        if not self.devices.participates(op.slice):
            return True
        pieces = self.uploads.take(run.base, run.tenant)
        if pieces is None:
            return False  # its bytes are still on their way from the client (bounded by the op timeout)
        if isinstance(pieces, Failure):
            raise Failed(pieces)
        dtype = dtype_from_wire(op.aval.dtype)
        shape = op.aval.shape
        for index, piece in pieces.items():
            if piece.dtype != dtype or piece.shape != tuple(b - a for a, b in index):
                raise ProgramError(f"pw.put: a piece of {piece.dtype}{list(piece.shape)} does not match region "
                                   f"{index} of {op.aval.describe()}")
        self.table.check_room(run.tenant, sum(p.nbytes for p in pieces.values()), self.budgets(run.tenant).host_bytes)
        try:
            array = assemble(self.landing(op.slice, op.spec, shape, dtype), pieces, self.pool.take)
        except ValueError as exc:
            raise ProgramError(f"pw.put: {exc}") from None
        self.table.put(run.base, run.tenant, array)
        return True

    def _recv(self, run: Run, op: Recv, final: bool) -> bool:
        expect, landing = self._local(run, op)
        if expect is None:
            return True
        self.table.check_room(run.tenant, landing.nbytes, self.budgets(run.tenant).host_bytes)
        return self.receiver.recv(run.rid(op.out), op, expect, landing, run.tenant, run.label, final)

    def _send(self, run: Run, op: Send, final: bool = False) -> bool:
        routes = self._local(run, op)
        if not routes:
            return True
        entry = self.table.lookup(run.rid(op.source), run.tenant)
        if entry is None:
            return False
        args = (entry.value, run.rid(op.key), op.island, routes, run.tenant)
        if self.peers.linked(op.island, [r.to for r in routes]):
            self._deliver_all(*args)  # a frame on a socket: cheaper than a hand-off to the sender threads
        else:
            held = [run.rid(op.source)]  # still read in the background: no later call may donate it meanwhile
            self.table.hold(held)
            self._sender.submit(self._deliver_then_release, held, *args)
        return True

    def _deliver_then_release(self, held: list[int], *args: Any) -> None:
        try:
            self._deliver_all(*args)
        finally:
            self.table.release(held)

    def send_failure(self, run: Run, op: Send, failure: Failure) -> None:
        """The value a send would carry failed: its receivers get the failure instead of waiting."""
        routes = [r for r in op.routes if r.host == self.host]
        if routes:
            self._sender.submit(self._deliver_all, failure, run.rid(op.key), op.island, routes, run.tenant)

    def _post(self, island: int, host: int, msg: Deliver, arrays: list[np.ndarray]) -> bool:
        """Hand ``msg`` to its receiving host; a route from this host to itself (a transfer between slices of
        this island) files a copy here, since the value it reads may be freed or donated before the recv."""
        if (island, host) != (self.island, self.host):
            return self.peers.send(island, host, msg, arrays, self.op_timeout)
        self.receiver.deliver(msg, [np.array(a, copy=True) for a in arrays], (self.island, self.host))
        return False

    def _deliver_all(self, value: Any, key: int, island: int, routes: list[Route], tenant: str) -> None:
        try:
            pieces = None if isinstance(value, Failure) else local_pieces(value)
        except Exception as exc:  # never lose a send silently: its receivers hear why
            value, pieces = Failure(*to_wire(exc)), None
        for route in routes:
            msg = Deliver(key, self.island, self.host, route.shards if pieces is not None else ())
            try:
                if pieces is None:
                    failed = Deliver(key, self.island, self.host, (), (value.kind, value.message))
                    self._post(island, route.to, failed, [])
                    continue
                missing = [s for s in route.shards if s not in pieces]
                if missing:
                    raise ProgramError(f"a send names shard {missing[0]}, which this host does not hold")
                start = time.time()
                datas = [np.asarray(pieces[s]) for s in route.shards]
                direct = self._post(island, route.to, msg, datas)
                nbytes = sum(d.nbytes for d in datas)
                self.bytes_out += nbytes
                if self.events.enabled:
                    self.events.span("send shards", "send", start, time.time(), bytes=nbytes, dst_island=island,
                                     dst_host=route.to, key=key, direct=direct, tenant=tenant)
            except Exception as exc:
                log.warning("island %d host %d: a send to island %d host %d failed: %s", self.island, self.host,
                            island, route.to, exc)
                try:
                    self._post(island, route.to, Deliver(key, self.island, self.host, (), to_wire(exc)), [])
                except Exception:  # the peer is gone: its island's failure is reported by the health checks
                    pass
