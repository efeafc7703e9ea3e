"""A tenant that keeps an island busy with fresh long programs under its op_ms budget, against a tenant that calls
every 100 ms: how long the caller waits, and how much of the island the abuser gets.

    python -m benchmarks.op_budget [--seconds 60] [--op-ms 1000] [--program-s 2] [--busy N]

A running computation cannot be stopped, and refusing a program that ran too long stops nothing when each
program is new: the abuser (a process of its own, tenant "abuser", its op_ms set by the admin) keeps two
programs outstanding for ``--seconds``, each the same loop with another constant (a program the island never
saw), sized to run about ``--program-s`` seconds. The victim (this process, another tenant of the same weight)
runs a small program every 100 ms and times each call. Printed: the victim's calls, median and worst wait, the
abuser's programs and how long the hosts measured them run, the abuser's island time as a share of the wall
time, and, last:

    op budget: P programs of S s under op_ms M ms, victim worst wait W s, abuser share A% (its weight's H%)

Goal: W at most one of the abuser's programs (the longest the hosts measured, plus 0.5 s), and A at most H
plus 5 points: a throttled tenant gets its weight's share of the island whether or not the others use theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Table, default_out, median, write_json
from benchmarks.tenancy import busy_cores

PERIOD_S = 0.1
SIZE = 256


def abuser(seconds: float, program_s: float) -> None:
    """The abuser's process: size the loop to ``program_s`` on this machine, say it is ready, then on "go" keep two
    fresh programs outstanding for ``seconds``; print what ran, as the hosts measured it."""
    import jax
    import jax.numpy as jnp

    import pathways as pw

    m_local = jnp.eye(SIZE, dtype=jnp.float32)
    probe = jax.jit(lambda m: jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ m) * 0.5, m))
    probe(m_local).block_until_ready()
    start = time.perf_counter()
    probe(m_local).block_until_ready()
    iters = max(1, int(200 * program_s / (time.perf_counter() - start)))

    pw.init(timeouts=pw.Timeouts(fetch=120.0))
    s = pw.slice((1,), ("x",), island=0)
    m = pw.put(np.eye(SIZE, dtype=np.float32), s)

    def fresh(c: float):
        return pw.jit(lambda a: jax.lax.fori_loop(0, iters, lambda i, b: jnp.tanh(b @ a) * c, a), slice=s)

    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    ran, refused, outstanding, k = 0, 0, [], 0
    with pw.trace(trace):  # its own spans: how long each computation ran on the island
        end = time.monotonic() + seconds
        while time.monotonic() < end or outstanding:
            if time.monotonic() < end and len(outstanding) < 2:
                outstanding.append(fresh(0.5 + k * 1e-4)(m))
                k += 1
                continue
            try:
                outstanding.pop(0).block_until_ready(timeout=seconds + 120)
                ran += 1
            except pw.ResourceError:
                refused += 1
    runs = [e["dur"] / 1e6 for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "exec"]
    print(json.dumps({"programs": ran, "refused": refused, "iters": iters, "runs_s": runs}), flush=True)
    pw.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="how long the abuser keeps sending")
    p.add_argument("--op-ms", type=int, default=1000, help="the abuser's op_ms budget")
    p.add_argument("--program-s", type=float, default=2.0, help="how long each of its programs runs")
    p.add_argument("--busy", type=int, default=0, metavar="N", help="keep N cores busy meanwhile")
    p.add_argument("--out", default=str(default_out("op_budget")))
    p.add_argument("--abuser", nargs=2, type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.abuser:
        abuser(*args.abuser)
        return
    with busy_cores(args.busy):
        run(args)


def run(args: argparse.Namespace) -> None:
    import pathways as pw

    session = pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2),
                      timeouts=pw.Timeouts(fetch=120.0))
    admin = pw.admin()
    credential = admin.add_tenant("abuser", weight=1.0, budgets={"op_ms": args.op_ms})
    weights = {session.tenant: session.weight, "abuser": 1.0}
    env = {**os.environ, "PATHWAYS_ADDRESS": session.address, "PATHWAYS_TENANT": "abuser",
           "PATHWAYS_CREDENTIAL": credential}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.op_budget", "--abuser", str(args.seconds),
                             str(args.program_s)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = proc.stdout.readline()
    if not ready.startswith("{"):
        raise SystemExit(f"the abuser's process did not start: {ready!r}")

    s = pw.slice((1,), ("x",), island=0)
    step = pw.jit(lambda v: v * 2.0 - v + 1.0, slice=s, name="victim")
    x = pw.put(np.zeros(4, np.float32), s)
    x = step(x)
    x.fetch(timeout=60)
    waits: list[float] = []
    stop = threading.Event()

    def victim() -> None:
        nonlocal x
        while not stop.wait(PERIOD_S):
            start = time.monotonic()
            x = step(x)
            x.fetch(timeout=120)
            waits.append(time.monotonic() - start)

    def island_time() -> float:
        return next(s for s in admin.schedules() if s["island"] == 0)["tenant_time_s"].get("abuser", 0.0)

    before, started = island_time(), time.monotonic()
    thread = threading.Thread(target=victim, daemon=True)
    thread.start()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, _ = proc.communicate(timeout=args.seconds + 600)
    wall = time.monotonic() - started
    used = island_time() - before
    stop.set()
    thread.join(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    pw.shutdown()

    runs = result["runs_s"]
    share, target = used / wall, weights["abuser"] / sum(weights.values())
    worst, longest = max(waits), max(runs, default=0.0)
    table = Table(["", "value"])
    table.add("victim calls", len(waits))
    table.add("victim wait, median / worst", f"{median(waits) * 1e3:.0f} ms / {worst * 1e3:.0f} ms")
    table.add("abuser programs run / refused", f"{result['programs']} / {result['refused']}")
    table.add("one program on the island, median / longest", f"{median(runs):.2f} s / {longest:.2f} s")
    table.add("abuser island time / wall time", f"{used:.1f} s / {wall:.1f} s = {100 * share:.1f}%")
    print(table.render())
    write_json(Path(args.out), {"seconds": args.seconds, "op_ms": args.op_ms, "program_s": args.program_s,
                                "busy": args.busy, "waits_s": waits, "runs_s": runs, "abuser_island_s": used,
                                "wall_s": wall, "share": share, "target": target, **result})
    met = worst <= longest + 0.5 and share <= target + 0.05
    print(f"goal: victim waits at most one program ({longest:.2f} s + 0.5 s) and the abuser gets at most its "
          f"weight's share + 5 points ({100 * target:.0f}% + 5): {'met' if met else 'NOT met'}")
    print(f"op budget: {result['programs']} programs of {median(runs):.1f} s under op_ms {args.op_ms} ms, victim "
          f"worst wait {worst:.2f} s, abuser share {100 * share:.1f}% (its weight's {100 * target:.0f}%)")


if __name__ == "__main__":
    main()
