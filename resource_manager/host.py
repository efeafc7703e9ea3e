"""A host of an island: one Ray actor owning local JAX devices, a buffer table and an executable cache.

Its devices are fixed by the actor's ``runtime_env`` before JAX is imported.
It admits fragments in the island scheduler's sequence order, runs them, sends
shards straight to other islands' hosts, and serves fetches with a timeout.
Host 0 also holds the island's scheduler and serves its methods (clients'
messages, the resource manager's grants) on a thread of their own, the
``schedule`` concurrency group, so they never wait behind fetches. Ray does
not keep the order of a threaded actor's calls, so clients number their
messages and the scheduler restores the order.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from pathways import wire
from pathways.errors import WireFormatError, from_wire
from pathways.events import EventLog
from pathways.names import CLIENT_ID_BITS, FETCH_TIMED_OUT, host_name
from pathways.sharding import dtype_from_wire, index_from_wire
from resource_manager.buffers import BufferTable, Failure
from resource_manager.executables import ExecutableCache
from resource_manager.scheduler import Scheduler

SCHEDULE = "schedule"  # the concurrency group of the scheduler's methods: one thread of their own


log = logging.getLogger(__name__)


class Host:
    def __init__(self, island: int, index: int, n_hosts: int, namespace: str, op_timeout: float) -> None:
        self.island, self.index, self.n_hosts = island, index, n_hosts
        self.namespace = namespace
        self.op_timeout = op_timeout
        self._cond = threading.Condition()
        self._pending: dict[int, tuple] = {}
        self._next_seq = 0
        self._templates = wire.TemplateCache()
        self._peers: dict[tuple[int, int], Any] = {}
        self.scheduler = Scheduler(island, self._forward) if index == 0 else None
        # host 0 admits its share of a batch carrying puts here, while their values arrive
        self._admitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="admit") if index == 0 else None
        self.table = BufferTable(self._cond)
        self.exes = ExecutableCache()
        self.events = EventLog()
        self.started = time.time()
        self.executor = None
        self.devices = None
        self.metrics = None
        self.network = None

    # -- start-up ---------------------------------------------------------------------------------
    def coordinator(self) -> str:
        """A free address for this island's jax.distributed coordinator (called on host 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ip}:{s.getsockname()[1]}"

    def start(self, coordinator: str | None, network_secret: bytes | None = None) -> dict:
        """Join the island's jax.distributed group, open the data paths; returns this host's info for the manager.

        ``network_secret``: the secret the runtime's hosts authenticate each other with on the network data
        path, handed out by the resource manager (seam(identity): the tenant-identity work may bind it to its
        session credentials instead)."""
        import jax

        if self.n_hosts > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes=self.n_hosts, process_id=self.index,
                                       initialization_timeout=120)
        from resource_manager.buffer_pool import BufferPool
        from resource_manager.channel import open_channel
        from resource_manager.devices import LocalDevices
        from resource_manager.direct import Peers, allow_peer_reads
        from resource_manager.executor import Executor

        self.devices = LocalDevices(self.index)
        self.pool = BufferPool()
        self.node = ray.get_runtime_context().get_node_id()
        allow_peer_reads()
        self.channel = open_channel(f"pathways/{self.namespace}/{self.island}.{self.index}/{os.getpid()}",
                                    self._on_frame)
        self.network = self._open_network(network_secret)
        peers = Peers(self.node, self.index, self._peer, self.channel, self.network)
        self.executor = Executor(self.island, self.index, self.devices, self.table, self.exes, self._cond,
                                 self.scheduler, strict=self.n_hosts > 1, op_timeout=self.op_timeout,
                                 events=self.events, peers=peers, pool=self.pool)
        from resource_manager.metrics import HostMetrics

        self.metrics = HostMetrics(self.island, self.index, self.stats)
        return {"island": self.island, "host": self.index, "pid": os.getpid(),
                "ip": ray.util.get_node_ip_address(),
                "node": self.node, "devices": self.devices.describe(),
                "data": self.network.address if self.network is not None else ""}

    # -- seam(network): the cross-node data path (resource_manager/network) ---------------------------
    def _open_network(self, secret: bytes | None) -> Any:
        from resource_manager.network.path import from_resource_manager, landing_alloc, open_network_path

        return open_network_path((self.island, self.index), self.node, ray.util.get_node_ip_address(), secret,
                                 landing_alloc(self.pool.take), self._on_network_piece,
                                 from_resource_manager(self.namespace), stale_s=self.op_timeout)

    def _on_network_piece(self, key: int, src: int, shard: tuple, array: np.ndarray) -> None:
        """A piece a peer on another node sent, accepted for its receive: file it for the recv op."""
        with self._cond:
            self.executor.deliver({"key": key, "src": src, "shards": [shard]}, (array,))

    def probe_network(self, island: int, host: int, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes to host ``host`` of island ``island`` over one plain connection
        of the data path (landed and acknowledged there): the bare link, to compare transfers against."""
        if self.network is None:
            raise RuntimeError("this host runs no network data path")
        if not 0 < int(nbytes) <= 2**31:
            raise ValueError(f"a probe moves 1 byte to 2 GiB, not {nbytes}")
        return self.network.probe(int(island), int(host), int(nbytes))

    def _peer(self, island: int, host: int) -> Any:
        handle = self._peers.get((island, host))
        if handle is None:
            handle = ray.get_actor(host_name(island, host), namespace=self.namespace)
            self._peers[(island, host)] = handle
        return handle

    # -- the island's scheduler (host 0) -----------------------------------------------------------
    @ray.method(concurrency_group=SCHEDULE)
    def submit(self, payload: bytes, refs: list | None = None) -> None:
        self.scheduler.submit(payload, refs)

    @ray.method(concurrency_group=SCHEDULE)
    def submit_batch(self, client: int, first: int, items: list) -> None:
        self.scheduler.submit_batch(client, first, items)

    @ray.method(concurrency_group=SCHEDULE)
    def grant(self, key: str, tenant: str, desc: dict) -> None:
        self.scheduler.grant(key, tenant, desc)

    @ray.method(concurrency_group=SCHEDULE)
    def revoke(self, keys: list[str]) -> None:
        self.scheduler.revoke(keys)

    @ray.method(concurrency_group=SCHEDULE)
    def grant_client(self, client: int, tenant: str) -> None:
        self.scheduler.grant_client(client, tenant)

    @ray.method(concurrency_group=SCHEDULE)
    def revoke_client(self, client: int) -> None:
        self.scheduler.revoke_client(client)

    @ray.method(concurrency_group=SCHEDULE)
    def set_weight(self, tenant: str, weight: float) -> None:
        self.scheduler.set_weight(tenant, weight)

    def schedule_stats(self) -> dict:
        return self.scheduler.stats()

    def _forward(self, batch: list) -> None:
        """The scheduler's batch to every host: this one's without an actor call. A batch carrying puts
        waits for their values on another thread, so neither the scheduler nor the executor blocks."""
        for h in range(1, self.n_hosts):
            self._peer(self.island, h).enqueue_batch.remote(batch)
        if any(refs for _, _, refs, _ in batch):
            self._admitter.submit(self._enqueue_logged, batch)
        else:
            self._enqueue_logged(batch)

    def _enqueue_logged(self, batch: list) -> None:
        try:
            self.enqueue_batch(batch)
        except Exception:  # the caller is the scheduler, not the client: say why the batch was not admitted
            log.exception("island %d: admitting a batch failed", self.island)

    # -- the island scheduler's ordered stream ----------------------------------------------------
    def enqueue(self, seq: int, payload: bytes, refs: list | None = None, refusal: list | None = None) -> None:
        """Accept the message with sequence number ``seq``; it is admitted once all before it are.

        A message the scheduler refused (``refusal`` = [kind, message]) is admitted as a run whose every
        output fails with that error, so the client learns why instead of waiting.
        """
        self.enqueue_batch([(seq, payload, refs, refusal)])

    def enqueue_batch(self, items: list) -> None:
        """Accept several ``(seq, payload, refs, refusal)`` messages in one call (see ``enqueue``): the
        scheduler forwards all it releases at once. A malformed item raises after the others are accepted."""
        accepted, error = [], None
        for seq, payload, refs, refusal in items:
            try:
                msg = wire.decode(payload, "call", "put", "free")
                template = self._templates.get(msg["template"]) if msg["kind"] == "call" else None
            except WireFormatError as exc:
                error = error or exc
                continue
            values = ray.get(refs, timeout=self.op_timeout) if refs and refusal is None else []
            accepted.append((seq, msg, template, values, refusal))
        with self._cond:
            for seq, *entry in accepted:
                if seq < self._next_seq or seq in self._pending:
                    error = error or WireFormatError(f"sequence number {seq} was already admitted on island "
                                                     f"{self.island}")
                    continue
                self._pending[seq] = tuple(entry)
            while self._next_seq in self._pending:
                self._admit(self._next_seq, *self._pending.pop(self._next_seq))
                self._next_seq += 1
        if error is not None:
            raise error

    def _admit(self, seq: int, msg: dict, template: dict | None, values: list, refusal: list | None) -> None:
        from resource_manager.executor import Run

        tenant = msg["tenant"]
        if refusal is not None:
            if msg["kind"] == "free":
                return  # a refused free frees nothing
            if msg["kind"] == "put":
                ops = [{"op": "put", "id": msg["id"]}]
                run = Run(seq, tenant, "put", ops, {})
            else:
                run = Run(seq, tenant, template["program"], template["ops"], template["slices"],
                          template["n_inputs"], msg["base"], msg["inputs"])
            run.refusal = Failure(*refusal)
            self.executor.admit(run)
            return
        if msg["kind"] == "free":
            self.table.free(msg["ids"], tenant)
            if msg.get("everything"):
                self.table.free_client(msg["client"], tenant, CLIENT_ID_BITS)
            return
        if msg["kind"] == "put":
            if msg.get("per_host"):
                hosts = sorted({h for h, _ in msg["slice"]["devices"]})
                value = values[hosts.index(self.index)] if self.index in hosts else {}
            else:
                value = np.asarray(values[0]).reshape(msg["aval"]["shape"])
            op = {"op": "put", "id": msg["id"], "slice": msg["slice"], "spec": msg["spec"], "aval": msg["aval"],
                  "value": value}
            self.executor.admit(Run(seq, tenant, "put", [op], {}))
            return
        for exe_hash, blob in msg["exes"].items():
            self.exes.add(exe_hash, blob)
        self.table.free(msg["frees"], tenant)
        self.executor.admit(Run(seq, tenant, template["program"], template["ops"], template["slices"],
                                template["n_inputs"], msg["base"], msg["inputs"]))

    # -- data plane -------------------------------------------------------------------------------
    def deliver(self, meta: bytes, *pieces: np.ndarray) -> None:
        """Shards sent by a host of another island (by Ray: another node), for a recv op here."""
        self._file(wire.decode(meta, "deliver"), pieces)

    def _on_frame(self, meta: bytes, data: memoryview) -> None:
        """A frame from a host on this node: shards lent or carried in ``data``, or leases coming back."""
        msg = wire.decode(meta, "deliver", "returned")
        if msg["kind"] == "returned":
            self.executor.peers.release(msg["leases"])
            return
        pieces: tuple = ()
        if msg.get("dtype") is not None:  # small shards, back to back in the frame
            dtype, offset, out = dtype_from_wire(msg["dtype"]), 0, []
            for shard in msg["shards"]:
                shape = [b - a for a, b in shard]
                count = int(np.prod(shape, dtype=np.int64))
                out.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
                offset += count * dtype.itemsize
            if offset != len(data):
                raise WireFormatError(f"deliver: the shards take {offset} bytes but the frame carries {len(data)}")
            pieces = tuple(out)
        self._file(msg, pieces)

    def _file(self, msg: dict, pieces: tuple) -> None:
        from resource_manager.direct import Lent

        lent = msg.get("direct")
        if lent is not None:
            if pieces or len(lent["addrs"]) != len(msg["shards"]):
                raise WireFormatError(f"deliver: {len(msg['shards'])} lent shard indices but {len(lent['addrs'])} "
                                      f"addresses and {len(pieces)} attached arrays")
            src = (msg["src"], lent["host"])
            pieces = tuple(Lent(lent["pid"], addr, index_from_wire(shard), src, lent["lease"], lent["channel"])
                           for addr, shard in zip(lent["addrs"], msg["shards"]))
        if len(pieces) != len(msg["shards"]):
            raise WireFormatError(f"deliver: {len(msg['shards'])} shard indices but {len(pieces)} arrays")
        with self._cond:
            self.executor.deliver(msg, pieces)

    def probe_direct(self, node: str, pid: int, addr: int, expected: bytes) -> str:
        """This host's channel address if it can copy lent shards out of process ``pid`` (same Ray node,
        and permitted), else ""."""
        from resource_manager.direct import can_read

        ok = self.channel is not None and node == self.node and can_read(pid, addr, expected)
        return self.channel.address if ok else ""

    def release_lent(self, leases: list[int]) -> None:
        """A receiver has copied these leases' shards: let go of them."""
        self.executor.peers.release(leases)

    def fetch(self, payload: bytes) -> Any:
        """A buffer's value as numpy (or this host's shards of it); waits at most the given timeout."""
        msg = wire.decode(payload, "fetch")
        entry = self.table.wait(msg["id"], msg["tenant"], msg["timeout"])
        if entry is None:  # the client raises its own timeout; an error here would only be logged unread
            return FETCH_TIMED_OUT
        value = entry.value
        if isinstance(value, Failure):
            raise from_wire(value.kind, value.message)
        if msg["ready_only"]:
            value.block_until_ready()
            return None
        if value.is_fully_addressable:
            return np.asarray(value)
        from resource_manager.transfer import local_pieces

        return {tuple(map(tuple, idx)): np.asarray(data) for idx, data in local_pieces(value).items()}

    # -- control ----------------------------------------------------------------------------------
    def island_failed(self, island: int) -> None:
        self.executor.island_failed(island)

    def release_tenant(self, tenant: str) -> int:
        return self.table.free_tenant(tenant)

    def ping(self) -> float:
        """This host's wall clock: also what the client uses to estimate the clock offset."""
        return time.time()

    def trace_start(self) -> float:
        return self.events.start()

    def trace_stop(self) -> list:
        return self.events.stop()

    def reset_peak(self) -> int:
        """Restart the buffer table's peak-bytes counter (e.g. before a step to measure); returns the old peak."""
        return self.table.reset_peak()

    def stalled(self, tenant: str) -> dict:
        """What this host's admitted fragments of ``tenant`` wait for, and how many messages it holds until
        an earlier sequence number arrives (see ``Executor.stalled``)."""
        with self._cond:
            held = len(self._pending)
        return {"island": self.island, "host": self.index, "held": held, "runs": self.executor.stalled(tenant)}

    def stats(self) -> dict:
        with self._cond:
            out = {"island": self.island, "host": self.index, "pid": os.getpid(), "buffers": len(self.table),
                   "buffer_bytes": self.table.nbytes, "peak_buffer_bytes": self.table.peak_bytes,
                   "by_tenant": self.table.by_tenant(),
                   "compiles": self.exes.compiles, "cache_hits": self.exes.hits, "executables": len(self.exes),
                   "next_seq": self._next_seq, "waiting": len(self._pending),
                   "uptime_s": time.time() - self.started,
                   "busy_fraction": self.metrics.busy_fraction if self.metrics is not None else 0.0}
            out.update(self.executor.stats())
            out.update(self.pool.stats())
            if self.channel is not None:
                out.update(frames_in=self.channel.frames_in, frames_out=self.channel.frames_out)
        if self.network is not None:  # seam(network): the data path's counters
            out.update(self.network.stats())
        return out
