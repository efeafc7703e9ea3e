"""Why every island has one scheduler: collectives from two clients must run in the same order on every host.

    python -m examples.gang_scheduling

Two clients share a 2-host island and each runs programs whose computations are cross-host collectives.
Through the island's scheduler (the product path) every host admits the fragments in one total order,
and all programs finish. Then the demo replays the same fragments *without* the scheduler, the way they
would arrive if each host queued them in its own arrival order: host 0 sees client A's fragment first,
host 1 sees client B's first. Each host enters a different collective, neither can finish, and the
island deadlocks; a fetch timeout detects it. The switch is this file's own replay loop: the product
path always goes through the scheduler.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import ray
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.lowering import lower
from pathways import wire


def workload(s: pw.VirtualSlice) -> tuple[pw.ProgramFunction, pw.ProgramFunction]:
    """Two clients' programs; each is one cross-host collective of a different shape."""
    reduce_a = pw.jit(lambda v: jnp.sum(v) * jnp.ones(4096), slice=s, in_specs=(P("x"),), out_specs=P())
    gather_b = pw.jit(lambda v: v[::-1] * 2.0, slice=s, in_specs=(P("x"),), out_specs=P())
    return pw.program(lambda v: reduce_a(v)), pw.program(lambda v: gather_b(v))


def replay_without_scheduler(session, island: int, messages: list[list[bytes]]) -> None:
    """Send each host the clients' messages in a different order, as independent arrival would."""
    hosts = session.islands[island].hosts
    for h, host in enumerate(hosts):
        first_seq = ray.get(host.stats.remote())["next_seq"]
        order = [m for pair in messages for m in (pair if h == 0 else pair[::-1])]
        for k, payload in enumerate(order):
            host.enqueue.remote(first_seq + k, payload)


def call_message(session, program: pw.ProgramFunction, arg: pw.Array) -> tuple[bytes, int]:
    traced, _ = program._traced((arg,))
    lowered = lower(traced.program, traced.exes)
    fragment = lowered.fragments[arg.slice.island]
    base = session.mint(lowered.n_values)
    payload = wire.encode("call", {"tenant": session.tenant, "client": session.client_id,
                                   "template": fragment.template, "base": base, "inputs": [arg.id],
                                   "exes": fragment.exes, "frees": []})
    return payload, base + traced.program.outputs[0].slot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=20, help="programs per client")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a stuck fetch is a deadlock")
    args = parser.parse_args()

    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=2, devices_per_host=2),
                      timeouts=pw.Timeouts(fetch=args.timeout, op=600.0))
    ordered_slice = pw.slice((4,), ("x",), island=0)
    a, b = workload(ordered_slice)
    x = pw.put(np.arange(4096, dtype=np.float32) / 4096, ordered_slice, P("x"))
    start = time.perf_counter()
    outs = [f(x) for _ in range(args.programs) for f in (a, b)]
    for out in outs:
        out.block_until_ready()
    print(f"with the scheduler: {len(outs)} collective programs from 2 clients finished in "
          f"{time.perf_counter() - start:.2f}s (every host ran them in the scheduler's order)")

    unordered_slice = pw.slice((4,), ("x",), island=1)
    a, b = workload(unordered_slice)
    y = pw.put(np.arange(4096, dtype=np.float32) / 4096, unordered_slice, P("x"))
    y.block_until_ready()
    pairs, outputs = [], []
    for _ in range(args.programs):
        (ma, oa), (mb, _) = call_message(session, a, y), call_message(session, b, y)
        pairs.append([ma, mb])
        outputs.append(oa)
    replay_without_scheduler(session, 1, pairs)
    probe = pw.Array(session, outputs[0], (4096,), np.float32, unordered_slice, P(), frozenset({1}))
    start = time.perf_counter()
    try:
        probe.block_until_ready(timeout=args.timeout)
        print("without the scheduler: finished (the collectives happened to line up this time)")
    except pw.IslandFailedError:
        print(f"without the scheduler: DEADLOCK. Host 0 entered client A's all-reduce while host 1 entered "
              f"client B's all-gather; detected by a {time.perf_counter() - start:.0f}s fetch timeout.")
    session.dead[1] = "deadlocked by the unordered replay"  # nothing more is sent to that island
    pw.shutdown()


if __name__ == "__main__":
    main()
