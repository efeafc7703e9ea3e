"""Candidate transports for the cross-node data path, measured side by side between two processes.

Setup. Two processes on this machine (``multiprocessing`` spawn), each a JAX CPU backend of 4 devices: the
sender holds a float32 array sharded ``P("x")`` over its devices, the receiver lands the same array with
the same sharding. Each repetition runs every method once, in turn, so load on the shared machine falls
on all of them alike; medians are reported.

Methods:
  * raw TCP, k streams (k = 1, 2, 4): the array's bytes (each device shard's buffer, zero-copy
    ``np.asarray`` of the shard) cut into k contiguous parts, each sent with ``sendall`` on its own
    connection and received with ``recv_into`` straight into a preallocated buffer of the receiver; timed
    by the receiver from its request to the last byte. No serialization, no framing: the ceiling.
  * ``jax.experimental.transfer``: JAX's transfer server between independent processes
    (``start_transfer_server(client, addr, [addr] * n)``; the sender ``await_pull``s the array, the
    receiver ``pull``s it onto its devices), with 1 and 4 transport addresses (parallel connections).
  * Ray's object store across two Ray nodes (``--ray``): a two-node cluster (``benchmarks.nodes``); actor A
    returns ``np.asarray`` of its array, actor B on the other node ``jax.device_put``s it (minus the same
    two calls on a 1 KiB array).

    python -m benchmarks.network_transports [--sizes-mib 64 256] [--reps 5] [--no-ray] [--out PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import Table, default_out, median, write_json  # noqa: E402

MIB = 2**20
DEVICES = 4
STREAMS = (1, 2, 4)
JAX_TRANSPORTS = (1, 4)
TIMEOUT_S = 120.0


def _jax_env() -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"


def _array(nbytes: int, fill: bool):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    shape = (1024, nbytes // 4 // 1024)
    if not fill:
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
    value = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    return jax.block_until_ready(jax.device_put(value, sharding))


def _parts(total: int, k: int) -> list[tuple[int, int]]:
    step = -(-total // k)
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("the sender closed the stream early")
        view = view[n:]


def sender(commands, replies) -> None:
    """Serves each command (method, size) for the receiver: raw TCP on a listening socket, or JAX's server."""
    _jax_env()
    import jax
    import numpy as np
    from jax.experimental import transfer

    client = jax.devices()[0].client
    servers = {n: transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"] * n)
               for n in JAX_TRANSPORTS}
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    replies.put(("ready", listener.getsockname()[1], {n: s.address() for n, s in servers.items()}))
    arrays: dict[int, jax.Array] = {}
    uuid = 0
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        method, nbytes, k = cmd
        if nbytes not in arrays:
            arrays[nbytes] = _array(nbytes, fill=True)
        x = arrays[nbytes]
        if method == "jax":
            uuid += 1
            servers[k].await_pull(uuid, [x])
            replies.put(("armed", uuid))
            continue
        # raw TCP: the shards' buffers, contiguous in device order, k parts on k connections
        views = [memoryview(np.asarray(s.data)).cast("B") for s in x.addressable_shards]
        flat = _Concat(views)
        conns = [listener.accept()[0] for _ in range(k)]
        for conn in conns:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for conn in conns:  # one request byte per stream
            conn.recv(1)
        threads = [threading.Thread(target=flat.send, args=(conn, a, b))
                   for conn, (a, b) in zip(conns, _parts(flat.nbytes, k))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for conn in conns:
            conn.close()


class _Concat:
    """Several buffers read as one byte range (the shards of an array, back to back)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.nbytes = sum(v.nbytes for v in views)

    def send(self, conn: socket.socket, a: int, b: int) -> None:
        base = 0
        for view in self.views:
            lo, hi = max(a, base), min(b, base + view.nbytes)
            if lo < hi:
                conn.sendall(view[lo - base:hi - base])
            base += view.nbytes


def receiver(commands, replies, port: int, jax_addresses: dict) -> None:
    _jax_env()
    import jax
    import numpy as np
    from jax.experimental import transfer

    from resource_manager.host.buffer_pool import aligned_empty

    client = jax.devices()[0].client
    own = transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"] * max(JAX_TRANSPORTS))
    conns = {n: own.connect(addr) for n, addr in jax_addresses.items()}
    landing: dict[int, np.ndarray] = {}
    replies.put(("ready",))
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        method, nbytes, k, uuid = cmd
        if method == "jax":
            start = time.perf_counter()
            (y,) = conns[k].pull(uuid, [_array(nbytes, fill=False)])
            y.block_until_ready()
            seconds = time.perf_counter() - start
            ok = float(np.asarray(y[1, 0])) == float(y.shape[1])
            replies.put((seconds, ok))
            continue
        out = landing.get(nbytes)
        if out is None:
            out = landing[nbytes] = aligned_empty((nbytes,), np.uint8)
            out.fill(0)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(k)]
        view = memoryview(out)
        start = time.perf_counter()
        threads = []
        for sock, (a, b) in zip(socks, _parts(nbytes, k)):
            sock.sendall(b"r")
            threads.append(threading.Thread(target=_recv_exactly, args=(sock, view[a:b])))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        for sock in socks:
            sock.close()
        ok = float(out[4:8].view(np.float32)[0]) == 1.0
        replies.put((seconds, ok))


class Pair:
    """The two processes and the round trip of one measured transfer."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.to_send, self.from_send = ctx.Queue(), ctx.Queue()
        self.to_recv, self.from_recv = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=sender, args=(self.to_send, self.from_send), daemon=True)]
        self.procs[0].start()
        _, port, addresses = self.from_send.get(timeout=TIMEOUT_S)
        self.procs.append(ctx.Process(target=receiver, args=(self.to_recv, self.from_recv, port, addresses),
                                      daemon=True))
        self.procs[1].start()
        self.from_recv.get(timeout=TIMEOUT_S)

    def move(self, method: str, nbytes: int, k: int) -> float:
        self.to_send.put((method, nbytes, k))
        uuid = self.from_send.get(timeout=TIMEOUT_S)[1] if method == "jax" else 0
        self.to_recv.put((method, nbytes, k, uuid))
        seconds, ok = self.from_recv.get(timeout=TIMEOUT_S)
        if not ok:
            raise AssertionError(f"{method} x{k}: the received array is wrong")
        return seconds

    def close(self) -> None:
        self.to_send.put(None)
        self.to_recv.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class RayPath:
    """Actor to actor across two Ray nodes of this machine, through the object stores."""

    def __init__(self) -> None:
        os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pwnet-", dir="/tmp")
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from benchmarks.nodes import TwoNodes
        from benchmarks.transfer import Endpoint

        self.ray = ray
        self.cluster = TwoNodes(store_bytes=3 * 2**29)
        ray.init(address=self.cluster.address)
        env = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
        self.actors = [ray.remote(Endpoint).options(num_cpus=0, runtime_env=env, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(n, soft=False))).remote() for n in (self.cluster.head, self.cluster.worker)]
        self.held = 0

    def move(self, nbytes: int) -> float:
        a, b = self.actors
        ray = self.ray
        if self.held != nbytes:
            ray.get(a.hold.remote((1024, nbytes // 4 // 1024)), timeout=TIMEOUT_S)
            self.held = nbytes
            ray.get(b.consume.remote(a.produce.remote(False)), timeout=TIMEOUT_S)

        def once(tiny: bool) -> float:
            start = time.perf_counter()
            ray.get(b.consume.remote(a.produce.remote(tiny)), timeout=TIMEOUT_S)
            return time.perf_counter() - start

        return max(once(False) - once(True), 1e-9)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.ray.shutdown()
        self.cluster.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-ray", action="store_true", help="skip Ray's object-store path (no Ray cluster)")
    parser.add_argument("--out", type=Path, default=default_out("network_transports"))
    args = parser.parse_args(argv)
    methods = [("tcp", k) for k in STREAMS] + [("jax", n) for n in JAX_TRANSPORTS]
    names = {("tcp", k): f"raw TCP x{k}" for k in STREAMS}
    names.update({("jax", n): f"jax.experimental.transfer x{n}" for n in JAX_TRANSPORTS})
    names[("ray", 0)] = "Ray object store, 2 nodes"
    load = os.getloadavg()
    ray_path = None if args.no_ray else RayPath()
    if ray_path is not None:
        methods.append(("ray", 0))
    pair = Pair()
    samples: dict[tuple, list[float]] = {}
    try:
        for size in args.sizes_mib:
            nbytes = size * MIB
            for method, k in methods:  # warm: landing buffers, connections, compiled transfers
                (ray_path.move(nbytes) if method == "ray" else pair.move(method, nbytes, k))
            for _ in range(args.reps):
                for method, k in methods:
                    s = ray_path.move(nbytes) if method == "ray" else pair.move(method, nbytes, k)
                    samples.setdefault((size, method, k), []).append(s)
            print(f"  {size} MiB done", flush=True)
    finally:
        pair.close()
        if ray_path is not None:
            ray_path.close()
    table = Table(["size", "method", "time", "bandwidth", "vs raw TCP x1"])
    rows = []
    for size in args.sizes_mib:
        base = size * MIB / median(samples[(size, "tcp", 1)]) / 1e9
        for method, k in methods:
            t = median(samples[(size, method, k)])
            gbps = size * MIB / t / 1e9
            table.add(f"{size} MiB", names[(method, k)], f"{t * 1e3:.1f} ms", f"{gbps:.2f} GB/s",
                      f"{gbps / base:.2f}x")
            rows.append({"size_mib": size, "method": names[(method, k)], "median_s": t, "gbps": gbps,
                         "samples_s": samples[(size, method, k)]})
    print()
    print(f"Two processes of {DEVICES} CPU devices each, float32 sharded P(x), medians of {args.reps} "
          f"(interleaved); load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end on "
          f"{os.cpu_count()} cores")
    print(table.render())
    out = write_json(args.out, {"benchmark": "network_transports", "reps": args.reps, "rows": rows,
                                "load_average_at_start": load})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
