"""Pipeline parallelism across islands against SPMD data parallelism on the same number of devices.

Model: a token-wise MLP of DEPTH residual tanh layers of width WIDTH, trained with Adam on a batch of
BATCH tokens (rows). Each step is forward, backward and the optimizer.

  pipeline  S stages of DEPTH/S layers, stage k on a 1-device slice of island k (the stages' params live
            there); the batch is split into M micro-batches; one @pw.program per step (pw.pipeline), so
            2 (S-1) M activation and gradient transfers between islands per step.
  SPMD DP   the whole model replicated on an S-device slice of one island, the batch split over the
            devices, gradients all-reduced by XLA; one pw.jit per step.
  1 device  the whole model on one device (T1).

Every setup is warmed up, then timed in interleaved rounds of back-to-back steps (each step feeds the
next; a round ends when every island has finished its last step, not only the one holding the loss);
a row's step time is the median over rounds.

Reported per row: tokens/s; the ratio to SPMD DP on the same S devices (target >= 0.9); the bubble
predicted for a synchronous pipeline, (S-1)/(M+S-1), and measured from the hosts' busy time (1 -
busy/wall averaged over the stages); transfers per step; the CPU time per step of every process of
the cluster (core-ms, from /proc) and how many cores that keeps busy; T1/T; and the peak activation
bytes of stage 0 from the lowered program (1F1B stays at S micro-batches, GPipe holds all M).

A probe first measures one activation-sized hop between two islands (a ping-pong program, less the
same program without the hops): its latency and CPU cost. Where one CPU device already uses every core
(XLA runs each computation on all of them), every setup is bound by the cores, not by the devices: a
bubble costs little, but every core-ms a transfer spends is taken from the computation. The verdict
lines split each S's best ratio into those two factors.

    python -m benchmarks.pipeline [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, median, proc_stat, process_cpu_s, rate_text, write_json  # noqa: E402

WIDTH, DEPTH, BATCH = 512, 8, 4096
TARGET = 0.9
TIMEOUT_S = 300.0
WARMUP = 2  # steps after the compiling one, before timing
HOPS = 32  # transfers in the hop probe


def layers(params: list[dict], x: jax.Array) -> jax.Array:
    for p in params:
        x = x + jnp.tanh(x @ p["w"] + p["b"])
    return x


def loss_fn(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def init_params(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(WIDTH, WIDTH)) * 0.5 / np.sqrt(WIDTH)).astype(np.float32),
             "b": np.zeros(WIDTH, np.float32)} for _ in range(DEPTH)]


def whole_step(optimizer: optax.GradientTransformation):
    def step(params, opt_state, x, t):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(layers(p, x), t))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@dataclass
class Row:
    setup: str
    stages: int
    micro: int
    schedule: str | None = None
    step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    ratio_to_dp: float | None = None
    bubble_predicted: float | None = None
    bubble_measured: float | None = None
    transfers: int = 0
    cpu_ms: float | None = None  # core-ms of CPU per step, all of the cluster's processes
    cores_busy: float | None = None
    speedup_vs_1: float | None = None
    stage0_activation_bytes: int | None = None
    round_ms: list[float] | None = None  # ms per step in each timed round, in the order the rounds ran


def cluster_cpu_s() -> float | None:
    """CPU seconds used so far by this process and every process it started (the embedded Ray cluster:
    raylet, hosts, schedulers); None where there is no /proc."""
    stats = {int(p.name): proc_stat(int(p.name)) for p in Path("/proc").glob("[0-9]*")}
    stats = {pid: fields for pid, fields in stats.items() if fields is not None}  # exited meanwhile
    mine, frontier = set(), [os.getpid()]
    while frontier:
        pid = frontier.pop()
        mine.add(pid)
        frontier += [p for p, f in stats.items() if int(f[1]) == pid and p not in mine]
    return process_cpu_s(mine, stats)


def busy(session: Any, islands: list[int]) -> list[float]:
    return [session.host_stats(i)["busy_s"] for i in islands]


def done(state: Any) -> None:
    """Wait until every island holding part of ``state`` has finished the step that made it.

    Each island's outputs come from its last op of the step (DP: the one step; a pipeline stage: its
    optimizer update), so one output per island is enough. Waiting for the loss alone would stop the
    clock while the first stages still run their last backward and update (the pipeline's drain), and
    charge that to whatever runs next. Island 0 first: a pipeline's first stage finishes last.
    """
    first: dict[int, Any] = {}
    for leaf in jax.tree_util.tree_leaves(state):
        first.setdefault(leaf.slice.island, leaf)
    for island in sorted(first):
        first[island].block_until_ready(TIMEOUT_S)


class Setup:
    """One way to run the training step, warmed up, timed in rounds interleaved with the others."""

    def __init__(self, row: Row, step, state: tuple, islands: list[int]) -> None:
        self.row, self._step, self._state, self.islands = row, step, state, islands
        self.times: list[float] = []
        self.wall = 0.0
        self.cpu: float | None = 0.0 if cluster_cpu_s() is not None else None
        self.steps = 0
        self.busy = [0.0] * len(islands)
        self.run(1)  # compile
        self.run(WARMUP)  # first transfers, allocator and caches warm

    def run(self, steps: int) -> None:
        """``steps`` back-to-back steps (each feeds the next), then wait until every island has finished."""
        for _ in range(steps):
            self._state = self._step(*self._state[:2])
        done(self._state)

    def time(self, session: Any, steps: int) -> None:
        """Time ``steps`` steps; adds the hosts' busy time and the cluster's CPU time."""
        before, cpu = busy(session, self.islands), cluster_cpu_s()
        start = time.perf_counter()
        self.run(steps)
        elapsed = time.perf_counter() - start
        if self.cpu is not None:
            self.cpu += cluster_cpu_s() - cpu
        self.times.append(elapsed / steps)
        self.wall += elapsed
        self.steps += steps
        self.busy = [t + b - a for t, a, b in zip(self.busy, before, busy(session, self.islands))]


def spmd(devices: int, optimizer, data) -> tuple[Setup, Any]:
    """The whole model on a ``devices``-device slice of island 0, the batch split over the devices."""
    x, t = data
    s = pw.slice((devices,), ("data",), island=0)
    fn = pw.jit(whole_step(optimizer), slice=s, in_specs=(None, None, P("data"), P("data")),
                out_specs=(None, None, None), name=f"dp{devices}")
    params = [{k: pw.put(v, s) for k, v in p.items()} for p in init_params()]
    xa, ta = pw.put(x, s, P("data")), pw.put(t, s, P("data"))
    name = "1 device" if devices == 1 else f"SPMD DP x{devices}"
    setup = Setup(Row(name, devices, 1), lambda p, o: fn(p, o, xa, ta),
                  (params, pw.jit(optimizer.init, slice=s)(params)), [0])
    return setup, [s]


def pipelined(n_stages: int, n_micro: int, schedule: str, optimizer, data) -> tuple[Setup, list]:
    """S one-device stages on islands 0..S-1; stage 0's static peak activation bytes go in the row."""
    x, t = data
    slices = [pw.slice((1,), ("x",), island=k) for k in range(n_stages)]
    per = DEPTH // n_stages
    stages = [pw.pipeline.Stage(layers, s) for s in slices]
    pipe = pw.pipeline.build(stages, loss_fn, optimizer, n_micro=n_micro, schedule=schedule)
    all_params = init_params()
    params, states = pipe.init([all_params[k * per:(k + 1) * per] for k in range(n_stages)])
    xa, ta = pw.put(x, slices[0]), pw.put(t, slices[-1])
    row = Row(f"pipeline {schedule}", n_stages, n_micro, schedule,
              bubble_predicted=pw.pipeline.predicted_bubble(n_stages, n_micro),
              transfers=2 * (n_stages - 1) * n_micro,
              stage0_activation_bytes=pipe.memory(params, states, xa, ta)[0].peak_bytes)
    setup = Setup(row, lambda p, o: pipe.step(p, o, xa, ta), (params, states), list(range(n_stages)))
    return setup, slices


@dataclass
class Hop:
    """One activation-sized transfer between islands 0 and 1, measured on its own."""

    mib: float
    latency_ms: float
    cpu_ms: float | None  # core-ms, all of the cluster's processes


def hop_probe(rows: int, rounds: int) -> Hop:
    """Ping-pong a (rows, WIDTH) float32 array between islands 0 and 1 (a trivial op on each side between
    hops), less the same chain of ops on one island: the latency and CPU of one hop."""
    s0, s1 = pw.slice((1,), ("x",), island=0), pw.slice((1,), ("x",), island=1)
    inc0, inc1 = (pw.jit(lambda v: v + 1, slice=s, name=f"inc{k}") for k, s in enumerate((s0, s1)))

    @pw.program
    def ping(v):
        for _ in range(HOPS // 2):
            v = pw.transfer(inc1(pw.transfer(inc0(v), s1)), s0)
        return v

    @pw.program
    def local(v):
        for _ in range(HOPS):
            v = inc0(v)
        return v

    x = pw.put(np.zeros((rows, WIDTH), np.float32), s0)
    cost: dict[str, list[tuple[float, float | None]]] = {"ping": [], "local": []}
    for name, fn in (("ping", ping), ("local", local)) * (rounds + 1):
        cpu, start = cluster_cpu_s(), time.perf_counter()
        np.asarray(fn(x))
        elapsed = time.perf_counter() - start
        cost[name].append((elapsed, None if cpu is None else cluster_cpu_s() - cpu))
    s0.release()
    s1.release()

    def per_hop(k: int) -> float | None:
        a, b = ([c[k] for c in cost[name][1:]] for name in ("ping", "local"))  # the first round warms up
        return None if None in a else (median(a) - median(b)) / HOPS * 1e3

    return Hop(rows * WIDTH * 4 / 2**20, per_hop(0), per_hop(1))


def measure(session: Any, setups: list[Setup], rounds: int, steps: int) -> None:
    """Round-robin over the setups, so load from elsewhere on the machine falls on all of them alike."""
    for _ in range(rounds):
        for setup in setups:
            setup.time(session, steps)
    for setup in setups:
        r = setup.row
        r.step_s = median(setup.times)
        r.round_ms = [round(t * 1e3, 2) for t in setup.times]
        r.tokens_per_s = BATCH / r.step_s
        if setup.cpu is not None:
            r.cpu_ms = setup.cpu / setup.steps * 1e3
            r.cores_busy = setup.cpu / setup.wall
        if r.setup.startswith("pipeline"):
            r.bubble_measured = 1.0 - float(np.mean(setup.busy)) / setup.wall


def verdict(n_stages: int, rows: list[Row], hops: dict[int, Hop], cores: int) -> list[str]:
    """Whether the best row of ``n_stages`` meets the target, and its ratio split into two factors: the CPU
    work per step (DP's over the pipeline's) and the cores kept busy (the pipeline's over DP's)."""
    dp = next(r for r in rows if r.setup.startswith("SPMD") and r.stages == n_stages)
    best = max((r for r in rows if r.setup.startswith("pipeline") and r.stages == n_stages),
               key=lambda r: r.ratio_to_dp)
    met = best.ratio_to_dp >= TARGET
    lines = [f"S={n_stages}: best pipeline/DP ratio {best.ratio_to_dp:.2f} ({best.schedule}, M={best.micro}): "
             f"{'meets' if met else 'misses'} the {TARGET} target"]
    if best.cpu_ms is None or dp.cpu_ms is None:
        return lines
    hop = hops[BATCH // best.micro]
    extra = best.cpu_ms - dp.cpu_ms
    lines.append(f"  = CPU work {dp.cpu_ms / best.cpu_ms:.2f} (DP {dp.cpu_ms:.0f} core-ms/step, pipeline "
                 f"{best.cpu_ms:.0f}: {extra:+.0f}, {extra / best.transfers:+.1f} per transfer; the probe puts a "
                 f"{hop.mib:.1f} MiB hop at {hop.cpu_ms:.1f})")
    lines.append(f"  x cores busy {best.cores_busy / dp.cores_busy:.2f} (pipeline {best.cores_busy:.2f}, DP "
                 f"{dp.cores_busy:.2f} of {cores}: the bubble and hop latency the other stages do not fill)")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and repetitions")
    parser.add_argument("--out", type=Path, default=default_out("pipeline"))
    args = parser.parse_args(argv)
    rounds, steps = (6, 3) if args.quick else (10, 3)
    configs = {2: [2, 4, 8, 16], 4: [2, 4, 8, 16]} if not args.quick else {2: [4, 8], 4: [4, 8]}
    schedules = ("1f1b", "gpipe")
    cores = os.cpu_count() or 1

    rng = np.random.default_rng(1)
    data = (rng.normal(size=(BATCH, WIDTH)).astype(np.float32), rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    optimizer = optax.adam(1e-3)
    start = time.perf_counter()
    session = pw.init(topology=pw.Topology(islands=4, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S))
    print(f"cluster up in {time.perf_counter() - start:.1f}s: 4 islands x 1 host x 4 CPU devices; "
          f"{cores} cores, load average {os.getloadavg()[0]:.2f}")
    rows: list[Row] = []
    try:
        sizes = sorted({BATCH // m for micros in configs.values() for m in micros})  # activation rows
        hops = {size: hop_probe(size, rounds) for size in sizes}
        for n_stages, micros in configs.items():
            setups, slices = [], []
            for made in [spmd(1, optimizer, data), spmd(n_stages, optimizer, data)] + [
                    pipelined(n_stages, m, schedule, optimizer, data) for m in micros for schedule in schedules]:
                setups.append(made[0])
                slices += made[1]
            measure(session, setups, rounds, steps)
            t1, t_dp = setups[0].row.step_s, setups[1].row.step_s
            for setup in setups:
                setup.row.speedup_vs_1 = t1 / setup.row.step_s
            for setup in setups[1:]:
                setup.row.ratio_to_dp = t_dp / setup.row.step_s
            rows += [st.row for st in setups]
            for s in slices:
                s.release()
    finally:
        pw.shutdown()

    table = Table(["setup", "S", "M", "ms/step", "tokens/s", "vs DP", "bubble pred", "bubble meas", "transfers",
                   "cpu ms/step", "cores busy", "T1/T", "stage0 act MiB"])

    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        pipe = r.setup.startswith("pipeline")
        table.add(r.setup, r.stages, r.micro if pipe else "-", f"{r.step_s * 1e3:.1f}", rate_text(r.tokens_per_s),
                  num(r.ratio_to_dp), num(r.bubble_predicted), num(r.bubble_measured), r.transfers if pipe else "-",
                  num(r.cpu_ms, ".0f"), num(r.cores_busy), num(r.speedup_vs_1),
                  "-" if r.stage0_activation_bytes is None else f"{r.stage0_activation_bytes / 2**20:.1f}")
    print()
    print(f"MLP {DEPTH} x {WIDTH}, batch {BATCH} tokens, Adam; medians of {rounds} interleaved rounds of "
          f"{steps} steps after {WARMUP + 1} warm-up steps; {cores} cores, load average now {os.getloadavg()[0]:.2f}")
    print(table.render())
    for hop in hops.values():
        print(f"one hop of {hop.mib:.1f} MiB between islands (probe, {HOPS} hops): {num(hop.latency_ms)} ms, "
              f"{num(hop.cpu_ms)} core-ms of CPU")
    single = rows[0]
    if single.cores_busy is not None and single.cores_busy > 1.0:
        print(f"1 device keeps {single.cores_busy:.2f} of {cores} cores busy, so no setup of S devices can run more "
              f"than {cores / single.cores_busy:.2f}x faster than it on this machine (the ideal split T1/(S*T) "
              f"needs S free cores). On S devices of their own a synchronous pipeline reaches at most 1 - bubble "
              f"pred of DP; here a stage alone keeps every core busy, so the bubble costs little and the ratio "
              f"measures the runtime's own cost: the CPU that moving activations takes from the computation, and "
              f"the hop latency no stage fills.")
    for n_stages in configs:
        print("\n".join(verdict(n_stages, rows, hops, cores)))
    payload = {"model": {"width": WIDTH, "depth": DEPTH, "batch": BATCH}, "target": TARGET,
               "hops": [asdict(h) for h in hops.values()],
               "rows": [asdict(r) for r in rows]}
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
