"""What one node allows a same-node weight sync: the copies between two processes it could use, against memcpy.

The memcpy is the one ``benchmarks.weight_sync`` measures a sync against.

A weight sync between islands on one node must copy every byte out of the trainer's host into the sampler's (the
layouts differ, so no byte can be shared as is). Whatever the runtime does around it, it cannot beat the fastest
such copy. In one run, alternating, with the bytes of PaLM ``medium`` (227 MiB) held as JAX arrays on 4 CPU
devices of another process started as island hosts are (huge-page malloc):

- ``memcpy``: ``np.copyto`` between two arrays of this process, one thread (the weight-sync benchmark's baseline);
- ``memcpy x2``: the same on two threads;
- ``read x1`` / ``read x2``: this process copies the other's arrays with ``process_vm_readv`` (the runtime's
  same-node path), on one and on two threads;
- ``write x1`` / ``write x2``: the other process copies its arrays into a shared mapping of this process's memory
  (a ``memfd`` mapped once in both), on one and on two threads;
- ``reshard read x1`` / ``reshard read x2``: the copy ``benchmarks.weight_sync`` times, alone: PaLM ``medium``'s
  parameters (238 MB), held by the other process in the trainer's (2, 2) layout, read into the sampler's (1, 4)
  layout with the host's own copy plans (``copy_plan.make``), on one thread and as the host reads them
  (``direct.read_all``: its threads, two on 2 cores, take the calls longest first). Their runs are 1-4 KiB
  long (the rows of the shards the two layouts share), where the contiguous copies above move 4 MiB at a time.

The last line is the most a one-node weight sync of PaLM ``medium`` could reach against memcpy with nothing but
its copy: memcpy's time over that of the host's read.

    python -m benchmarks.copy_ceiling [--mib 227] [--reps 7]
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.common import Table, median, timed

CHUNK = 4 << 20  # bytes per copy call, as the runtime's read path cuts them
DEVICES = 4


def reshard_leaves() -> list[tuple[tuple[int, ...], list, list]]:
    """PaLM ``medium``'s parameters as (shape, the trainer's distinct regions, the sampler's region per device),
    float32, in the layouts ``benchmarks.weight_sync`` moves them between."""
    import jax

    from benchmarks.weight_sync import MEDIUM, SAMPLER_MESH, TRAINER_MESH
    from examples.palm import model
    from examples.palm.config import PalmConfig
    from pathways.sharding import shard_index

    shapes = jax.eval_shape(lambda: model.init_params(PalmConfig(**MEDIUM), jax.random.key(0)))
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    axes = ("data", "model")
    leaves = []
    for leaf, have, want in zip(jax.tree_util.tree_leaves(shapes),
                                jax.tree_util.tree_leaves(model.param_specs(shapes), is_leaf=is_spec),
                                jax.tree_util.tree_leaves(model.param_specs(shapes, data_axis=None), is_leaf=is_spec)):
        shape = tuple(leaf.shape)
        pieces = list(dict.fromkeys(shard_index(shape, TRAINER_MESH, axes, have, k) for k in range(DEVICES)))
        leaves.append((shape, pieces, [shard_index(shape, SAMPLER_MESH, axes, want, k) for k in range(DEVICES)]))
    return leaves


def _halves(nbytes: int, threads: int) -> list[tuple[int, int]]:
    step = -(-nbytes // threads)
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]


def holder(nbytes: int, fd_in: int, fd_out: int) -> None:
    """The other process: JAX arrays of ``nbytes`` over its devices; says their addresses, then copies them into the
    shared mapping it is given as often as asked (``threads`` per request), answering with the seconds taken."""
    import jax
    import jax.numpy as jnp

    per = nbytes // DEVICES // 4
    arrays = [jax.device_put(jnp.arange(per, dtype=jnp.float32) + k, d) for k, d in enumerate(jax.devices()[:DEVICES])]
    pieces = [jax.device_put(jnp.full(tuple(b - a for a, b in region), k, jnp.float32), jax.devices()[k % DEVICES])
              for k, (_, regions, _) in enumerate(reshard_leaves()) for region in regions]
    for a in arrays + pieces:
        a.block_until_ready()
    addrs = [a.unsafe_buffer_pointer() for a in arrays + pieces]
    os.write(fd_out, (" ".join(map(str, [os.getpid(), len(arrays)] + addrs)) + "\n").encode())
    requests = os.fdopen(fd_in)
    path = requests.readline().strip()
    shared = mmap.mmap(os.open(path, os.O_RDWR), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    out = np.frombuffer(shared, np.uint8)
    views = [np.asarray(a).view(np.uint8) for a in arrays]
    pool = ThreadPoolExecutor(2)

    def fill(part: int, threads: int) -> None:
        for k, v in enumerate(views):
            lo, hi = _halves(v.nbytes, threads)[part]
            out[k * v.nbytes + lo:k * v.nbytes + hi] = v[lo:hi]

    for line in requests:
        threads = int(line)
        start = time.perf_counter()
        list(pool.map(fill, range(threads), [threads] * threads))
        os.write(fd_out, f"{time.perf_counter() - start}\n".encode())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=227, help="MiB copied (PaLM medium's parameters: 227)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each copy (median reported)")
    parser.add_argument("--holder", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    if args.holder:
        holder(nbytes, *args.holder)
        return 0
    from pathways.topology import Topology
    from resource_manager.host import copy_plan
    from resource_manager.host.buffer_pool import aligned_empty
    from resource_manager.host.transport import direct
    from resource_manager.host.transport.direct import Lent
    from resource_manager.island import host_runtime_env

    if not direct.readable():
        print("this platform has no process_vm_readv: nothing to measure")
        return 0
    to_holder, from_us = os.pipe()
    from_holder, to_us = os.pipe()
    env = dict(os.environ, **host_runtime_env(Topology(islands=1, devices_per_host=DEVICES))["env_vars"])
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.copy_ceiling", "--mib", str(args.mib), "--holder",
                             str(to_holder), str(to_us)], pass_fds=(to_holder, to_us), env=env)
    os.close(to_holder)
    os.close(to_us)  # the holder's ends: a holder that dies ends our reads
    answers = os.fdopen(from_holder)

    def answer() -> str:
        line = answers.readline()
        if not line:
            raise RuntimeError(f"the holder process ended (exit code {proc.wait(timeout=30)}); see its error above")
        return line

    try:
        pid, count, *numbers = map(int, answer().split())
        addrs, piece_addrs = numbers[:count], iter(numbers[count:])
        per = nbytes // DEVICES
        dst = aligned_empty((nbytes,), np.uint8)
        dst[:] = 0
        src, copy = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        calls = [(pid, direct._iovecs(np.array([dst.ctypes.data + k * per + lo]), np.array([min(CHUNK, per - lo)])),
                  direct._iovecs(np.array([addr + lo]), np.array([min(CHUNK, per - lo)])), min(CHUNK, per - lo))
                 for k, addr in enumerate(addrs) for lo in range(0, per, CHUNK)]
        reshard, landed_leaves = [], []
        for k, (_, regions, wanted) in enumerate(reshard_leaves()):
            plan = copy_plan.make(tuple(wanted), tuple(regions), 4)
            buffers = [aligned_empty([b - a for a, b in r], np.float32) for r in plan.regions]
            for buffer in buffers:
                buffer[...] = -1  # touched: the sync's landing buffers are reused, never fresh pages
            reshard += plan.reads([Lent(pid, next(piece_addrs), r, (0, 0), 0, "") for r in regions], buffers)
            landed_leaves.append((k, buffers))
        reshard_bytes = sum(call[3] for call in reshard)
        fd = os.memfd_create("copy-ceiling")
        os.ftruncate(fd, nbytes)
        shared = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.write(from_us, f"/proc/{os.getpid()}/fd/{fd}\n".encode())
        pools = {n: ThreadPoolExecutor(n) for n in (1, 2)}

        def memcpy(threads: int) -> Callable[[], None]:
            def run(part: int) -> None:
                lo, hi = _halves(nbytes, threads)[part]
                np.copyto(copy[lo:hi], src[lo:hi])
            return lambda: list(pools[threads].map(run, range(threads)))

        def read(threads: int) -> Callable[[], None]:
            return lambda: list(pools[threads].map(lambda call: direct._read(*call), calls))

        def write(threads: int) -> float:
            os.write(from_us, f"{threads}\n".encode())
            return float(answer())

        host_read = f"reshard read x{direct.THREADS}"
        cases: dict[str, Callable[[], float]] = {
            "memcpy": lambda: timed(memcpy(1)), "memcpy x2": lambda: timed(memcpy(2)),
            "read x1": lambda: timed(read(1)), "read x2": lambda: timed(read(2)),
            "write x1": lambda: write(1), "write x2": lambda: write(2),
            "reshard read x1": lambda: timed(lambda: [direct._read(*call) for call in reshard]),
            host_read: lambda: timed(lambda: direct.read_all(reshard))}
        for case in cases.values():  # warm: pages touched, threads started
            case()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, case in cases.items():
                times[name].append(case())
        landed = np.frombuffer(shared, np.float32)
        if not np.array_equal(landed[:4], np.arange(4, dtype=np.float32)) or \
                not np.array_equal(dst[:16].view(np.float32), np.arange(4, dtype=np.float32)):
            raise AssertionError("a copy did not land the other process's bytes")
        if any(not np.all(buffer == k) for k, buffers in landed_leaves for buffer in buffers):
            raise AssertionError("the reshard did not fill every landing buffer with the other process's bytes")
    finally:
        proc.kill()
        proc.wait()
    base = median(times["memcpy"])
    table = Table(["copy", "median", "GB/s", "time / memcpy", "runs"])
    for name, values in times.items():
        m, moved = median(values), reshard_bytes if name.startswith("reshard") else nbytes
        table.add(name, f"{m * 1e3:.2f} ms", f"{moved / m / 1e9:.2f}", f"{m / (base * moved / nbytes):.2f}x",
                  " ".join(f"{v * 1e3:.1f}" for v in values))
    print(f"{args.mib} MiB between two processes on one node ({os.cpu_count()} cores), medians of {args.reps}, "
          f"alternating; load average {os.getloadavg()[0]:.1f}")
    print(table.render())
    best = min(median(times[n]) for n in ("read x1", "read x2", "write x1", "write x2"))
    print(f"copy ceiling: fastest copy between processes {best * 1e3:.2f} ms against memcpy {base * 1e3:.2f} ms: "
          f"a same-node sync of these bytes can reach at most {base / best:.2f}x memcpy")
    resharded = median(times[host_read])
    print(f"reshard ceiling: PaLM medium's (2, 2) -> (1, 4) copy alone {resharded * 1e3:.2f} ms for "
          f"{reshard_bytes / 2**20:.0f} MiB against memcpy's {base * reshard_bytes / nbytes * 1e3:.2f} ms for as many "
          f"bytes: its weight sync can reach at most {base * reshard_bytes / nbytes / resharded:.2f}x memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
