"""Why every island has one scheduler: collectives must run in the same order on every host.

    python -m examples.gang_scheduling [--programs 20] [--timeout 20]

Two kinds of program share a 2-host island, each one cross-host collective of
a different shape (an all-reduce and an all-gather). Through the island's
scheduler (the product path) every host admits the fragments in one total
order, so they interleave freely and all finish.

Then the same two collectives run in plain multi-process JAX, two processes
of one ``jax.distributed`` group, the way two hosts would run them if each
queued its work in its own arrival order: process 0 launches the all-reduce
first, process 1 the all-gather. Each process enters a different collective,
neither can finish, and a timeout detects the deadlock that the scheduler
prevents.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw

UNORDERED = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.make_array_from_callback((4096,), NamedSharding(mesh, P("x")),
                                     lambda idx: np.arange(4096, dtype=np.float32)[idx])
    reduce_a = jax.jit(lambda v: jnp.sum(v) * jnp.ones(4096), out_shardings=NamedSharding(mesh, P()))
    gather_b = jax.jit(lambda v: v[::-1] * 2.0, out_shardings=NamedSharding(mesh, P()))
    order = (reduce_a, gather_b) if sys.argv[2] == "0" else (gather_b, reduce_a)
    for f in order:  # each process launches in its own order, as without a shared scheduler
        f(x).block_until_ready()
    print("finished", flush=True)
""")


def with_scheduler(programs: int) -> float:
    """Both kinds of program interleaved on a 2-host island, through its scheduler; seconds taken."""
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=2, devices_per_host=2),
            timeouts=pw.Timeouts(fetch=120.0, op=120.0))
    s = pw.slice((4,), ("x",))
    reduce_a = pw.jit(lambda v: jnp.sum(v) * jnp.ones(4096), slice=s, in_specs=(P("x"),), out_specs=P())
    gather_b = pw.jit(lambda v: v[::-1] * 2.0, slice=s, in_specs=(P("x"),), out_specs=P())
    x = pw.put(np.arange(4096, dtype=np.float32) / 4096, s, P("x"))
    x.block_until_ready()
    start = time.perf_counter()
    outs = [f(x) for _ in range(programs) for f in (reduce_a, gather_b)]
    for out in outs:
        out.block_until_ready()
    took = time.perf_counter() - start
    pw.shutdown()
    return took


def without_scheduler(timeout: float) -> bool:
    """The same collectives in two plain JAX processes launching them in different orders; True if they
    deadlocked (neither finished within ``timeout`` seconds)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", UNORDERED, coordinator, str(k)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env}) for k in range(2)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    stuck = any(p.poll() is None for p in procs)
    for p in procs:
        p.kill()
        p.wait()
    return stuck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=20, help="programs of each kind")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a stuck run counts as a deadlock")
    args = parser.parse_args()
    took = with_scheduler(args.programs)
    print(f"with the scheduler: {2 * args.programs} collective programs of two kinds, interleaved on a 2-host "
          f"island, finished in {took:.2f}s (every host ran them in the scheduler's order)")
    if without_scheduler(args.timeout):
        print(f"without a scheduler: DEADLOCK. Process 0 entered the all-reduce while process 1 entered the "
              f"all-gather; neither finished within {args.timeout:.0f}s.")
    else:
        print("without a scheduler: finished (the two orders happened to line up this time)")


if __name__ == "__main__":
    main()
