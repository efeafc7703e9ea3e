"""Runs admitted fragments on one host: dataflow within a host, the scheduler's order across hosts.

Fragments are admitted strictly in the island scheduler's sequence order. On
a single-host island any op whose inputs are ready may run (a fragment
waiting for a transfer does not block the next client's work); on a
multi-host island only the oldest fragment advances, so every host launches
the island's collectives in exactly the same order (gang scheduling).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from pathways.errors import IslandFailedError, TenantAccessError, to_wire
from pathways.events import EventLog
from pathways.sharding import dtype_from_wire, index_from_wire, spec_from_wire
from resource_manager.buffer_pool import BufferPool
from resource_manager.buffers import BufferTable, Failure
from resource_manager.devices import LocalDevices
from resource_manager.direct import Lent, Peers
from resource_manager.executables import ExecutableCache
from resource_manager.scheduler import Scheduler
from resource_manager.transfer import Landing, assemble, local_pieces

READS = {"exec": "in", "send": "in", "reshard": "in"}
WRITES = {"exec": "out", "recv": "out", "reshard": "out", "put": "id"}


@dataclass(eq=False)
class Run:
    """One admitted fragment (or put) with its client-minted ids resolved lazily."""

    seq: int
    tenant: str
    label: str
    ops: list[dict]
    slices: dict[str, dict]
    n_inputs: int = 0
    base: int = 0
    inputs: list[int] = field(default_factory=list)
    pc: int = 0
    waiting_since: float | None = None
    busy_s: float = 0.0
    admitted: float = 0.0
    refusal: Failure | None = None
    reported_blocked: bool = False

    def rid(self, slot: int) -> int:
        return self.inputs[slot] if slot < self.n_inputs else self.base + slot

    def touches(self, op: dict) -> list[int]:
        """Ids the op reads or writes: a free arriving meanwhile must wait until the op is done."""
        if op["op"] == "put":
            return [op["id"]]
        slots = op.get("_touches")
        if slots is None:  # template ops are decoded once and shared by every call: compute once
            slots = []
            for table in (READS, WRITES):
                name = table.get(op["op"])
                if name is not None:
                    value = op[name]
                    slots.extend(value if isinstance(value, list) else [value])
            op["_touches"] = slots
        n, base, inputs = self.n_inputs, self.base, self.inputs
        return [inputs[s] if s < n else base + s for s in slots]


@dataclass
class Mailbox:
    pieces: dict = field(default_factory=dict)
    failure: Failure | None = None


class Executor:
    def __init__(self, island: int, host: int, devices: LocalDevices, table: BufferTable,
                 exes: ExecutableCache, cond: threading.Condition,
                 scheduler: Scheduler | None, strict: bool, op_timeout: float, events: EventLog,
                 peers: Peers, pool: BufferPool) -> None:
        self.island, self.host = island, host
        self.devices, self.table, self.exes, self.cond = devices, table, exes, cond
        self.scheduler = scheduler  # the island's, on host 0 (which reports for the island); None elsewhere
        self.peers = peers
        self.pool = pool
        self.events = events
        self.bytes_out = 0
        self.bytes_in = 0
        self.bytes_in_direct = 0
        self._done: list[list] = []
        self._blocked: list[int] = []
        self.strict = strict
        self.op_timeout = op_timeout
        self.runs: list[Run] = []
        self.mailbox: dict[int, Mailbox] = {}
        self.failed_islands: set[int] = set()
        self.version = 0
        self.completed = 0
        self.ops_run = 0
        self.busy_s = 0.0
        self._sender = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"send-{island}.{host}")
        self._handlers = {"exec": self._exec, "send": self._send, "recv": self._recv,
                          "reshard": self._reshard, "put": self._put}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"executor-{island}.{host}", daemon=True)
        self._thread.start()

    # -- admission (called with self.cond held, in sequence order) -------------------------------
    def admit(self, run: Run) -> None:
        run.admitted = time.time()
        for op in run.ops:
            self.table.add_uses(run.touches(op))
            if op["op"] == "recv" and run.refusal is None:
                self.peers.expect(run.rid(op["out"]), op)  # seam(network): the pieces peers may send for it
        self.runs.append(run)
        self.touch()

    def touch(self) -> None:
        self.version += 1
        self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.touch()
        self._sender.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                if self._stopped:
                    return
                seen = self.version
                runs = list(self.runs)
            progressed = False
            for run in runs:
                progressed |= self._advance(run)
                if run.pc >= len(run.ops):
                    with self.cond:
                        self.runs.remove(run)
                        self.completed += 1
                    self._done.append([run.seq, run.busy_s])
                    if self.events.enabled:
                        self.events.span(f"seq {run.seq}: {run.label}", "fragment", run.admitted, time.time(),
                                         seq=run.seq, tenant=run.tenant, program=run.label, ops=len(run.ops),
                                         busy_ms=round(run.busy_s * 1e3, 3))
                elif self.strict:
                    break
            self._report()
            if progressed:
                continue
            with self.cond:
                if self.version == seen and not self._stopped:
                    self.cond.wait(timeout=self._next_deadline())

    def _report(self) -> None:
        """Tell the island's scheduler (host 0 speaks for the island) what finished or is blocked."""
        if self.scheduler is None or not (self._done or self._blocked):
            self._done, self._blocked = [], []
            return
        if self._blocked:
            blocked, self._blocked = self._blocked, []
            self.scheduler.blocked(blocked)
        if self._done:
            done, self._done = self._done, []
            self.scheduler.completed(done)

    def _next_deadline(self) -> float:
        waits = [r.waiting_since for r in self.runs if r.waiting_since is not None]
        if not waits:
            return 1.0
        return max(0.001, min(1.0, min(waits) + self.op_timeout - time.monotonic()))

    def _advance(self, run: Run) -> bool:
        progressed = False
        while run.pc < len(run.ops):
            op = run.ops[run.pc]
            start = time.perf_counter()
            wall = time.time() if self.events.enabled else 0.0
            try:
                if run.refusal is not None:
                    self._fail_op(run, op, run.refusal)
                elif not self._handlers[op["op"]](run, op):
                    now = time.monotonic()
                    if run.waiting_since is None:
                        run.waiting_since = now
                        if op["op"] == "recv" and not run.reported_blocked:
                            run.reported_blocked = True
                            self._blocked.append(run.seq)
                    if now - run.waiting_since < self.op_timeout:
                        return progressed
                    self._fail_op(run, op, self._timeout_failure(run, op))
            except Exception as exc:  # an op's failure becomes its outputs' failure
                self._fail_op(run, op, Failure(*to_wire(exc)))
            elapsed = time.perf_counter() - start
            run.busy_s += elapsed
            self.busy_s += elapsed
            if self.events.enabled:
                self._trace_op(run, op, wall, elapsed)
            with self.cond:
                self.table.done_using(run.touches(op))
                if "frees" in op:
                    self.table.free([run.rid(s) for s in op["frees"]], run.tenant)
            run.pc += 1
            run.waiting_since = None
            self.ops_run += 1
            progressed = True
        return progressed

    def _trace_op(self, run: Run, op: dict, wall: float, elapsed: float) -> None:
        if run.waiting_since is not None:
            waited = time.monotonic() - run.waiting_since
            self.events.span("wait for inputs", "wait", wall - waited, wall, seq=run.seq, op=op["op"])
        name = op.get("name", op["op"]) if op["op"] == "exec" else op["op"]
        args = {"seq": run.seq, "tenant": run.tenant, "program": run.label}
        if op["op"] == "recv":
            args.update(src_island=op["src"], bytes=int(np.prod(op["aval"]["shape"]))
                        * dtype_from_wire(op["aval"]["dtype"]).itemsize)
        elif op["op"] == "send":
            args.update(dst_island=op["island"])
        self.events.span(name, op["op"], wall, wall + elapsed, **args)

    def _timeout_failure(self, run: Run, op: dict) -> Failure:
        if op["op"] == "recv":
            return Failure("IslandFailedError", f"island {self.island} waited {self.op_timeout:.0f}s for a transfer "
                           f"from island {op['src']} (program {run.label!r}); that island is dead or stuck")
        return Failure("PathwaysError", f"{op['op']} in program {run.label!r} waited {self.op_timeout:.0f}s for "
                       "its inputs; a buffer it reads was never produced")

    def _fail_op(self, run: Run, op: dict, failure: Failure) -> None:
        kind = op["op"]
        if kind == "send":
            self._sender.submit(self._deliver_all, failure, run.rid(op["key"]), op["island"], op["routes"])
        elif kind == "recv":
            self.peers.finished(run.rid(op["out"]))  # seam(network): release what was landing for it
            with self.cond:
                box = self.mailbox.pop(run.rid(op["out"]), None)
            if box is not None:
                self._return_leases(box)
        outs = op.get("out", [])
        ids = [run.rid(slot) for slot in (outs if isinstance(outs, list) else [outs])]
        if kind == "put":
            ids.append(op["id"])
        for buffer_id in ids:
            try:
                self.table.put(buffer_id, run.tenant, failure)
            except TenantAccessError:
                pass  # another tenant's buffer: leave it exactly as it is

    # -- ops: each returns False when its inputs are not ready yet ------------------------------
    def _entries(self, run: Run, slots: list[int]) -> list | None:
        entries = []
        for slot in slots:
            entry = self.table.lookup(run.rid(slot), run.tenant)
            if entry is None:
                return None
            entries.append(entry)
        return entries

    @staticmethod
    def _failure_of(entries: list) -> Failure | None:
        return next((e.value for e in entries if isinstance(e.value, Failure)), None)

    def _exec(self, run: Run, op: dict) -> bool:
        desc = run.slices[op["slice"]]
        if not self.devices.participates(desc):
            return True  # a slice on other hosts of this island: nothing of it lives here
        entries = self._entries(run, op["in"])
        if entries is None:
            return False
        failure = self._failure_of(entries)
        if failure is not None:
            self._fail_op(run, op, failure)
            return True
        compiled = op.get("_compiled")
        if compiled is None:  # first run of this template op on this host
            mesh, key = self.devices.mesh(desc)
            compiled = op["_compiled"] = self.exes.get(op["exe"], mesh, key, op["in_specs"], op["out_specs"])
        else:
            self.exes.hits += 1
        results = compiled(*[e.value for e in entries])
        # One launch at a time: XLA's CPU collectives deadlock when many multi-device launches are in
        # flight, and blocking makes the island time charged to each tenant (and traced) real.
        jax.block_until_ready(results)
        for slot, value in zip(op["out"], results):
            self.table.put(run.rid(slot), run.tenant, value)
        return True

    def _reshard(self, run: Run, op: dict) -> bool:
        if not self.devices.participates(run.slices[op["slice"]]):
            return True
        entries = self._entries(run, [op["in"]])
        if entries is None:
            return False
        failure = self._failure_of(entries)
        if failure is not None:
            self._fail_op(run, op, failure)
            return True
        sharding = self.devices.sharding(run.slices[op["slice"]], spec_from_wire(op["spec"]))
        self.table.put(run.rid(op["out"]), run.tenant, jax.device_put(entries[0].value, sharding))
        return True

    def _send(self, run: Run, op: dict) -> bool:
        routes = op.get("_routes")
        if routes is None:  # this host's routes of a template op: the same on every call
            routes = op["_routes"] = [r for r in op["routes"] if r["host"] == self.host]
        if not routes:
            return True
        entries = self._entries(run, [op["in"]])
        if entries is None:
            return False
        args = (entries[0].value, run.rid(op["key"]), op["island"], routes)
        if self.peers.linked(op["island"], [r["to"] for r in routes]):
            self._deliver_all(*args)  # a frame on a socket: cheaper than a hand-off to the sender threads
        else:
            self._sender.submit(self._deliver_all, *args)
        return True

    def _deliver_all(self, value: Any, key: int, island: int, routes: list[dict]) -> None:
        pieces = None if isinstance(value, Failure) else local_pieces(value)
        for route in routes:
            if pieces is None:
                body = {"key": key, "src": self.island, "shards": [], "failure": [value.kind, value.message]}
                self.peers.send(island, route["to"], body, [], self.op_timeout)
                continue
            start = time.time()
            datas = [np.asarray(pieces[index_from_wire(s)]) for s in route["shards"]]
            body = {"key": key, "src": self.island, "shards": route["shards"]}
            direct = self.peers.send(island, route["to"], body, datas, self.op_timeout)
            nbytes = sum(d.nbytes for d in datas)
            self.bytes_out += nbytes
            if self.events.enabled:
                self.events.span("send shards", "send", start, time.time(), bytes=nbytes, dst_island=island,
                                 dst_host=route["to"], key=key, direct=direct)

    def deliver(self, msg: dict, datas: tuple) -> None:
        """Called by a peer's send (under self.cond): file the pieces until the recv op claims them."""
        box = self.mailbox.setdefault(msg["key"], Mailbox())
        if msg.get("failure"):
            box.failure = Failure(*msg["failure"])
        for shard, data in zip(msg["shards"], datas):
            box.pieces[index_from_wire(shard)] = data
            if isinstance(data, np.ndarray):
                self.bytes_in += data.nbytes
        self.touch()

    def _return_leases(self, box: Mailbox) -> None:
        """Hand lent pieces back to their senders, copied or not: they may let go of them now."""
        lent = [piece for piece in box.pieces.values() if isinstance(piece, Lent)]
        if lent:
            self.peers.give_back(lent)

    def _landing(self, run: Run, op: dict) -> tuple[int, Landing] | None:
        """How many pieces a recv op expects on this host and where its array lands (None: nothing of it
        lands here); worked out on the op's first run, as its template is the same on every call."""
        if "_landing" not in op:
            expect = dict(map(tuple, op["expect"])).get(self.host)
            if expect is None:
                op["_landing"] = None
            else:
                op["_landing"] = (expect, self._land(run.slices[op["slice"]], spec_from_wire(op["spec"]),
                                                     op["aval"]["shape"], dtype_from_wire(op["aval"]["dtype"])))
        return op["_landing"]

    def _land(self, desc: dict, spec: PartitionSpec, shape: Sequence[int], dtype: np.dtype) -> Landing:
        """Where an array of ``shape`` and ``dtype``, sharded by ``spec`` over slice ``desc``, lands here."""
        shape = tuple(shape)
        return Landing(shape, np.dtype(dtype), self.devices.sharding(desc, spec),
                       self.devices.wanted(desc, shape, spec))

    def _recv(self, run: Run, op: dict) -> bool:
        landing = self._landing(run, op)
        if landing is None:
            return True
        expect, where = landing
        out = run.rid(op["out"])
        box = self.mailbox.get(out)
        if box is not None and box.failure is not None:
            self._fail_op(run, op, box.failure)
            return True
        if box is None or len(box.pieces) < expect:
            if op["src"] in self.failed_islands:
                raise IslandFailedError(f"island {op['src']} failed before its transfer to island "
                                        f"{self.island} (program {run.label!r}) arrived")
            return False
        with self.cond:
            del self.mailbox[out]
        self.peers.finished(out)  # seam(network): late pieces for it are refused from now on
        try:
            array = assemble(where, box.pieces, self.pool.take)
        except OSError as exc:
            raise IslandFailedError(f"copying the shards island {op['src']} lent to island {self.island} "
                                    f"(program {run.label!r}) failed: {exc}; the sending host died") from exc
        finally:
            self._return_leases(box)
        lent = [p for p in box.pieces.values() if isinstance(p, Lent)]
        if lent:
            nbytes = sum(math.prod(b - a for a, b in p.index) for p in lent) * where.dtype.itemsize
            self.bytes_in += nbytes
            self.bytes_in_direct += nbytes
        self.table.put(out, run.tenant, array)
        return True

    def _put(self, run: Run, op: dict) -> bool:
        desc = op["slice"]
        if not self.devices.participates(desc):
            return True
        value = op["value"]
        spec = spec_from_wire(op["spec"])
        if isinstance(value, dict):  # this host's shards of a scattered put
            shape, dtype, pieces = op["aval"]["shape"], dtype_from_wire(op["aval"]["dtype"]), value
        else:
            shape, dtype = value.shape, value.dtype
            pieces = {tuple((0, n) for n in shape): value}
        self.table.put(op["id"], run.tenant, assemble(self._land(desc, spec, shape, dtype), pieces, self.pool.take))
        return True

    def island_failed(self, island: int) -> None:
        self.peers.drop_island(island)
        with self.cond:
            self.failed_islands.add(island)
            self.touch()

    def stalled(self, tenant: str) -> list[dict]:
        """The tenant's admitted fragments that have not finished, and what each waits for: what a client's
        timeout reports, so a stuck program says where it stopped."""
        out = []
        with self.cond:
            runs = [run for run in self.runs if run.tenant == tenant]
        for run in runs:
            if run.pc >= len(run.ops):
                continue
            op = run.ops[run.pc]
            kind = op["op"]
            if kind == "recv":
                missing = [f"buffer {run.rid(op['out'])} from island {op['src']}"]
            else:
                name = READS.get(kind)
                slots = op.get(name, []) if name else []
                ids = [run.rid(s) for s in (slots if isinstance(slots, list) else [slots])]
                missing = [f"buffer {i}" for i in ids if i not in self.table]
            since = run.waiting_since
            out.append({"seq": run.seq, "program": run.label, "op": run.pc, "kind": kind,
                        "name": op.get("name", kind), "missing": missing,
                        "waiting_s": 0.0 if since is None else round(time.monotonic() - since, 3)})
        return out

    def stats(self) -> dict:
        return {"queue_depth": len(self.runs), "completed": self.completed, "ops": self.ops_run,
                "busy_s": self.busy_s, "mailbox": len(self.mailbox), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "bytes_in_direct": self.bytes_in_direct,
                "lent_bytes": self.peers.lent_bytes}
