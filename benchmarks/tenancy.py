"""Multi-tenancy on one island: weighted fair share of island time, and throughput of concurrent clients.

    python -m benchmarks.tenancy [--seconds 20] [--quick]

1. Four tenants with weights 1:2:4:8, each a separate client process keeping
   small programs queued on island 0. The island's scheduler accounts the
   island time each tenant receives; the table compares the shares measured
   while all four are backlogged with the weights (target: within ±10%).
2. N concurrent clients (separate processes, one tenant each, equal weights)
   running small computations: aggregate computations/s next to one client
   alone (target: aggregate ≥ one client's). Pathways saw several clients push
   an island to ~100% utilization.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import ray

from benchmarks.common import Table, default_out, median, write_json

WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}


def client(tenant: str, weight: float, start_at: float, end_at: float, size: int, depth: int) -> None:
    """One tenant's process: keep ``depth`` programs outstanding on island 0 between start_at and end_at."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import pathways as pw

    pw.init(tenant=tenant, weight=weight)
    s = pw.slice((2,), ("x",), island=0)
    f = pw.jit(lambda m: jax.lax.fori_loop(0, 4, lambda i, a: jnp.tanh(a @ m), m), slice=s,
               in_specs=(P("x"),), out_specs=P("x"))
    m = pw.put(np.eye(size, dtype=np.float32) * 0.5, s, P("x"))
    f(m).block_until_ready()
    time.sleep(max(0.0, start_at - time.time()))
    previous, done = None, 0
    while time.time() < end_at:  # keep between depth and 2*depth programs in flight, one wait per batch
        batch = [f(m) for _ in range(depth)]
        if previous is not None:
            previous.block_until_ready()
            done += depth
        previous = batch[-1]
    print(json.dumps({"tenant": tenant, "done": done, "seconds": end_at - start_at}), flush=True)
    pw.shutdown()


def spawn(tenant: str, weight: float, start_at: float, end_at: float, size: int, depth: int) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    args = [sys.executable, "-m", "benchmarks.tenancy", "--client", tenant, str(weight), str(start_at), str(end_at),
            str(size), str(depth)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"a tenant client failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def fair_share(session, seconds: float, startup: float) -> dict:
    """Island time per tenant over the middle of a run where all four tenants stay backlogged."""
    scheduler = session.islands[0].scheduler
    start_at = time.time() + startup
    end_at = start_at + seconds
    procs = [spawn(t, w, start_at, end_at, 256, 64) for t, w in WEIGHTS.items()]
    time.sleep(max(0.0, start_at - time.time()) + seconds * 0.2)
    before = ray.get(scheduler.stats.remote())["tenant_time_s"]
    time.sleep(seconds * 0.6)
    after = ray.get(scheduler.stats.remote())["tenant_time_s"]
    collect(procs)
    used = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in WEIGHTS}
    total, weight_sum = sum(used.values()), sum(WEIGHTS.values())
    rows = {t: {"weight": w, "island_s": used[t], "share": used[t] / total if total else 0.0,
                "target": w / weight_sum} for t, w in WEIGHTS.items()}
    for r in rows.values():
        r["error"] = r["share"] / r["target"] - 1.0
    return rows


def throughput(n: int, seconds: float, startup: float) -> float:
    start_at = time.time() + startup
    procs = [spawn(f"c{n}_{k}", 1.0, start_at, start_at + seconds, 64, 32) for k in range(n)]
    return sum(r["done"] for r in collect(procs)) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    parser.add_argument("--startup", type=float, default=25.0, help="seconds the clients get to start up")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="10 s phases, 1 and 2 clients")
    parser.add_argument("--out", default=str(default_out("tenancy")))
    parser.add_argument("--client", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        tenant, weight, start_at, end_at, size, depth = args.client
        client(tenant, float(weight), float(start_at), float(end_at), int(size), int(depth))
        return
    if args.quick:
        args.seconds, args.clients = 10.0, [1, 2]

    import pathways as pw

    session = pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    shares = fair_share(session, args.seconds, args.startup)
    table = Table(["tenant", "weight", "island s", "share", "target", "error"])
    for t, r in shares.items():
        table.add(t, f"{r['weight']:g}", f"{r['island_s']:.2f}", f"{100 * r['share']:.1f}%",
                  f"{100 * r['target']:.1f}%", f"{100 * r['error']:+.1f}%")
    worst = max(abs(r["error"]) for r in shares.values())
    print("Weighted fair share of island 0 (4 tenant processes, all backlogged)")
    print(table.render())
    print(f"worst relative error {100 * worst:.1f}% (target within ±10%): {'MET' if worst <= 0.10 else 'NOT MET'}\n")

    rates = {n: throughput(n, args.seconds, args.startup) for n in args.clients}
    table = Table(["clients", "computations/s", "vs one client"])
    for n, rate in rates.items():
        table.add(n, f"{rate:.0f}", f"{rate / rates[args.clients[0]]:.2f}x")
    print("Aggregate throughput of concurrent clients (small computations on island 0)")
    print(table.render())
    ok = all(rate >= rates[args.clients[0]] * 0.95 for rate in rates.values())
    print(f"aggregate >= one client's: {'MET' if ok else 'NOT MET'}")
    path = write_json(args.out, {"fair_share": shares, "worst_error": worst, "throughput": rates,
                                 "median_rate": median(list(rates.values()))})
    print(f"wrote {path}")
    pw.shutdown()


if __name__ == "__main__":
    main()
