"""What each op does on a host: one handler per op class, and one table of them (``Handlers.by_op``).

A handler is declared by subclassing ``Handler`` with the op class it handles (``class
ExecHandler(Handler, op=Exec)``); every host's table has one of each. Its ``run`` returns
False while the op's inputs are not there yet; an input that holds a failure makes it raise
``Failed`` with that failure, which the executor writes to the op's outputs. Whatever the
executor does differently for one kind of op, the op's handler says (the executor never asks
which op it has): ``computes`` (its time is one computation's), ``launcher`` (a group's calls
with what they share worked out once), ``announce`` and ``watch`` (an op that ``RECEIVES``:
at admission, and when it parks), ``fail`` (what else a failure of it undoes),
``waited_too_long``, ``missing`` and ``trace`` (what a timeout, a stuck client and a trace are
told).

Host-local facts about a template's ops (this host's routes, where a receive lands, whether it
takes part at all) are worked out on the op's first run (``prepare``) and kept, keyed by the
template, never written into the shared op objects.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import jax
import numpy as np

from pathways import op_wire
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


_HANDLERS: dict[type[Op], type[Handler]] = {}  # op class -> its handler's class, in declaration order


class Handler:
    """What a host does with one kind of op. A subclass names the op class it handles (``op=``) and defines ``run``
    (and ``prepare`` when it keeps host-local facts); every other hook has the default most ops want."""

    op: ClassVar[type[Op]]
    computes: ClassVar[bool] = False  # runs a computation: its time counts toward the run's longest computation

    def __init_subclass__(cls, op: type[Op] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if op is None:
            return
        if op in _HANDLERS:
            raise TypeError(f"op {op.KIND!r} has a handler already: {_HANDLERS[op].__name__}")
        cls.op = op
        _HANDLERS[op] = cls

    def __init__(self, parts: Handlers) -> None:
        self.parts = parts
        self.table, self.devices, self.budgets = parts.table, parts.devices, parts.budgets
        self._prepared = parts.prepared

    def run(self, run: Run, op: Any, final: bool) -> bool:
        """Run ``op`` of ``run``; False while its inputs are missing (``final``: a resumed receive, whose data is
        all here)."""
        raise NotImplementedError(f"{type(self).__name__} must define run")

    def prepare(self, template: Template, op: Any) -> Any:
        """The host-local facts ``op`` of ``template`` needs here, worked out once (``local``)."""
        raise NotImplementedError(f"{type(self).__name__} must define prepare to use local facts")

    def launcher(self, run: Run, op: Any) -> Callable[[Run], bool] | None:
        """A callable that runs ``op`` with the run's current call's ids (False while an input is missing), what the
        calls of a group share worked out once; None: each call goes through ``run``."""
        return None

    def announce(self, run: Run, op: Any) -> None:
        """At admission, for an op that ``RECEIVES``: make ready for what it will take."""

    def watch(self, run: Run, op: Any) -> None:
        """``run`` parked at ``op`` (it ``RECEIVES``, on a multi-host island): have its landing reported."""

    def fail(self, run: Run, op: Any, failure: Failure) -> None:
        """What a failure of ``op`` undoes besides its outputs (which get ``failure``)."""

    def waited_too_long(self, run: Run, op: Any) -> Failure:
        """The failure of an op whose inputs did not come within the op timeout."""
        return Failure("PathwaysError", f"{op.KIND} in program {run.label!r} waited {self.parts.op_timeout:.0f}s for "
                       "its inputs; a buffer it reads was never produced")

    def missing(self, run: Run, op: Any) -> list[str]:
        """What ``op`` still waits for, as a stuck client is told."""
        return [f"buffer {i}" for i in run.ids(op.reads()) if i not in self.table]

    def trace(self, op: Any) -> dict[str, Any]:
        """What a trace span of ``op`` shows besides the run's facts."""
        return {}

    # -- what handlers share ------------------------------------------------------------------------------
    def local(self, run: Run, op: Op, k: int | None = None) -> Any:
        """The host-local facts of the run's op ``k`` (default: its current op; ``prepare``d on first use, kept by
        template)."""
        template = run.template
        facts = self._prepared.get(template)
        if facts is None:
            facts = self._prepared[template] = [None] * len(template.ops)
            while len(self._prepared) > PREPARED:
                self._prepared.popitem(last=False)
        k = run.pc if k is None else k
        fact = facts[k]
        if fact is None:
            fact = facts[k] = self.prepare(template, op)
        return fact

    def entries(self, run: Run, slots: tuple[int, ...]) -> list[Entry] | None:
        """The buffers ``slots`` stand for in ``run``; None while one is missing, ``Failed`` when one failed."""
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

    def landing(self, desc: SliceDesc, spec: tuple, shape: Any, dtype: np.dtype) -> Landing:
        """Where an array of ``shape`` and ``dtype``, sharded by ``spec`` over ``desc``, lands on this host."""
        shape = tuple(shape)
        return Landing(shape, np.dtype(dtype), self.devices.sharding(desc, spec),
                       self.devices.wanted(desc, shape, spec))


class Handlers:
    """The op handlers of one host, given the parts they use: ``by_op`` maps each op class to its handler."""

    def __init__(self, island: int, host: int, devices: LocalDevices, table: BufferTable, exes: ExecutableCache,
                 peers: Peers, pool: BufferPool, receiver: Receiver, uploads: Uploads, events: EventLog,
                 op_timeout: float, budgets: Callable[[str], Budgets] = lambda tenant: Budgets()) -> None:
        self.island, self.host = island, host
        self.budgets = budgets
        self.devices, self.table, self.exes, self.uploads = devices, table, exes, uploads
        self.peers, self.pool, self.receiver, self.events = peers, pool, receiver, events
        self.op_timeout = op_timeout
        self.prepared: OrderedDict[Template, list[Any]] = OrderedDict()
        self.sender = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"send-{island}.{host}")
        self.bytes_out = 0
        unknown = Unhandled(self)
        self.by_op: dict[type[Op], Handler] = {cls: unknown for cls in op_wire.classes()}
        self.by_op.update({op: handler(self) for op, handler in _HANDLERS.items()})

    def stop(self) -> None:
        """Stop the background senders; sends not yet started are dropped."""
        self.sender.shutdown(wait=False, cancel_futures=True)


class Unhandled(Handler):
    """A declared op kind no handler on this host takes: it fails, and its outputs say so."""

    def run(self, run: Run, op: Any, final: bool) -> bool:
        """Refuse the op."""
        raise ProgramError(f"unknown op {op!r}")


class ExecHandler(Handler, op=Exec):
    """Run a compiled function on the devices of its slice this host holds."""

    computes = True

    def prepare(self, template: Template, op: Exec) -> Any:
        """The slice, its mesh and the executable's key; False when no device of the slice is on this host."""
        desc = template.slices[op.slice]
        if not self.devices.participates(desc):
            return False
        return desc, self.devices.mesh(desc), self.parts.exes.key(op.exe, desc, op.in_specs, op.out_specs)

    def run(self, run: Run, op: Exec, final: bool = False) -> bool:
        """Launch the computation once its inputs are here."""
        local = self.local(run, op)
        if local is False:
            return True  # a slice on other hosts of this island: nothing of it lives here
        entries = self.entries(run, op.inputs)
        if entries is None:
            return False
        donate = self._donatable(run, op) if op.donate else ()
        compiled = self._compiled(run, op, local, donate)
        self._launch(run, op, compiled, entries, donate, self.budgets(run.tenant).host_bytes)
        return True

    def launcher(self, run: Run, op: Exec) -> Callable[[Run], bool] | None:
        """``run`` for the calls of a group, with what they share (the executable, the budget) worked out once. None
        where the op runs nothing on this host or donates."""
        local = self.local(run, op)
        if local is False or op.donate:
            return None
        compiled = self._compiled(run, op, local, ())
        budget = self.budgets(run.tenant).host_bytes
        entries_of, launch, inputs = self.entries, self._launch, op.inputs

        def run_call(run: Run) -> bool:
            entries = entries_of(run, inputs)
            if entries is None:
                return False
            launch(run, op, compiled, entries, (), budget)
            return True
        return run_call

    def trace(self, op: Exec) -> dict[str, Any]:
        """The slice it ran on."""
        return {"slice": op.slice}

    def _compiled(self, run: Run, op: Exec, local: tuple, donate: tuple[int, ...]) -> Compiled:
        desc, mesh, key = local
        exes = self.parts.exes
        compiled = exes.cached(run.tenant, key, donate)
        if compiled is None:  # compiling is charged like the run, but no measure of what later runs cost
            start = time.perf_counter()
            compiled = exes.get(run.tenant, op.exe, mesh, desc, op.in_specs, op.out_specs, donate, key)
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
        ids = run.ids(op.inputs)
        return tuple(p for p in op.donate if ids.count(ids[p]) == 1 and not self.table.used_elsewhere(ids[p]))


class ReshardHandler(Handler, op=Reshard):
    """Put a value on this host's devices of its slice with another sharding."""

    def prepare(self, template: Template, op: Reshard) -> Any:
        """The target sharding; False when no device of the slice is on this host."""
        desc = template.slices[op.slice]
        return self.devices.sharding(desc, op.spec) if self.devices.participates(desc) else False

    def run(self, run: Run, op: Reshard, final: bool = False) -> bool:
        """Reshard once the value is here."""
        sharding = self.local(run, op)
        if sharding is False:
            return True
        entries = self.entries(run, (op.source,))
        if entries is None:
            return False
        self.table.put(run.rid(op.out), run.tenant, jax.device_put(entries[0].value, sharding))
        return True


class PlaceHandler(Handler, op=Place):
    """Land the pieces of a put the client uploaded to this host as one array."""

    def run(self, run: Run, op: Place, final: bool = False) -> bool:
        """Assemble the array once every piece of it is here."""
        if not self.devices.participates(op.slice):
            return True
        pieces = self.parts.uploads.take(run.base, run.tenant)
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
            array = assemble(self.landing(op.slice, op.spec, shape, dtype), pieces, self.parts.pool.take)
        except ValueError as exc:
            raise ProgramError(f"pw.put: {exc}") from None
        self.table.put(run.base, run.tenant, array)
        return True


class RecvHandler(Handler, op=Recv):
    """Land what another island (or another host of this one) sends for a receive, through the receiver."""

    def prepare(self, template: Template, op: Recv) -> Any:
        """What lands here and where; (None, None) when nothing of the receive does."""
        expect = op.expected(self.parts.host)
        if expect is None:
            return (None, None)
        return (expect, self.landing(template.slices[op.slice], op.spec, op.aval.shape, dtype_from_wire(op.aval.dtype)))

    def run(self, run: Run, op: Recv, final: bool) -> bool:
        """Take the value once every piece meant for this host has come."""
        expect, landing = self.local(run, op)
        if expect is None:
            return True
        self.table.check_room(run.tenant, landing.nbytes, self.budgets(run.tenant).host_bytes)
        return self.parts.receiver.recv(run.rid(op.out), op, expect, landing, run.tenant, run.label, final)

    def announce(self, run: Run, op: Recv) -> None:
        """Tell the receiver the pieces to keep for it, and where they land here (so it may copy lent ones early)."""
        k = next((i for i, o in enumerate(run.ops) if o is op), None)  # admission comes before the op is current
        expect, landing = (None, None) if k is None else self.local(run, op, k)
        self.parts.receiver.expect(run.rid(op.out), op, expect, landing)

    def watch(self, run: Run, op: Recv) -> None:
        """Have the receiver report when this host's pieces have landed."""
        self.parts.receiver.watch(run.seq, run.pc, run.rid(op.out), op, op.expected(self.parts.host))

    def fail(self, run: Run, op: Recv, failure: Failure) -> None:
        """Drop what came for it."""
        self.parts.receiver.drop(run.rid(op.out))

    def waited_too_long(self, run: Run, op: Recv) -> Failure:
        """The sending island is dead or stuck."""
        return Failure("IslandFailedError", f"island {self.parts.island} waited {self.parts.op_timeout:.0f}s for a "
                       f"transfer from island {op.src} (program {run.label!r}); that island is dead or stuck")

    def missing(self, run: Run, op: Recv) -> list[str]:
        """The value from the other island."""
        return [f"buffer {run.rid(op.out)} from island {op.src}"]

    def trace(self, op: Recv) -> dict[str, Any]:
        """Where from, and how much."""
        return {"src_island": op.src, "bytes": op.aval.nbytes}


class SendHandler(Handler, op=Send):
    """Send this host's shards of a value to the hosts its routes name (a frame on a socket, or in the background)."""

    def prepare(self, template: Template, op: Send) -> list[Route]:
        """The routes from this host."""
        return [r for r in op.routes if r.host == self.parts.host]

    def run(self, run: Run, op: Send, final: bool = False) -> bool:
        """Send once the value is here."""
        routes = self.local(run, op)
        if not routes:
            return True
        entry = self.table.lookup(run.rid(op.source), run.tenant)
        if entry is None:
            return False
        args = (entry.value, run.rid(op.key), op.island, routes, run.tenant)
        if self.parts.peers.linked(op.island, [r.to for r in routes]):
            self._deliver_all(*args)  # a frame on a socket: cheaper than a hand-off to the sender threads
        else:
            held = [run.rid(op.source)]  # still read in the background: no later call may donate it meanwhile
            self.table.hold(held)
            self.parts.sender.submit(self._deliver_then_release, held, *args)
        return True

    def fail(self, run: Run, op: Send, failure: Failure) -> None:
        """The value a send would carry failed: its receivers get the failure instead of waiting."""
        routes = [r for r in op.routes if r.host == self.parts.host]
        if routes:
            self.parts.sender.submit(self._deliver_all, failure, run.rid(op.key), op.island, routes, run.tenant)

    def trace(self, op: Send) -> dict[str, Any]:
        """Where to."""
        return {"dst_island": op.island}

    def _deliver_then_release(self, held: list[int], *args: Any) -> None:
        try:
            self._deliver_all(*args)
        finally:
            self.table.release(held)

    def _post(self, island: int, host: int, msg: Deliver, arrays: list[np.ndarray]) -> bool:
        """Hand ``msg`` to its receiving host; a route from this host to itself (a transfer between slices of
        this island) files a copy here, since the value it reads may be freed or donated before the recv."""
        parts = self.parts
        if (island, host) != (parts.island, parts.host):
            return parts.peers.send(island, host, msg, arrays, parts.op_timeout)
        parts.receiver.deliver(msg, [np.array(a, copy=True) for a in arrays], (parts.island, parts.host))
        return False

    def _deliver_all(self, value: Any, key: int, island: int, routes: list[Route], tenant: str) -> None:
        parts = self.parts
        try:
            pieces = None if isinstance(value, Failure) else local_pieces(value)
        except Exception as exc:  # never lose a send silently: its receivers hear why
            value, pieces = Failure(*to_wire(exc)), None
        for route in routes:
            msg = Deliver(key, parts.island, parts.host, route.shards if pieces is not None else ())
            try:
                if pieces is None:
                    failed = Deliver(key, parts.island, parts.host, (), (value.kind, value.message))
                    self._post(island, route.to, failed, [])
                    continue
                missing = [s for s in route.shards if s not in pieces]
                if missing:
                    raise ProgramError(f"a send names shard {missing[0]}, which this host does not hold")
                start = time.time()
                datas = [np.asarray(pieces[s]) for s in route.shards]
                direct = self._post(island, route.to, msg, datas)
                nbytes = sum(d.nbytes for d in datas)
                parts.bytes_out += nbytes
                if parts.events.enabled:
                    parts.events.span("send shards", "send", start, time.time(), bytes=nbytes, dst_island=island,
                                      dst_host=route.to, key=key, direct=direct, tenant=tenant)
            except Exception as exc:
                log.warning("island %d host %d: a send to island %d host %d failed: %s", parts.island, parts.host,
                            island, route.to, exc)
                try:
                    self._post(island, route.to, Deliver(key, parts.island, parts.host, (), to_wire(exc)), [])
                except Exception:  # the peer is gone: its island's failure is reported by the health checks
                    pass
