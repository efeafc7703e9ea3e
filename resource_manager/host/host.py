"""An island host's logic: a plain object that owns the host's parts and that Ray cannot call.

``HostActor`` (``actor``) is the only way Ray reaches it, for the runtime's own calls, each checked against
the runtime key; clients reach it through the host's client endpoint (``clients``), after proving their
session. Host 0 of each island also holds the island's admission and scheduler: a client's batch is
admitted, ordered and handed to host 0's own executor on the connection's thread, and to the other hosts as
one actor call per batch. Everything below the host flows back up as return values or reports, never as a
call into a layer above.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pathways import auth, wire
from pathways.budgets import Budgets
from pathways.errors import ClusterSuspendedError, PathwaysError, TenantAccessError, WireFormatError
from pathways.messages import (
    CONTROL,
    Deliver,
    EndSession,
    Free,
    Grant,
    IslandFailed,
    OpenSession,
    PeerTable,
    ReleaseTenant,
    Revoke,
    SetBudgets,
    SetWeight,
    client_of,
)
from pathways.ops import Limits
from resource_manager.host import wiring
from resource_manager.host.admission import Admitted
from resource_manager.host.grants import Session
from resource_manager.host.preemption import gc_cpu_s
from resource_manager.host.scheduler import NAMED, Continue, Group, Released, Resume

MAINTENANCE_S = 0.5
log = logging.getLogger(__name__)


def runtime_parts(rows: list) -> list:
    """What a MAC over host 0's rows covers: every field."""
    parts: list = []
    for row in rows:
        seq, kind, *rest = row
        parts += [seq, kind]
        if kind in ("resume", "part"):
            parts += list(rest)
            continue
        messages = rest[0] if kind == "group" else rest
        if kind == "group":  # the count too: no other reading of the same fields signs the same
            parts.append(len(messages))
        for message in messages:
            client, tenant, payload, refusal, lo, hi, end = message
            parts += [client, tenant, payload, *(refusal or ()), lo, hi, -1 if end is None else end]
    return parts


class Host:
    """Host ``index`` of island ``island`` (of ``n_hosts``), at restart ``epoch``.

    ``start`` brings up JAX (a jax.distributed group on a multi-host island) and the parts beneath the host
    (``wiring.build``). ``call_peer(island, host, method, *args)`` reaches another host of the runtime (its
    actor, through Ray); the host signs what it sends with the runtime key, bound to the receiving host.
    """

    def __init__(self, island: int, index: int, n_hosts: int, epoch: int, op_timeout: float,
                 gap_timeout: float) -> None:
        self.island, self.index, self.n_hosts, self.epoch = island, index, n_hosts, epoch
        self.op_timeout, self.gap_timeout = op_timeout, gap_timeout
        self.started = time.time()
        self.key: bytes | None = None
        self.parts: wiring.Parts | None = None
        self._tracers: dict[int, int] = {}
        self.quiescing = False  # the cluster is being suspended: host 0 takes no more batches

    # -- start-up ---------------------------------------------------------------------------------------
    def start(self, runtime_key: bytes, runtime_id: str, coordinator: str | None, islands: int, platform: str,
              node: str, ip: str, call_peer: Callable[..., Any]) -> dict:
        """Bring up JAX and the data plane; returns what the resource manager records of this host."""
        if self.key is not None:
            raise PathwaysError("this host has already started")
        import jax

        if self.n_hosts > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes=self.n_hosts, process_id=self.index,
                                       initialization_timeout=120)
        self.key = runtime_key
        self._call_peer = call_peer
        self.parts = p = wiring.build(self, runtime_key, runtime_id, islands, platform, node, ip)
        threading.Thread(target=self._maintain, name="host-maintenance", daemon=True).start()
        if p.scheduler is not None:
            threading.Thread(target=self._release_held, name="host-held", daemon=True).start()
        return {"island": self.island, "host": self.index, "pid": os.getpid(), "ip": ip, "node": node,
                "devices": p.devices.describe(), "channel": p.channel.address if p.channel is not None else "",
                "data": p.network.address if p.network is not None else "", "client": p.clients.address,
                "memory_bytes": p.limits.memory_bytes, "device_bytes": p.limits.device_bytes}

    @staticmethod
    def coordinator(ip: str) -> str:
        """A free address for this island's jax.distributed coordinator (asked of host 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ip}:{s.getsockname()[1]}"

    @property
    def limits(self) -> Limits:
        """What this host can hold."""
        return self.parts.limits

    def sign_for(self, island: int, host: int, purpose: str, *parts: Any) -> bytes:
        """The runtime key's MAC over ``parts``, bound to host ``host`` of ``island`` (so it is worth nothing
        sent anywhere else)."""
        return auth.sign(self.key, purpose, island, host, *parts)

    # -- the resource manager's orders --------------------------------------------------------------------
    def control(self, payload: bytes, handles: list | None) -> None:
        """An order of the resource manager (already verified): one handler per order class."""
        order = wire.parse(payload, *CONTROL)
        handler: dict[type, Callable[[Any], None]] = {
            OpenSession: self._open_session, EndSession: self._end_session, Grant: self._grant,
            Revoke: lambda o: self.parts.grants.revoke(o.keys), SetWeight: self._set_weight,
            SetBudgets: lambda o: self.parts.grants.set_budgets(o.tenant, Budgets.from_wire(o.budgets)),
            IslandFailed: self._island_failed, ReleaseTenant: lambda o: self.parts.table.free_tenant(o.tenant),
            PeerTable: lambda o: self._peers(o, handles or []),
        }
        handler[type(order)](order)

    def _open_session(self, order: OpenSession) -> None:
        self.parts.grants.add_session(order.client, order.tenant, order.key, Budgets.from_wire(order.budgets))
        if self.parts.scheduler is not None:
            self.parts.scheduler.set_weight(order.tenant, order.weight)

    def _set_weight(self, order: SetWeight) -> None:
        if self.parts.scheduler is not None:
            self.parts.scheduler.set_weight(order.tenant, order.weight)

    def _grant(self, order: Grant) -> None:
        self.parts.grants.grant(order.slice["key"], order.tenant, order.desc)

    def _island_failed(self, order: IslandFailed) -> None:
        p = self.parts
        p.peers.drop_island(order.island)
        p.receiver.island_failed(order.island)

    def _peers(self, order: PeerTable, handles: list) -> None:
        from resource_manager.host.transport.peers import PeerInfo

        infos = [PeerInfo(h["island"], h["host"], h["node"], h["pid"], h["channel"], h["data"], handle)
                 for h, handle in zip(order.hosts, handles)]
        for island in self.parts.peers.set_hosts(infos):
            self.parts.receiver.island_restored(island)

    def _end_session(self, order: EndSession) -> None:
        p = self.parts
        session = p.grants.remove_session(order.client)
        p.clients.close_session(order.client)
        p.uploads.drop_client(client_of, order.client)
        if session is None:
            return
        if p.admission is not None:
            p.admission.revoke(order.client)
            if order.free:  # in the island's order, after everything the client sent
                free = Free((), everything=True)
                entry = Admitted(order.client, session.tenant, free.encode(), free)
                self._forward(p.scheduler.queue([entry]))
        if session.tenant not in p.grants.tenants():  # its last session here: forget what it sent
            p.exes.drop_tenant(session.tenant)
            p.inbox.templates.forget(session.tenant)
            if p.admission is not None:
                p.admission.templates.forget(session.tenant)

    # -- clients' streams (host 0) ------------------------------------------------------------------------
    def submit(self, session: Session, first: int, msgs: list[bytes]) -> None:
        """Messages ``first``, ... of ``session``'s stream: each admitted or refused alone (a refusal reaches
        its outputs), then ordered with every other client's and handed to the island's hosts."""
        p = self.parts
        if p.admission is None:
            raise PathwaysError(f"host {self.index} of island {self.island} takes no client messages; host 0 does")
        if self.quiescing:
            raise ClusterSuspendedError("the cluster is being suspended by its admin; this batch was not taken, and "
                                        "the client sends it again once the cluster resumes")
        # checking the tenant's messages is the island's work for it: this thread's CPU time, garbage collection
        # aside (its wall time counts waits for the interpreter and for other processes, and a collection is the
        # host's work for everything it holds: no work of the tenant's), charged with the messages it let through
        start = time.thread_time() - gc_cpu_s()
        try:
            admitted = p.admission.accept(session.client, session.tenant, first, msgs)
        except BaseException:
            p.scheduler.charge(session.tenant, time.thread_time() - gc_cpu_s() - start)
            raise
        spent = time.thread_time() - gc_cpu_s() - start
        self._forward(p.scheduler.queue(admitted, session.tenant, spent, len(msgs)))

    def _forward(self, released: Released) -> None:
        """The scheduler's batch to every host: this one's without an actor call."""
        if not released:
            return
        if self.n_hosts > 1:
            rows = [(seq, "resume", item.seq, item.pc) if isinstance(item, Resume)
                    else (seq, "part", item.seq, item.lo, item.hi) if isinstance(item, Continue)
                    else (seq, "group", [entry.row() for entry in item.entries]) if isinstance(item, Group)
                    else (seq, "msg", item.row()) for seq, item in released]
            parts = runtime_parts(rows)
            for h in range(1, self.n_hosts):
                self._call_peer(self.island, h, "enqueue_batch", rows,
                                self.sign_for(self.island, h, "enqueue", *parts))
        self.parts.inbox.accept(released)

    def on_report(self, report: Any) -> None:
        """The executor's report: to the scheduler on host 0 (which speaks for the island), else landings only
        to host 0."""
        p = self.parts
        if p.scheduler is not None:
            released: Released = []
            if report.blocked:
                released += p.scheduler.blocked(report.blocked)
            if report.done:
                released += p.scheduler.completed(report.done)
            if report.landed:
                released += p.scheduler.landed(0, report.landed)
            self._forward(released)
        elif report.landed:
            pairs = [list(pair) for pair in report.landed]
            flat = [x for pair in pairs for x in pair] + [self.index]
            self._call_peer(self.island, 0, "landed", self.index, pairs,
                            self.sign_for(self.island, 0, "landed", *flat))

    def landed(self, host: int, pairs: list) -> None:
        """Host ``host`` has the data of these parked receives (multi-host islands; verified)."""
        self._forward(self.parts.scheduler.landed(host, [tuple(pair) for pair in pairs]))

    def enqueue_rows(self, rows: list) -> None:
        """Host 0's ordered rows for this host (verified)."""
        self.parts.inbox.accept_rows(rows)

    def _maintain(self) -> None:
        """Skip clients' stream gaps that never fill, drop uploads no put claimed, fail the host if its own order
        or executor stopped."""
        p = self.parts
        while p.executor.dead is None:
            time.sleep(MAINTENANCE_S)
            try:
                if p.admission is not None:
                    expired = p.admission.expire()
                    if expired:
                        self._forward(p.scheduler.queue(expired))
                p.uploads.expire()
                if p.inbox.stuck_for() > self.op_timeout:
                    p.executor.die(f"island {self.island} host {self.index} waited {self.op_timeout:.0f}s for "
                                   f"sequence {p.inbox.next_seq} from host 0; the island's order is broken")
            except Exception:  # the maintenance thread must outlive any one mistake
                log.exception("island %d host %d: maintenance failed", self.island, self.index)

    def _release_held(self) -> None:
        """Host 0: a throttled tenant's work goes out when its hold ends, even if nothing else happens on the island
        then (the scheduler's op_ms rule)."""
        p = self.parts
        while p.executor.dead is None:
            try:
                self._forward(p.scheduler.wait_due(MAINTENANCE_S))
            except Exception:  # this thread must outlive any one mistake
                log.exception("island %d host %d: releasing held work failed", self.island, self.index)
                time.sleep(MAINTENANCE_S)

    # -- suspend and resume -----------------------------------------------------------------------------
    def quiet(self) -> dict:
        """Whether this host has finished everything it was given: nothing admitted but unfinished, no lent
        shard out; with how far its share of the island's order has come (``next_seq``) and, on host 0, how
        far the order goes (``sequenced``). The island is quiet when every host is and has caught up."""
        p = self.parts
        busy = p.executor.busy() + p.inbox.held()
        next_seq = p.inbox.next_seq
        out = {"island": self.island, "host": self.index, "idle": busy == 0 and p.peers.lent_bytes == 0,
               "next_seq": next_seq, "busy": busy, "bytes": p.table.nbytes}
        if p.scheduler is not None:
            stats = p.scheduler.stats()
            out["sequenced"] = stats["sequenced"]
            out["idle"] = out["idle"] and stats["queued"] == 0 and stats["inflight"] == 0
        return out

    def save(self, directory: str) -> dict:
        """Write this host's part of a suspended cluster into ``directory`` (the host is quiet)."""
        from pathways.snapshot import Store
        from resource_manager.host import snapshot

        return snapshot.save(self.parts, Store(directory), self.island, self.index)

    def restore(self, directory: str, part: dict) -> dict:
        """Read this host's part of a suspended cluster back (the sessions it keeps are open already)."""
        from pathways.snapshot import Store
        from resource_manager.host import snapshot

        return snapshot.restore(self.parts, Store(directory), part, self.island, self.index)

    # -- data plane ---------------------------------------------------------------------------------------
    def deliver(self, meta: bytes, pieces: tuple[np.ndarray, ...]) -> None:
        """Shards sent by a host of another island through Ray (another node, or no channel; verified)."""
        msg = Deliver.from_wire(wire.decode(meta, "deliver"))
        if msg.direct is not None or len(pieces) != len(msg.shards):
            raise WireFormatError(f"deliver: {len(msg.shards)} shard indices but {len(pieces)} arrays")
        self.parts.receiver.deliver(msg, pieces, (msg.src, msg.host))

    def on_network_piece(self, key: int, sender: tuple[int, int], shard: tuple, array: np.ndarray) -> None:
        """A piece a runtime host on another node sent over the network path (authenticated there, and routed
        to this host by its receive's plan): file it for the recv op."""
        self.parts.receiver.deliver(Deliver(key, sender[0], sender[1], (shard,)), (array,), sender)

    def allowed_peer(self, pid: int) -> bool:
        """Whether ``pid`` (from a same-node socket's credentials) is one of the runtime's hosts."""
        return self.parts.peers.on_this_node(pid) is not None

    def on_frame(self, meta: bytes, data: memoryview, pid: int) -> None:
        """A frame from a runtime host on this node (its pid from the socket): shards lent or carried in
        ``data``, or leases coming back."""
        from resource_manager.host.transport.direct import Lent

        p = self.parts
        peer = p.peers.on_this_node(pid)
        if peer is None:
            raise TenantAccessError(f"a frame from pid {pid}, which is not one of this runtime's hosts")
        msg = wire.decode(meta, "deliver", "returned")
        if msg["kind"] == "returned":
            p.peers.release(msg["leases"])
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
        p.receiver.deliver(deliver, pieces, (peer.island, peer.host))

    def probe_direct(self, node: str, pid: int, addr: int, expected: bytes) -> str:
        """This host's channel address if it can copy lent shards out of runtime host ``pid`` (same node, and
        the kernel permits it), else ""."""
        from resource_manager.host.transport.direct import can_read

        p = self.parts
        ok = (p.channel is not None and node == p.node and p.peers.on_this_node(pid) is not None
              and can_read(pid, addr, expected))
        return p.channel.address if ok else ""

    def probe_network(self, island: int, host: int, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes to a peer over one plain connection of the network path."""
        if self.parts.network is None:
            raise PathwaysError("this host runs no network data path")
        if not 0 < int(nbytes) <= 2**31:
            raise PathwaysError(f"a probe moves 1 byte to 2 GiB, not {nbytes}")
        return self.parts.network.probe(int(island), int(host), int(nbytes))

    # -- what a client may ask of its own ------------------------------------------------------------------
    def stalled(self, tenant: str) -> dict:
        """What this host's admitted fragments of ``tenant`` wait for, and how many messages it holds until an
        earlier sequence number arrives."""
        p = self.parts
        return {"island": self.island, "host": self.index, "held": p.inbox.held(), "runs": p.executor.stalled(tenant)}

    def usage(self, tenant: str, reset_peak: bool) -> dict:
        """``tenant``'s buffers, bytes, peak bytes (restarted with ``reset_peak``) and executables here."""
        p = self.parts
        out = p.table.tenant_usage(tenant)
        if reset_peak:
            p.table.reset_peak(tenant)
        return {**out, **p.exes.tenant_stats(tenant), "island": self.island, "host": self.index}

    def trace_start(self, client: int) -> int:
        """Start recording this host's events for client ``client``'s ``pw.trace``."""
        token = self.parts.events.start()
        self._tracers[client] = token
        return token

    def trace_stop(self, client: int, tenant: str) -> list:
        """The client's trace: its tenant's events by name, everyone else's as anonymous spans."""
        from pathways.events import for_tenant

        return for_tenant(self.parts.events.stop(self._tracers.pop(client, None)), tenant)

    def schedule_stats(self, tenant: str | None) -> dict:
        """The island's share of time per tenant: ``tenant``'s by name and the others as one sum (every tenant
        by name for None, the admin's view)."""
        stats = self.parts.scheduler.stats()
        if tenant is None:
            return stats
        out = {k: v for k, v in stats.items() if k not in NAMED}
        for key in ("tenant_time_s", "tenant_time_recent_s"):
            times = stats[key]
            out[key] = {tenant: times.get(tenant, 0.0)}
            out[key.replace("tenant", "others")] = sum(v for t, v in times.items() if t != tenant)
        return out

    # -- health and aggregates (no tenant is named) -------------------------------------------------------
    @property
    def dead(self) -> str | None:
        """Why this host can no longer run (its executor died), or None."""
        return self.parts.executor.dead if self.parts is not None else None

    def stats(self) -> dict:
        """Counters of the whole host, with no tenant's name in them."""
        p = self.parts
        out = {"island": self.island, "host": self.index, "pid": os.getpid(), "epoch": self.epoch,
               "buffers": len(p.table), "buffer_bytes": p.table.nbytes, "peak_buffer_bytes": p.table.peak_bytes,
               "tenants": len(p.table.by_tenant()), "compiles": p.exes.compiles, "cache_hits": p.exes.hits,
               "executables": len(p.exes), "evictions": p.exes.evictions, "next_seq": p.inbox.next_seq,
               "waiting": p.inbox.held(), "uptime_s": time.time() - self.started,
               "busy_fraction": p.metrics.busy_fraction if p.metrics is not None else 0.0,
               "dead": p.executor.dead or ""}
        out.update(p.executor.stats())
        out.update(p.pool.stats())
        if p.channel is not None:
            out.update(frames_in=p.channel.frames_in, frames_out=p.channel.frames_out,
                       channel_refused=p.channel.refused)
        if p.network is not None:
            out.update(p.network.stats())
        out.update(p.clients.stats())
        if p.scheduler is not None:
            out["schedule"] = {k: v for k, v in p.scheduler.stats().items() if k not in NAMED}
            out["stream_gaps_waiting"] = p.admission.waiting()
        return out

    def census(self) -> dict:
        """Buffers and bytes per tenant: for the resource manager, to say what a restart lost."""
        return self.parts.table.by_tenant()
