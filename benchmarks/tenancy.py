"""Multi-tenancy on one island: weighted fair share of island time, and throughput of concurrent clients.

    python -m benchmarks.tenancy [--seconds 20] [--runs 1] [--reps 3] [--quick] [--busy N] [--fair-share-only]

``--busy N`` keeps N cores busy for the whole benchmark with N processes of ``python -c "while 1: pass"`` at the
hosts' niceness (started before the runtime, stopped at the end): the shares must hold on a machine that other
work keeps busy, where a computation may be preempted by another process in the middle.

The benchmark starts the runtime, so it holds the admin credential: it registers every tenant in the
runtime's registry with the weight the table shows, and hands each client process only that
tenant's credential (PATHWAYS_CREDENTIAL). No client says what its weight is.

1. Fair share, ``--runs`` times, each run with four fresh tenant processes keeping small programs queued on
   island 0 (at niceness ``--client-niceness``, 10: below the hosts, as clients on machines of their own would
   be, so that they do not slow the island they measure): first at weights 1:2:4:8, then (the admin changes
   them) all at weight 1. Every client first starts up and runs one call; the phases start only once all are
   ready (or ``--startup`` seconds have passed). The island's scheduler accounts the island time each tenant
   receives; each phase is measured over its middle 60%, where all four stay backlogged, as a whole and in
   every 5 s stretch of it (sliding, read every 0.5 s), with the seconds each tenant had nothing queued or in
   flight there ("not backlogged": its client did not keep up). Printed: one line per run, a table of the
   runs, the run with the worst 5 s stretch tenant by tenant (when its process started, when its first call
   completed, its calls in the window, and whether a (near) 0% share means it never started (with its stderr)
   or was starved), and, as the last line of the output,

       fair share: R runs, S starved, worst error E% (whole), W% (5 s windows), Jain J

   S: runs in which a tenant was starved (under 10% of its share over a phase or a 5 s stretch while its
   client kept it backlogged); E and W: the worst |share / target - 1| over all runs and tenants, of the
   phases and 5 s stretches in which every client kept work queued (fair share promises shares to
   backlogged tenants; how many stretches were left out, and the errors counting them, are printed just
   before); J: the lowest Jain's index (sum x)^2 / (n sum x^2) of the equal-weight phase. Goal: S = 0,
   E <= 2%, W <= 5%, J >= 0.99. The JSON keeps each run's readings (island time per tenant) and where each tenant
   stood at every reading (``lag_s``: island seconds ahead of its share; queued; in flight), to see where a run
   missed.
2. N concurrent clients (separate processes, one tenant each, equal weights)
   running small computations: aggregate computations/s next to one client
   alone (target: aggregate >= one client's). Pathways saw several clients push
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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from benchmarks.common import Table, default_out, median, process_cpu_s, write_json

WEIGHTS = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
NEAR_ZERO = 0.1  # a share below this fraction of its target counts as (near) 0%
SUB_WINDOW_S = 5.0  # the stretches of time in which every tenant must get its share too
IDLE_OK = 0.01  # a stretch counts as backlogged while no tenant had nothing queued for more than this fraction of it
# The fair-share clients run below the hosts' priority, as tenants' clients on their own machines would: on 2 shared
# cores they would otherwise slow the island they measure (what they take from a computation is not charged to it).
CLIENT_NICENESS = 10


# -- one tenant's process --------------------------------------------------------------------------

def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def client(tenant: str, size: int, depth: int, niceness: int) -> None:
    """One tenant's process (at ``niceness``): start, run one call, say so; then read its windows from stdin and,
    in each [start, end), keep ``depth`` to ``2 * depth`` programs outstanding on island 0. Reports, per window,
    the calls completed, those completed inside [measure_from, measure_to], and the longest wait for a batch."""
    os.nice(niceness)
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

    def __init__(self, name: str, weight: float, credential: str, size: int, depth: int, niceness: int = 0) -> None:
        self.name, self.weight = name, weight
        from client.session import current

        env = dict(os.environ, PATHWAYS_ADDRESS=current().address, PATHWAYS_CREDENTIAL=credential)
        self.spawned = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.tenancy", "--client", name, str(size),
                                      str(depth), str(niceness)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


@contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
    """``n`` processes that each keep a core busy (``while 1: pass``) until the block ends; their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


# -- 1. weighted fair share ------------------------------------------------------------------------

class Sampler:
    """Each tenant's island time on island 0 (and the seconds it had nothing queued or in flight there), read
    every ``every`` seconds in the background: the shares of any stretch of time come from two readings."""

    def __init__(self, admin, every: float = 0.5) -> None:
        self.admin, self.every = admin, every
        self.readings: list[tuple[float, dict[str, float]]] = []
        self.tenants: list[tuple[float, dict[str, dict]]] = []  # where each tenant stands, as the scheduler says
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                (island0,) = [s for s in self.admin.schedules() if s["island"] == 0]
                now = time.time()
                self.readings.append((now, island0["tenant_time_s"]))
                self.tenants.append((now, island0.get("tenants", {})))
            except Exception:  # a slow moment of the resource manager: the next reading will do
                pass
            self._stop.wait(self.every)

    @property
    def idle(self) -> list[tuple[float, dict[str, float]]]:
        """Per reading, the seconds each tenant had nothing queued or in flight so far."""
        return [(t, {name: v["idle_s"] for name, v in tenants.items()}) for t, tenants in self.tenants]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def used(self, start: float, end: float, readings: list | None = None) -> dict[str, float] | None:
        """Island seconds per tenant between the readings nearest ``start`` and ``end`` (None without two); of the
        idle seconds with ``readings=self.idle``."""
        readings = self.readings if readings is None else readings
        inside = [(t, r) for t, r in readings if start - self.every / 2 <= t <= end + self.every / 2]
        if len(inside) < 2:
            return None
        first = min(inside, key=lambda x: abs(x[0] - start))[1]
        last = min(inside, key=lambda x: abs(x[0] - end))[1]
        return {t: last.get(t, 0.0) - first.get(t, 0.0) for t in last}

    def windows(self, start: float, end: float, length: float) -> list[tuple[dict[str, float], dict[str, float]]]:
        """Island seconds and idle seconds per tenant in every ``length``-second stretch of [start, end], one per
        reading."""
        out, idle_readings = [], self.idle
        for t, _ in self.readings:
            if start - self.every / 2 <= t and t + length <= end + self.every / 2:
                used, idle = self.used(t, t + length), self.used(t, t + length, idle_readings)
                if used is not None:
                    out.append((used, idle or {}))
        return out


def backlogged(idle: dict[str, float], tenants: Iterable[str], seconds: float) -> bool:
    """Whether every tenant kept work queued or in flight for all but ``IDLE_OK`` of ``seconds``: fair share
    promises shares to backlogged tenants only, so a stretch where a client fell behind says nothing of it."""
    return all(idle.get(t, 0.0) <= IDLE_OK * seconds for t in tenants)


def errors(used: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Each tenant's share of ``used`` relative to its weight's share, minus 1 (0 is exact)."""
    total, weight_sum = sum(used.get(t, 0.0) for t in weights), sum(weights.values())
    return {t: (used.get(t, 0.0) / total if total else 0.0) / (w / weight_sum) - 1.0 for t, w in weights.items()}


def jain(values: list[float]) -> float:
    """Jain's fairness index of equal-weight allocations: 1 when all are equal, 1/n when one gets everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 0.0


def fair_share(admin, seconds: float, startup: float, niceness: int, sub_window: float = SUB_WINDOW_S) -> dict:
    """One run: four fresh client processes (at ``niceness``), a phase at weights 1:2:4:8, then one at equal
    weights, each measured over its middle 60% (where all four stay backlogged): island time per tenant, over the
    whole stretch and over every ``sub_window`` seconds in it."""
    credentials = register(admin, WEIGHTS)
    tenants = [Tenant(t, w, credentials[t], 256, 64, niceness) for t, w in WEIGHTS.items()]
    took = start_all(tenants, startup)
    start_at = time.time() + 1.0
    gap = 2.0
    phases = []
    for k, weights in enumerate((WEIGHTS, dict.fromkeys(WEIGHTS, 1.0))):
        begin = start_at + k * (seconds + gap)
        phases.append({"weights": weights, "window": [begin, begin + seconds, begin + seconds * 0.2,
                                                      begin + seconds * 0.8]})
    for t in tenants:
        t.go([p["window"] for p in phases])
    sampler = Sampler(admin)
    weights_used = {}
    for k, phase in enumerate(phases):
        if k:  # between the phases: the admin makes every weight equal
            time.sleep(max(0.0, phase["window"][0] - gap / 2 - time.time()))
            for t in WEIGHTS:
                admin.set_tenant(t, weight=phase["weights"][t])
        time.sleep(max(0.0, phase["window"][3] - time.time()))
        weights_used[k] = [s for s in admin.schedules() if s["island"] == 0][0].get("weights", {})
    time.sleep(max(0.0, phases[-1]["window"][1] - time.time()))
    sampler.stop()
    results = {t.name: t.finish(seconds + 120) for t in tenants}
    run = {"startup_s": took, "measured_s": seconds * 0.6, "phases": [], "readings": sampler.readings,
           "tenants": sampler.tenants, "windows_at": [p["window"] for p in phases]}
    for k, phase in enumerate(phases):
        _, _, measure_from, measure_to = phase["window"]
        weights = phase["weights"]
        used = sampler.used(measure_from, measure_to) or {}
        idle = sampler.used(measure_from, measure_to, sampler.idle) or {}
        whole = errors(used, weights)
        stretches = sampler.windows(measure_from, measure_to, sub_window)
        windows = [errors(u, weights) for u, _ in stretches]
        kept = [errors(u, weights) for u, i in stretches if backlogged(i, weights, sub_window)]
        rows = {}
        for t in tenants:
            window = (results[t.name] or {}).get("windows", [{}] * len(phases))[k]
            share = used.get(t.name, 0.0) / sum(used.values()) if used else 0.0
            row = {"weight": weights[t.name], "scheduler_weight": weights_used[k].get(t.name),
                   "island_s": used.get(t.name, 0.0), "share": share, "target": weights[t.name] / sum(weights.values()),
                   **t.timeline(), "calls_measured": window.get("measured", 0), "calls": window.get("done", 0),
                   "longest_wait_s": window.get("longest_wait_s"), "failed": results[t.name] is None,
                   "idle_s": idle.get(t.name),
                   "error": whole[t.name],
                   "worst_window_error": max((abs(w[t.name]) for w in kept), default=None),
                   "worst_window_error_any": max((abs(w[t.name]) for w in windows), default=None),
                   "lowest_window_share": min((1.0 + w[t.name] for w in windows), default=None)}
            row["verdict"] = verdict(row, t, measure_to - measure_from)
            rows[t.name] = row
        run["phases"].append({"weights": weights, "tenants": rows, "windows": len(windows),
                              "windows_backlogged": len(kept), "jain": jain([used.get(t, 0.0) for t in weights]),
                              "backlogged": backlogged(idle, weights, measure_to - measure_from)})
    return run


def verdict(row: dict, tenant: Tenant, window_s: float) -> str:
    """What happened to a tenant: "ok", or, when it got (near) 0% of its share over the whole window or any
    sub-window, "never started", "not backlogged" (its client kept nothing queued for half the window) or
    "starved"."""
    lowest = min(row["share"] / row["target"] if row["target"] else 1.0, row["lowest_window_share"] or 1.0)
    if lowest >= NEAR_ZERO:
        return "ok"
    if not tenant.ready or row["failed"] and not row["calls"]:
        why = "its process failed" if tenant.proc.returncode else "it was not ready in time"
        return f"NEVER STARTED ({why})"
    if (row["idle_s"] or 0.0) > window_s / 2:
        return f"NOT BACKLOGGED (its client kept nothing queued for {row['idle_s']:.1f}s of {window_s:.0f}s)"
    wait = row["longest_wait_s"] or window_s
    return (f"STARVED (running and backlogged: {row['calls_measured']} calls completed in the window, "
            f"longest wait {wait:.1f}s, {100 * lowest:.0f}% of its share in its worst {SUB_WINDOW_S:g} s)")


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


def fair_share_runs(admin, runs: int, seconds: float, startup: float, niceness: int) -> tuple[list[dict], dict]:
    """``runs`` runs of ``fair_share``, each printed as one line as it ends; the summary over all of them: the
    worst errors and Jain's index over the backlogged phases and 5 s windows, and (``*_any``) over all of them."""
    table = Table(["run", *[f"{t} share" for t in WEIGHTS], "worst error", f"worst {SUB_WINDOW_S:g} s", "starved",
                   "Jain (equal)", "least backlogged"])
    out = []
    for k in range(runs):
        run = fair_share(admin, seconds, startup, niceness)
        weighted, equal = run["phases"]
        kept = [r for p in run["phases"] if p["backlogged"] for r in p["tenants"].values()]
        rows = [r for p in run["phases"] for r in p["tenants"].values()]
        run["starved"] = sorted(f"{r['weight']:g}:{name}" for p in run["phases"] for name, r in p["tenants"].items()
                                if r["verdict"].startswith("STARVED"))
        run["not_ok"] = sorted(f"{r['weight']:g}:{name} {r['verdict']}" for p in run["phases"]
                               for name, r in p["tenants"].items() if r["verdict"] != "ok")
        run["worst_error"] = max((abs(r["error"]) for r in kept), default=None)
        run["worst_error_any"] = max(abs(r["error"]) for r in rows)
        run["worst_window_error"] = max((r["worst_window_error"] or 0.0) for r in rows)
        run["worst_window_error_any"] = max((r["worst_window_error_any"] or 0.0) for r in rows)
        idle = max(((r["idle_s"] or 0.0, f"{r['weight']:g}:{name}") for p in run["phases"]
                    for name, r in p["tenants"].items()), default=(0.0, "-"))
        out.append(run)
        table.add(k + 1, *[f"{100 * r['share']:.1f}%" for r in weighted["tenants"].values()],
                  _pct(run["worst_error"]) + ("" if run["worst_error"] == run["worst_error_any"]
                                               else f" ({_pct(run['worst_error_any'])})"),
                  _pct(run["worst_window_error"]) + ("" if run["worst_window_error"] == run["worst_window_error_any"]
                                                      else f" ({_pct(run['worst_window_error_any'])})"),
                  ", ".join(run["starved"]) or "-", f"{equal['jain']:.4f}",
                  f"{idle[1]} idle {idle[0]:.2f}s" if idle[0] > 0 else "all, all the time")
        print(f"run {k + 1}/{runs}: worst error {_pct(run['worst_error'])} (whole), "
              f"{_pct(run['worst_window_error'])} ({SUB_WINDOW_S:g} s windows), Jain {equal['jain']:.4f}"
              + (f"; most idle {idle[1]} {idle[0]:.2f}s" if idle[0] > 0 else "")
              + (f"; {'; '.join(run['not_ok'])}" if run["not_ok"] else ""), flush=True)
    phases = [p for r in out for p in r["phases"]]
    equal_phases = [r["phases"][1] for r in out]
    summary = {"runs": runs, "starved": sum(1 for r in out if r["starved"]),
               "worst_error": max((r["worst_error"] for r in out if r["worst_error"] is not None), default=None),
               "worst_window_error": max(r["worst_window_error"] for r in out),
               "jain": min((p["jain"] for p in equal_phases if p["backlogged"]), default=None),
               "worst_error_any": max(r["worst_error_any"] for r in out),
               "worst_window_error_any": max(r["worst_window_error_any"] for r in out),
               "jain_any": min(p["jain"] for p in equal_phases),
               "phases": len(phases), "phases_backlogged": sum(p["backlogged"] for p in phases),
               "windows": sum(p["windows"] for p in phases),
               "windows_backlogged": sum(p["windows_backlogged"] for p in phases)}
    targets = ", ".join(f"{100 * w / sum(WEIGHTS.values()):.1f}%" for w in WEIGHTS.values())
    print(f"\nWeighted fair share of island 0, {runs} run(s): four tenant processes at niceness {niceness}, weights "
          f"1:2:4:8 set by the admin (targets {targets}), all backlogged, then all at weight 1; each phase measured "
          f"over its middle {0.6 * seconds:.0f} s (errors in brackets: counting stretches where a client fell "
          "behind)")
    print(table.render())
    worst = max(out, key=lambda r: (len(r["starved"]), r["worst_window_error"]))
    print(f"\nthe run with the worst {SUB_WINDOW_S:g} s window, tenant by tenant (all ready after "
          f"{worst['startup_s']:.1f}s; 'started' and 'first call' count from spawning each process):")
    detail = Table(["phase", "tenant", "weight", "island s", "share", "target", "error",
                    f"worst {SUB_WINDOW_S:g} s", "not backlogged", "started", "first call", "calls in window",
                    "verdict"])
    for phase in worst["phases"]:
        for t, r in phase["tenants"].items():
            detail.add("1:2:4:8" if phase["weights"] == WEIGHTS else "equal", t, f"{r['weight']:g}",
                       f"{r['island_s']:.2f}", f"{100 * r['share']:.1f}%", f"{100 * r['target']:.1f}%",
                       f"{100 * r['error']:+.1f}%", _pct(r["worst_window_error"]),
                       "-" if r["idle_s"] is None else f"{r['idle_s']:.2f}s", _s(r["started_s"]),
                       _s(r["first_call_s"]), r["calls_measured"], r["verdict"])
            if r["scheduler_weight"] is not None and r["scheduler_weight"] != r["weight"]:
                print(f"note: the scheduler weighs {t} {r['scheduler_weight']:g}, the registry {r['weight']:g}")
            if r["verdict"] != "ok" and r["stderr_tail"]:
                print(f"--- {t}'s stderr (tail):\n{r['stderr_tail']}")
    print(detail.render())
    left = (summary["phases"] - summary["phases_backlogged"], summary["windows"] - summary["windows_backlogged"])
    print(f"\nleft out of the errors below as not backlogged (a client kept nothing queued or in flight for over "
          f"{100 * IDLE_OK:g}% of the stretch; its share then says nothing of the scheduler): {left[0]} of "
          f"{summary['phases']} phases, {left[1]} of {summary['windows']} {SUB_WINDOW_S:g} s windows; counting them: "
          f"worst error {_pct(summary['worst_error_any'])} (whole), {_pct(summary['worst_window_error_any'])} "
          f"({SUB_WINDOW_S:g} s windows), Jain {summary['jain_any']:.4f}")
    return out, summary


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    parser.add_argument("--runs", type=int, default=1, help="fair-share runs, each with fresh client processes")
    parser.add_argument("--startup", type=float, default=180.0, help="seconds the clients get to start up")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3, help="times each throughput phase runs (medians compared)")
    parser.add_argument("--quick", action="store_true", help="10 s phases, 1 and 2 clients")
    parser.add_argument("--out", default=str(default_out("tenancy")))
    parser.add_argument("--client-niceness", type=int, default=CLIENT_NICENESS,
                        help="niceness of the fair-share phases' client processes (0: the hosts' own)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="keep N cores busy with `python -c 'while 1: pass'` processes for the whole benchmark")
    parser.add_argument("--fair-share-only", action="store_true", help="skip the throughput phases")
    parser.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        tenant, size, depth, niceness = args.client
        client(tenant, int(size), int(depth), int(niceness))
        return
    if args.quick:
        args.seconds, args.clients = 10.0, [1, 2]
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.busy < 0:
        parser.error("--busy must be 0 or more")
    with busy_cores(args.busy) as busy:
        if busy:
            print(f"keeping {len(busy)} core(s) busy: processes {busy} run `while 1: pass` until the end", flush=True)
        benchmark(args)


def throughput_report(admin, session, args: argparse.Namespace) -> dict:
    """The throughput phases, printed as a table with their verdict; what the JSON record keeps of them."""
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
    print(f"\nAggregate throughput of concurrent clients (small computations on island 0; {args.reps} phases each, "
          "alternating)")
    print(table.render())
    ok = all(m >= one for m in medians.values())
    print(f"aggregate >= one client's (medians): {'MET' if ok else 'NOT MET'}")
    return {"throughput": medians, "throughput_phases": rates, "cpu_per_message": costs,
            "vs_one_client": {n: m / one for n, m in medians.items()}}


def benchmark(args: argparse.Namespace) -> None:
    """The fair-share runs, then (unless ``--fair-share-only``) the throughput phases, with their verdicts."""
    import pathways as pw

    session = pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    admin = pw.admin()  # this process started the runtime: it is the cluster's admin
    runs, summary = fair_share_runs(admin, args.runs, args.seconds, args.startup, args.client_niceness)

    record = {"fair_share_runs": runs, "fair_share": summary, "busy_cores": args.busy}
    if not args.fair_share_only:
        record.update(throughput_report(admin, session, args))
    path = write_json(args.out, record)
    print(f"wrote {path}")
    met = (summary["starved"] == 0 and (summary["worst_error"] or 0.0) <= 0.02
           and summary["worst_window_error"] <= 0.05 and (summary["jain"] or 0.0) >= 0.99)
    print(f"goal (0 starved, <= 2% whole, <= 5% in {SUB_WINDOW_S:g} s windows, Jain >= 0.99): "
          f"{'MET' if met else 'NOT MET'}")
    jain_text = "-" if summary["jain"] is None else f"{summary['jain']:.4f}"
    print(f"fair share: {summary['runs']} runs, {summary['starved']} starved, worst error "
          f"{_pct(summary['worst_error'])} (whole), {_pct(summary['worst_window_error'])} "
          f"({SUB_WINDOW_S:g} s windows), Jain {jain_text}")
    pw.shutdown()


if __name__ == "__main__":
    main()
