"""Multi-tenancy on one island: weighted fair share of island time, and throughput of concurrent clients.

    python -m benchmarks.tenancy [--seconds 20] [--reps 3] [--quick]

The benchmark starts the runtime, so it holds the admin credential: it registers every tenant in the
runtime's registry with the weight the table shows, and hands each client process only that
tenant's credential (PATHWAYS_CREDENTIAL). No client says what its weight is.

1. Four tenants with weights 1:2:4:8, each a separate client process keeping
   small programs queued on island 0. The island's scheduler accounts the
   island time each tenant receives; the table compares the shares measured
   while all four are backlogged with the weights (target: within ±10%).
   Every client first starts up and runs one call; the window starts only
   once all are ready (or ``--startup`` seconds have passed). For each tenant
   the output says when its process started, when its first call completed,
   and how many calls it completed in the measured window, and a tenant with
   (near) 0% is named "never started" (its process failed or was not ready:
   with its stderr tail) or "starved" (running and backlogged, not served).
2. N concurrent clients (separate processes, one tenant each, equal weights)
   running small computations: aggregate computations/s next to one client
   alone (target: aggregate ≥ one client's). Pathways saw several clients push
   an island to ~100% utilization. The client processes start once; phases
   of 1, 2, ... of them running alternate ``--reps`` times, and the verdict
   compares medians, so a noisy moment on a shared machine decides nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections import deque

from benchmarks.common import Table, default_out, median, process_cpu_s, write_json

WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
NEAR_ZERO = 0.1  # a share below this fraction of its target counts as (near) 0%


# -- one tenant's process --------------------------------------------------------------------------

def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def client(tenant: str, size: int, depth: int) -> None:
    """One tenant's process: start, run one call, say so; then read its windows from stdin and, in each
    [start, end), keep ``depth`` to ``2 * depth`` programs outstanding on island 0. Reports, per window, the
    calls completed, those completed inside [measure_from, measure_to], and the longest wait for a batch."""
    emit(event="started", at=time.time())
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import pathways as pw

        session = pw.init(tenant=tenant)  # its credential comes in PATHWAYS_CREDENTIAL; its weight from the registry
        s = pw.slice((2,), ("x",), island=0)
        f = pw.jit(lambda m: jax.lax.fori_loop(0, 4, lambda i, a: jnp.tanh(a @ m), m), slice=s,
                   in_specs=(P("x"),), out_specs=P("x"))
        m = pw.put(np.eye(size, dtype=np.float32) * 0.5, s, P("x"))
        f(m).block_until_ready()
        emit(event="ready", at=time.time(), weight=session.weight)
        windows = json.loads(sys.stdin.readline())
        out = []
        for start_at, end_at, measure_from, measure_to in windows:
            time.sleep(max(0.0, start_at - time.time()))
            previous, done, measured, first, longest = None, 0, 0, None, 0.0
            while time.time() < end_at:  # keep between depth and 2*depth programs in flight, one wait per batch
                batch = [f(m) for _ in range(depth)]
                if previous is not None:
                    waited = time.time()
                    previous.block_until_ready()
                    now = time.time()
                    done += depth
                    first = first or now
                    if measure_from <= now <= measure_to:
                        measured += depth
                        longest = max(longest, now - max(waited, measure_from))
                previous = batch[-1]
            if previous is not None:
                previous.block_until_ready()  # drained before the next phase starts
            out.append({"done": done, "measured": measured, "first_done": first, "longest_wait_s": longest})
        emit(event="done", windows=out)
        pw.shutdown()
    except BaseException:
        emit(event="failed", error=traceback.format_exc()[-3000:])
        raise


class Tenant:
    """A tenant's client process, seen from the benchmark: when it started, became ready, finished, and its
    stderr's tail."""

    def __init__(self, name: str, weight: float, credential: str, size: int, depth: int) -> None:
        self.name, self.weight = name, weight
        from client.session import current

        env = dict(os.environ, PATHWAYS_ADDRESS=current().address, PATHWAYS_CREDENTIAL=credential)
        self.spawned = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.tenancy", "--client", name, str(size),
                                      str(depth)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.events: queue.Queue = queue.Queue()
        self.seen: dict[str, dict] = {}
        self.stderr: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                except ValueError:
                    pass
        self.events.put({"event": "exited"})

    def wait_for(self, event: str, deadline: float) -> dict | None:
        """The ``event`` this process reported, waiting until ``deadline`` (None if it did not, or died)."""
        while event not in self.seen:
            if "failed" in self.seen or "exited" in self.seen:
                return None
            try:
                msg = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                return None
            self.seen.setdefault(msg["event"], msg)
        return self.seen[event]

    def go(self, windows: list[list[float]]) -> None:
        try:
            self.proc.stdin.write(json.dumps(windows) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: finish() says so

    def finish(self, timeout: float) -> dict | None:
        """Its per-window results, or None if it failed; stops it if it hangs."""
        done = self.wait_for("done", time.time() + timeout)
        try:
            self.proc.wait(timeout=30 if done else 1)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return done

    @property
    def ready(self) -> bool:
        return "ready" in self.seen

    def timeline(self) -> dict:
        """Seconds from spawning it to its process starting and to its first call completing."""
        started, ready = self.seen.get("started"), self.seen.get("ready")
        return {"started_s": started["at"] - self.spawned if started else None,
                "first_call_s": ready["at"] - self.spawned if ready else None,
                "exit_code": self.proc.returncode,
                "stderr_tail": "".join(self.stderr)[-1500:] if not self.ready or self.proc.returncode else ""}


def register(admin, tenants: dict[str, float]) -> dict[str, str]:
    """Each tenant registered with its weight by the admin; their credentials."""
    known = {t["name"] for t in admin.tenants()}
    out = {}
    for name, weight in tenants.items():
        out[name] = (admin.set_tenant(name, weight=weight, new_credential=True) if name in known
                     else admin.add_tenant(name, weight=weight))
    return out


def start_all(tenants: list[Tenant], startup: float) -> float:
    """Wait until every client is ready or ``startup`` seconds pass; returns the seconds that took."""
    t0 = time.time()
    for t in tenants:
        t.wait_for("ready", t0 + startup)
    return time.time() - t0


# -- 1. weighted fair share ------------------------------------------------------------------------

def island_time(admin) -> dict[str, float]:
    (island0,) = [s for s in admin.schedules() if s["island"] == 0]
    return island0["tenant_time_s"]


def fair_share(admin, seconds: float, startup: float) -> tuple[dict, dict]:
    """Island time per tenant over the middle 60% of a run where all four tenants stay backlogged."""
    credentials = register(admin, WEIGHTS)
    tenants = [Tenant(t, w, credentials[t], 256, 64) for t, w in WEIGHTS.items()]
    took = start_all(tenants, startup)
    start_at = time.time() + 1.0
    measure_from, measure_to = start_at + seconds * 0.2, start_at + seconds * 0.8
    for t in tenants:
        t.go([[start_at, start_at + seconds, measure_from, measure_to]])
    time.sleep(max(0.0, measure_from - time.time()))
    before = island_time(admin)
    time.sleep(max(0.0, measure_to - time.time()))
    after = island_time(admin)
    weights_used = [s for s in admin.schedules() if s["island"] == 0][0].get("weights", {})
    results = {t.name: t.finish(seconds + 120) for t in tenants}
    used = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in WEIGHTS}
    total, weight_sum = sum(used.values()), sum(WEIGHTS.values())
    rows = {}
    for t in tenants:
        window = (results[t.name] or {}).get("windows", [{}])[0]
        share = used[t.name] / total if total else 0.0
        row = {"weight": t.weight, "scheduler_weight": weights_used.get(t.name), "island_s": used[t.name],
               "share": share, "target": t.weight / weight_sum, **t.timeline(),
               "calls_measured": window.get("measured", 0), "calls": window.get("done", 0),
               "longest_wait_s": window.get("longest_wait_s"), "failed": results[t.name] is None}
        row["error"] = row["share"] / row["target"] - 1.0
        row["verdict"] = verdict(row, t, measure_to - measure_from)
        rows[t.name] = row
    return rows, {"startup_s": took, "measured_s": measure_to - measure_from}


def verdict(row: dict, tenant: Tenant, window_s: float) -> str:
    """What happened to a tenant: "ok", or for a (near) 0% share, "never started" or "starved"."""
    if row["share"] >= NEAR_ZERO * row["target"]:
        return "ok"
    if not tenant.ready or row["failed"] and not row["calls"]:
        why = "its process failed" if tenant.proc.returncode else "it was not ready in time"
        return f"NEVER STARTED ({why})"
    wait = row["longest_wait_s"] or window_s
    return (f"STARVED (running and backlogged: {row['calls_measured']} calls completed in the window, "
            f"longest wait {wait:.1f}s)")


# -- 2. throughput of concurrent clients -----------------------------------------------------------

def throughput(admin, session, clients: list[int], reps: int, seconds: float, startup: float,
               gap: float = 2.0) -> tuple[dict[int, list], dict[int, list]]:
    """Computations/s of each phase: ``n`` of the client processes running, for each n in ``clients``,
    the phases alternating ``reps`` times (one start-up for all of them). Also, per phase, the CPU each
    message to the island cost its host and the clients (core-us, from /proc over the phase's middle)."""
    phases = [n for _ in range(reps) for n in clients]
    names = [f"c{k}" for k in range(max(clients))]
    credentials = register(admin, dict.fromkeys(names, 1.0))
    tenants = [Tenant(name, 1.0, credentials[name], 64, 32) for name in names]
    start_all(tenants, startup)
    not_ready = [t.name for t in tenants if not t.ready]
    if not_ready:
        raise RuntimeError(f"clients {not_ready} never started:\n" + "\n".join(
            f"--- {t.name}:\n{t.timeline()['stderr_tail']}" for t in tenants if not t.ready))
    start_at = time.time() + 1.0
    windows = [[start_at + k * (seconds + gap), start_at + k * (seconds + gap) + seconds] for k in range(len(phases))]
    for k, t in enumerate(tenants):
        t.go([[*w, *w] for w, n in zip(windows, phases) if k < n])
    host_pid = session.host_stats(0)["pid"]

    def reading() -> tuple:  # messages the island has taken, host CPU s, clients' CPU s
        return (session.host_stats(0)["schedule"]["messages"], process_cpu_s([host_pid]),
                process_cpu_s([t.proc.pid for t in tenants]))

    samples = []
    for begin, end in windows:
        time.sleep(max(0.0, begin + seconds * 0.1 - time.time()))
        first = reading()
        time.sleep(max(0.0, end - seconds * 0.1 - time.time()))
        last = reading()
        per = 1e6 / max(1, last[0] - first[0])
        samples.append(None if first[1] is None else
                       {"host_us": (last[1] - first[1]) * per, "clients_us": (last[2] - first[2]) * per})
    results = [t.finish(seconds + 120) for t in tenants]
    failed = [t.name for t, r in zip(tenants, results) if r is None]
    if failed:
        raise RuntimeError(f"clients {failed} failed:\n" + "\n".join(
            f"--- {t.name}:\n{t.timeline()['stderr_tail']}" for t in tenants if t.name in failed))
    done = [iter(w["done"] for w in r["windows"]) for r in results]
    rates: dict[int, list] = {n: [] for n in clients}
    costs: dict[int, list] = {n: [] for n in clients}
    for n, sample in zip(phases, samples):
        rates[n].append(sum(next(done[k]) for k in range(n)) / seconds)
        costs[n].append(sample)
    return rates, costs


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    parser.add_argument("--startup", type=float, default=180.0, help="seconds the clients get to start up")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3, help="times each throughput phase runs (medians compared)")
    parser.add_argument("--quick", action="store_true", help="10 s phases, 1 and 2 clients")
    parser.add_argument("--out", default=str(default_out("tenancy")))
    parser.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        tenant, size, depth = args.client
        client(tenant, int(size), int(depth))
        return
    if args.quick:
        args.seconds, args.clients = 10.0, [1, 2]

    import pathways as pw

    session = pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    admin = pw.admin()  # this process started the runtime: it is the cluster's admin
    shares, run = fair_share(admin, args.seconds, args.startup)
    table = Table(["tenant", "weight", "island s", "share", "target", "error", "started", "first call",
                   "calls in window", "verdict"])
    for t, r in shares.items():
        table.add(t, f"{r['weight']:g}", f"{r['island_s']:.2f}", f"{100 * r['share']:.1f}%",
                  f"{100 * r['target']:.1f}%", f"{100 * r['error']:+.1f}%", _s(r["started_s"]),
                  _s(r["first_call_s"]), r["calls_measured"], r["verdict"])
    worst = max(abs(r["error"]) for r in shares.values())
    print(f"Weighted fair share of island 0 (4 tenant processes, weights set by the admin, all backlogged; "
          f"all ready after {run['startup_s']:.1f}s, measured {run['measured_s']:.1f}s; 'started' and 'first "
          f"call' count from spawning each process)")
    print(table.render())
    for t, r in shares.items():
        if r["scheduler_weight"] is not None and r["scheduler_weight"] != r["weight"]:
            print(f"note: the scheduler weighs {t} {r['scheduler_weight']:g}, the registry {r['weight']:g}")
        if r["verdict"] != "ok" and r["stderr_tail"]:
            print(f"--- {t}'s stderr (tail):\n{r['stderr_tail']}")
    print(f"worst relative error {100 * worst:.1f}% (target within ±10%): {'MET' if worst <= 0.10 else 'NOT MET'}\n")

    rates, costs = throughput(admin, session, args.clients, args.reps, args.seconds, args.startup)
    medians = {n: median(r) for n, r in rates.items()}
    one = medians[args.clients[0]]
    table = Table(["clients", "computations/s (median)", "each phase", "vs one client",
                   "host core-us/msg", "clients core-us/msg"])
    for n, rs in rates.items():
        known = [c for c in costs[n] if c is not None]
        host_us = f"{median([c['host_us'] for c in known]):.0f}" if known else "-"
        clients_us = f"{median([c['clients_us'] for c in known]):.0f}" if known else "-"
        table.add(n, f"{medians[n]:.0f}", " ".join(f"{r:.0f}" for r in rs), f"{medians[n] / one:.2f}x",
                  host_us, clients_us)
    print(f"Aggregate throughput of concurrent clients (small computations on island 0; {args.reps} phases each, "
          "alternating)")
    print(table.render())
    ok = all(m >= one for m in medians.values())
    print(f"aggregate >= one client's (medians): {'MET' if ok else 'NOT MET'}")
    path = write_json(args.out, {"fair_share": shares, "fair_share_run": run, "worst_error": worst,
                                 "throughput": medians, "throughput_phases": rates, "cpu_per_message": costs,
                                 "vs_one_client": {n: m / one for n, m in medians.items()}})
    print(f"wrote {path}")
    pw.shutdown()


if __name__ == "__main__":
    main()
