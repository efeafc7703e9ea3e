"""A host of an island: one Ray actor owning local JAX devices, a buffer table and an executable cache.

The actor is thin: every public method checks who is asking and forwards.
Clients' methods must be signed with the client's session key (the resource
manager tells hosts the sessions); the runtime's own (the resource manager's
orders, host 0's ordered stream, deliveries between hosts) with the runtime
key. Anything else is refused with an error that names no one.

Host 0 of each island also holds the island's admission and scheduler and
serves them on a thread of their own (the ``schedule`` concurrency group), so
they never wait behind fetches: a client's message is admitted, ordered and
handed to host 0's own executor in one actor call, and to the other hosts as
one call per batch. Its devices are fixed by the actor's ``runtime_env`` before
JAX is imported.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import ray

from pathways import auth, wire
from pathways.errors import IslandFailedError, PathwaysError, TenantAccessError, WireFormatError, from_wire
from pathways.events import EventLog, for_tenant
from pathways.messages import CONTROL, Deliver, Fetch, Free, client_of
from pathways.names import FETCH_TIMED_OUT
from pathways.ops import Limits, SliceDesc, TemplateCache
from resource_manager.host.admission import Admission, Admitted
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.grants import Grants
from resource_manager.host.scheduler import NAMED, Continue, Released, Resume, Scheduler

RUNTIME_ONLY = "refused: this method is for the runtime's own actors"
SCHEDULE = "schedule"  # the concurrency group of the scheduler's methods: one thread of their own
MAINTENANCE_S = 0.5
log = logging.getLogger(__name__)


def row_parts(rows: list) -> list:
    """What a MAC over host 0's rows covers: every field, object references by id."""
    parts: list = []
    for row in rows:
        seq, kind, *rest = row
        parts += [seq, kind]
        if kind in ("resume", "part"):
            parts += list(rest)
            continue
        client, tenant, payload, refs, refusal, lo, hi, end = rest[0]
        parts += [client, tenant, payload, *[r.binary() for r in refs], *(refusal or ()), lo, hi,
                  -1 if end is None else end]
    return parts


class Host:
    """One host of island ``island`` (``index`` of ``n_hosts``): a Ray actor whose methods are its API.

    ``start`` (called by the resource manager) brings up JAX and the data plane beneath the actor: the
    buffer table, the executable cache, the inbox that admits host 0's ordered stream, the executor and
    its op handlers, the receive side, and the same-node channel and network path to peer hosts. Host 0
    also runs the island's admission and scheduler. Every public method verifies its caller (a client's
    session key, or the runtime key) and its input before it forwards; a bad call fails alone.
    """

    def __init__(self, island: int, index: int, n_hosts: int, op_timeout: float, gap_timeout: float) -> None:
        self.island, self.index, self.n_hosts = island, index, n_hosts
        self.op_timeout = op_timeout
        self.gap_timeout = gap_timeout
        self._cond = threading.Condition()
        self._key: bytes | None = None
        self.grants = Grants()
        self.table = BufferTable(self._cond)
        self.events = EventLog()
        self.started = time.time()
        self._tracers: dict[int, int] = {}
        self.network = None

    # -- start-up (the resource manager) ------------------------------------------------------------------
    def coordinator(self) -> str:
        """A free address for this island's jax.distributed coordinator (called on host 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ip}:{s.getsockname()[1]}"

    def start(self, runtime_key: bytes, coordinator: str | None, islands: int, platform: str) -> dict:
        """Bring up JAX (a jax.distributed group on a multi-host island) and the data plane. Once only."""
        if self._key is not None:
            raise PathwaysError("this host has already started")
        import jax

        if self.n_hosts > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes=self.n_hosts, process_id=self.index,
                                       initialization_timeout=120)
        from resource_manager.host.buffer_pool import BufferPool
        from resource_manager.host.devices import LocalDevices
        from resource_manager.host.executables import ExecutableCache
        from resource_manager.host.executor import Executor
        from resource_manager.host.handlers import Handlers
        from resource_manager.host.inbox import Inbox
        from resource_manager.host.memory import host_budget
        from resource_manager.host.metrics import HostMetrics
        from resource_manager.host.receive import Receiver
        from resource_manager.host.transport.channel import open_channel
        from resource_manager.host.transport.network.path import landing_alloc, open_network_path
        from resource_manager.host.transport.peers import Peers

        self._key = runtime_key
        self.devices = LocalDevices(self.index)
        memory, per_device = host_budget(platform, self.devices.local)
        self.limits = Limits(self.island, islands, self.n_hosts, len(self.devices.local), memory, per_device)
        self.node = ray.get_runtime_context().get_node_id()
        self.pool = BufferPool()
        self.exes = ExecutableCache(self.limits)
        self.channel = open_channel(self._on_frame, self._allowed_peer)
        self.peers = Peers(self.island, self.index, self.node, self.channel, runtime_key)
        self.network = open_network_path((self.island, self.index), self.node, ray.util.get_node_ip_address(),
                                         runtime_key, landing_alloc(self.pool.take), self._on_network_piece,
                                         self.peers.directory, stale_s=self.op_timeout)
        self.peers.network = self.network
        self.receiver = Receiver(self.island, self.index, self.table, self.pool, self.peers, self._cond,
                                 self.op_timeout, self._touch)
        handlers = Handlers(self.island, self.index, self.devices, self.table, self.exes, self.peers, self.pool,
                            self.receiver, self.events, self.op_timeout)
        self.executor = Executor(self.island, self.index, self.n_hosts > 1, handlers, self.receiver, self.table,
                                 self._cond, self.op_timeout, self.events, self._on_report)
        self.inbox = Inbox(self.island, self.index, self.executor, self.table, self.exes,
                           TemplateCache(check=lambda t: t.check(self.limits)), self._cond)
        self.scheduler = Scheduler(self.island, self.n_hosts) if self.index == 0 else None
        self.admission = Admission(self.limits, self.grants, self.exes, self.gap_timeout) if self.index == 0 else None
        self.metrics = HostMetrics(self.island, self.index, self.stats)
        threading.Thread(target=self._maintain, name="host-maintenance", daemon=True).start()
        return {"island": self.island, "host": self.index, "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node": self.node, "devices": self.devices.describe(),
                "channel": self.channel.address if self.channel is not None else "",
                "data": self.network.address if self.network is not None else "",
                "memory_bytes": self.limits.memory_bytes, "device_bytes": self.limits.device_bytes}

    def _touch(self) -> None:
        with self._cond:
            self.executor.touch()

    def _runtime(self, mac: bytes, purpose: str, *parts: Any) -> None:
        """Refuse unless ``mac`` is the runtime key's signature over these parts (a runtime actor's call)."""
        try:
            ok = self._key is not None and auth.verify(self._key, mac, purpose, *parts)
        except TypeError:  # parts of a kind no runtime actor sends
            ok = False
        if not ok:
            raise TenantAccessError(RUNTIME_ONLY)

    # -- the resource manager's orders --------------------------------------------------------------------
    @ray.method(concurrency_group=SCHEDULE)
    def control(self, payload: bytes, mac: bytes, handles: list | None = None) -> None:
        """An order of the resource manager: sessions, slices, weights, peers, failed islands."""
        self._runtime(mac, "control", payload)
        msg = wire.decode(payload, *CONTROL)
        kind = msg["kind"]
        if kind == "session":
            self.grants.add_session(msg["client"], msg["tenant"], msg["key"])
            if self.scheduler is not None:
                self.scheduler.set_weight(msg["tenant"], msg["weight"])
        elif kind == "end_session":
            self._end_session(msg["client"], msg["free"])
        elif kind == "grant":
            self.grants.grant(msg["slice"]["key"], msg["tenant"], SliceDesc.from_wire(msg["slice"]))
        elif kind == "revoke":
            self.grants.revoke(msg["keys"])
        elif kind == "weight":
            if self.scheduler is not None:
                self.scheduler.set_weight(msg["tenant"], msg["weight"])
        elif kind == "island_failed":
            self.peers.drop_island(msg["island"])
            with self._cond:
                self.receiver.island_failed(msg["island"])
        elif kind == "release_tenant":
            self.table.free_tenant(msg["tenant"])
        elif kind == "peers":
            from resource_manager.host.transport.peers import PeerInfo

            infos = [PeerInfo(h["island"], h["host"], h["node"], h["pid"], h["channel"], h["data"], handle)
                     for h, handle in zip(msg["hosts"], handles or [])]
            for island in self.peers.set_hosts(infos):
                with self._cond:
                    self.receiver.island_restored(island)

    def _end_session(self, client: int, free: bool) -> None:
        session = self.grants.remove_session(client)
        if session is None:
            return
        if self.admission is not None:
            self.admission.revoke(client)
            if free:  # in the island's order, after everything the client sent
                free = Free((), everything=True)
                entry = Admitted(client, session.tenant, free.encode(), (), free)
                self._forward(self.scheduler.queue([entry]))
        if session.tenant not in self.grants.tenants():
            self.exes.drop_tenant(session.tenant)

    # -- clients' streams (host 0) ------------------------------------------------------------------------
    @ray.method(concurrency_group=SCHEDULE)
    def submit_batch(self, client: int, first: int, items: list, mac: bytes) -> None:
        """Messages ``first``, ``first + 1``, ... of ``client``'s stream, each ``(payload, refs)``, signed with
        the client's session key. Each is admitted or refused alone; a refusal reaches its outputs."""
        if self.admission is None:
            raise PathwaysError(f"host {self.index} of island {self.island} takes no client messages; host 0 does")
        start = time.perf_counter()
        parts = [first] + [p for payload, refs in _pairs(items) for p in (payload, *[r.binary() for r in refs])]
        session = self.grants.verify(client, mac, "submit", *parts)
        try:
            admitted = self.admission.accept(client, session.tenant, first, items)
        finally:  # checking the tenant's messages was the island's work for it
            self.scheduler.charge(session.tenant, time.perf_counter() - start)
        self._forward(self.scheduler.queue(admitted))

    def _forward(self, released: Released) -> None:
        """The scheduler's batch to every host: this one's without an actor call."""
        if not released:
            return
        if self.n_hosts > 1:
            rows = [(seq, "resume", item.seq, item.pc) if isinstance(item, Resume)
                    else (seq, "part", item.seq, item.lo, item.hi) if isinstance(item, Continue)
                    else (seq, "msg", item.row()) for seq, item in released]
            mac = auth.sign(self._key, "enqueue", *row_parts(rows))
            for h in range(1, self.n_hosts):
                self.peers.handle(self.island, h).enqueue_batch.remote(rows, mac)
        self.inbox.accept(released)

    def _on_report(self, report: Any) -> None:
        """The executor's report: to the scheduler on host 0 (which speaks for the island), else landings only
        to host 0."""
        if self.scheduler is not None:
            released: Released = []
            if report.blocked:
                released += self.scheduler.blocked(report.blocked)
            if report.done:
                released += self.scheduler.completed(report.done)
            if report.landed:
                released += self.scheduler.landed(0, report.landed)
            self._forward(released)
        elif report.landed:
            pairs = [list(p) for p in report.landed]
            flat = [x for pair in pairs for x in pair] + [self.index]
            self.peers.handle(self.island, 0).landed.remote(self.index, pairs, auth.sign(self._key, "landed", *flat))

    @ray.method(concurrency_group=SCHEDULE)
    def landed(self, host: int, pairs: list, mac: bytes) -> None:
        """Host ``host`` has the data of these parked receives (multi-host islands)."""
        try:
            flat = [int(x) for pair in pairs for x in pair] + [int(host)]
        except (TypeError, ValueError):
            raise TenantAccessError(RUNTIME_ONLY) from None
        self._runtime(mac, "landed", *flat)
        self._forward(self.scheduler.landed(host, [tuple(p) for p in pairs]))

    def enqueue_batch(self, rows: list, mac: bytes) -> None:
        """Host 0's ordered rows for this host."""
        try:
            parts = row_parts(rows)
        except Exception:  # not rows host 0 sends
            raise TenantAccessError(RUNTIME_ONLY) from None
        self._runtime(mac, "enqueue", *parts)
        self.inbox.accept_rows(rows)

    def _maintain(self) -> None:
        """Skip clients' stream gaps that never fill; fail the host if its own order or executor stopped."""
        while self.executor.dead is None:
            time.sleep(MAINTENANCE_S)
            try:
                if self.admission is not None:
                    expired = self.admission.expire()
                    if expired:
                        self._forward(self.scheduler.queue(expired))
                if self.inbox.stuck_for() > self.op_timeout:
                    self.executor.die(f"island {self.island} host {self.index} waited {self.op_timeout:.0f}s for "
                                      f"sequence {self.inbox.next_seq} from host 0; the island's order is broken")
            except Exception:  # the maintenance thread must outlive any one mistake
                log.exception("island %d host %d: maintenance failed", self.island, self.index)

    # -- data plane ---------------------------------------------------------------------------------------
    def deliver(self, meta: bytes, mac: bytes, *pieces: np.ndarray) -> None:
        """Shards sent by a host of another island through Ray (another node, or no channel)."""
        self._runtime(mac, "deliver", meta)
        msg = Deliver.from_wire(wire.decode(meta, "deliver"))
        if msg.direct is not None or len(pieces) != len(msg.shards):
            raise WireFormatError(f"deliver: {len(msg.shards)} shard indices but {len(pieces)} arrays")
        with self._cond:
            self.receiver.deliver(msg, pieces, (msg.src, msg.host))

    def _on_network_piece(self, key: int, sender: tuple[int, int], shard: tuple, array: np.ndarray) -> None:
        """A piece a runtime host on another node sent over the network path (authenticated there, and routed
        to this host by its receive's plan): file it for the recv op."""
        with self._cond:
            self.receiver.deliver(Deliver(key, sender[0], sender[1], (shard,)), (array,), sender)

    def probe_network(self, mac: bytes, island: int, host: int, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes to a peer over one plain connection of the network path (the
        bare link, for benchmarks to compare against); the runtime's own (the admin asks the resource manager)."""
        self._runtime(mac, "probe_network", island, host, nbytes)
        if self.network is None:
            raise PathwaysError("this host runs no network data path")
        if not 0 < int(nbytes) <= 2**31:
            raise PathwaysError(f"a probe moves 1 byte to 2 GiB, not {nbytes}")
        return self.network.probe(int(island), int(host), int(nbytes))

    def _allowed_peer(self, pid: int) -> bool:
        return self.peers.on_this_node(pid) is not None

    def _on_frame(self, meta: bytes, data: memoryview, pid: int) -> None:
        """A frame from a runtime host on this node (its pid from the socket): shards lent or carried in
        ``data``, or leases coming back."""
        from resource_manager.host.transport.direct import Lent

        peer = self.peers.on_this_node(pid)
        if peer is None:
            raise TenantAccessError(f"a frame from pid {pid}, which is not one of this runtime's hosts")
        msg = wire.decode(meta, "deliver", "returned")
        if msg["kind"] == "returned":
            self.peers.release(msg["leases"])
            return
        deliver = Deliver.from_wire(msg)
        if (deliver.src, deliver.host) != (peer.island, peer.host):
            raise TenantAccessError(f"pid {pid} is island {peer.island} host {peer.host} but its frame claims "
                                    f"island {deliver.src} host {deliver.host}")
        pieces: tuple = ()
        if deliver.direct is not None:
            if len(deliver.direct.addrs) != len(deliver.shards):
                raise WireFormatError("deliver: lent addresses and shard indices differ in number")
            src = (peer.island, peer.host)
            pieces = tuple(Lent(pid, addr, shard, src, deliver.direct.lease, deliver.direct.channel)
                           for addr, shard in zip(deliver.direct.addrs, deliver.shards))
        elif deliver.dtype is not None:  # small shards, back to back in the frame
            dtype, offset, out = np.dtype(deliver.dtype), 0, []
            for shard in deliver.shards:
                shape = [b - a for a, b in shard]
                count = int(np.prod(shape, dtype=np.int64))
                if offset + count * dtype.itemsize > len(data):
                    raise WireFormatError("deliver: the shards take more bytes than the frame carries")
                out.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
                offset += count * dtype.itemsize
            if offset != len(data):
                raise WireFormatError(f"deliver: the shards take {offset} bytes but the frame carries {len(data)}")
            pieces = tuple(out)
        if len(pieces) != len(deliver.shards):
            raise WireFormatError(f"deliver: {len(deliver.shards)} shard indices but {len(pieces)} arrays")
        with self._cond:
            self.receiver.deliver(deliver, pieces, (peer.island, peer.host))

    def probe_direct(self, mac: bytes, node: str, pid: int, addr: int, expected: bytes) -> str:
        """This host's channel address if it can copy lent shards out of runtime host ``pid`` (same node, and
        the kernel permits it), else ""."""
        from resource_manager.host.transport.direct import can_read

        self._runtime(mac, "probe", node, pid, addr)
        ok = (self.channel is not None and node == self.node and self.peers.on_this_node(pid) is not None
              and can_read(pid, addr, expected))
        return self.channel.address if ok else ""

    def release_lent(self, payload: bytes, mac: bytes) -> None:
        """A receiver has copied these leases' shards: let go of them."""
        self._runtime(mac, "returned", payload)
        self.peers.release(wire.decode(payload, "returned")["leases"])

    # -- clients' reads -----------------------------------------------------------------------------------
    def fetch(self, client: int, payload: bytes, mac: bytes) -> Any:
        """A buffer's value as numpy (or this host's shards of it); waits at most the given timeout."""
        session = self.grants.verify(client, mac, "fetch", payload)
        msg = Fetch.decode(payload)
        if client_of(msg.id) != client:
            raise TenantAccessError(f"buffer {msg.id} is not one of your client's buffers")
        entry = self.table.wait(msg.id, session.tenant, min(msg.timeout, 24 * 3600.0))
        if entry is None:  # the client raises its own timeout; an error here would only be logged unread
            return FETCH_TIMED_OUT
        value = entry.value
        if isinstance(value, Failure):
            raise from_wire(value.kind, value.message)
        if msg.ready_only:
            value.block_until_ready()
            return None
        if value.is_fully_addressable:
            return np.asarray(value)
        from resource_manager.host.transfer import local_pieces

        return {tuple(map(tuple, idx)): np.asarray(data) for idx, data in local_pieces(value).items()}

    def stalled(self, client: int, mac: bytes) -> dict:
        """What this host's admitted fragments of the caller's tenant wait for, and how many messages it holds
        until an earlier sequence number arrives."""
        session = self.grants.verify(client, mac, "stalled")
        with self._cond:
            held = self.inbox.held()
        return {"island": self.island, "host": self.index, "held": held,
                "runs": self.executor.stalled(session.tenant)}

    def usage(self, client: int, mac: bytes, reset_peak: bool = False) -> dict:
        """The caller's tenant's buffers, bytes, peak bytes (restarted with ``reset_peak``) and executables."""
        session = self.grants.verify(client, mac, "usage", int(reset_peak))
        out = self.table.tenant_usage(session.tenant)
        if reset_peak:
            self.table.reset_peak(session.tenant)
        return {**out, **self.exes.tenant_stats(session.tenant), "island": self.island, "host": self.index}

    def trace_start(self, client: int, mac: bytes) -> int:
        """Start recording this host's events for the caller's ``pw.trace``; returns the tracer's token."""
        self.grants.verify(client, mac, "trace_start")
        token = self.events.start()
        self._tracers[client] = token
        return token

    def trace_stop(self, client: int, mac: bytes) -> list:
        """The caller's trace: its tenant's events by name, everyone else's as anonymous spans."""
        session = self.grants.verify(client, mac, "trace_stop")
        return for_tenant(self.events.stop(self._tracers.pop(client, None)), session.tenant)

    # -- health and aggregates (no tenant is named) -------------------------------------------------------
    def ping(self) -> float:
        """This host's wall clock (also what the client uses to estimate the clock offset); raises once the
        host can no longer run."""
        if self._key is not None and self.executor.dead is not None:
            raise IslandFailedError(self.executor.dead)
        return time.time()

    def health(self) -> dict:
        """``{"ok", "reason"}`` for the resource manager's health check: not ok once the executor has died."""
        dead = self.executor.dead if self._key is not None else None
        return {"ok": dead is None, "reason": dead or ""}

    def stats(self) -> dict:
        """Counters of the whole host, with no tenant's name in them (see ``usage`` for one's own)."""
        with self._cond:
            out = {"island": self.island, "host": self.index, "pid": os.getpid(), "buffers": len(self.table),
                   "buffer_bytes": self.table.nbytes, "peak_buffer_bytes": self.table.peak_bytes,
                   "tenants": len(self.table.by_tenant()), "compiles": self.exes.compiles,
                   "cache_hits": self.exes.hits, "executables": len(self.exes), "evictions": self.exes.evictions,
                   "next_seq": self.inbox.next_seq, "waiting": self.inbox.held(),
                   "uptime_s": time.time() - self.started,
                   "busy_fraction": self.metrics.busy_fraction if self.metrics is not None else 0.0,
                   "dead": self.executor.dead or ""}
            out.update(self.executor.stats())
            out.update(self.pool.stats())
            if self.channel is not None:
                out.update(frames_in=self.channel.frames_in, frames_out=self.channel.frames_out,
                           channel_refused=self.channel.refused)
        if self.network is not None:
            out.update(self.network.stats())
        if self.scheduler is not None:
            out["schedule"] = {k: v for k, v in self.scheduler.stats().items() if k not in NAMED}
            out["stream_gaps_waiting"] = self.admission.waiting()
        return out

    def schedule_stats(self, client: int | None = None, mac: bytes = b"") -> dict:
        """The island's share of time per tenant: the caller's tenant by name, the others as one sum."""
        stats = self.scheduler.stats()
        session = self.grants.verify(client, mac, "schedule_stats") if client is not None else None
        mine = session.tenant if session is not None else None
        out = {k: v for k, v in stats.items() if k not in NAMED}
        for key in ("tenant_time_s", "tenant_time_recent_s"):
            times = stats[key]
            out[key] = {mine: times.get(mine, 0.0)} if mine is not None else {}
            out[key.replace("tenant", "others")] = sum(v for t, v in times.items() if t != mine)
        return out

    def census(self, mac: bytes) -> dict:
        """Buffers and bytes per tenant: for the resource manager, to say what a restart lost."""
        self._runtime(mac, "census")
        return self.table.by_tenant()

    def tenant_schedule(self, mac: bytes) -> dict:
        """Every tenant's island time, by name: for the resource manager (the admin's view)."""
        self._runtime(mac, "tenant_schedule")
        return self.scheduler.stats()


def _pairs(items: Any) -> list[tuple[bytes, list]]:
    if not isinstance(items, list):
        raise WireFormatError("a batch is a list of (payload, refs) pairs")
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], bytes)):
            raise WireFormatError("a batch is a list of (payload, refs) pairs")
        refs = item[1] or []
        if not isinstance(refs, list) or not all(isinstance(r, ray.ObjectRef) for r in refs):
            raise WireFormatError("a message's object references must be a list of ray.ObjectRef")
        out.append((item[0], refs))
    return out
