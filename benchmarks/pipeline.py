"""Pipeline schedules against their bubble formulas, and against data parallelism on the same devices.

Model: a token-wise MLP of DEPTH residual tanh layers of width WIDTH after a learned input offset (so the
first stage computes its input gradient too, and the stages are as equal as the formulas assume), trained
with Adam on BATCH tokens (rows) per step. One training step, written once for ``jax.jit`` with a
``pw.pipeline.end_stage`` mark after every DEPTH / S layers, runs as:

  pipeline  S stages over P one-device slices, slice k on island k (v = S / P stages per slice, interleaved);
            the batch in M micro-batches; one @pw.program per step (``pw.pipeline.jit``).
  SPMD DP   the same step on a P-device slice of island P, the batch split over the devices, gradients
            all-reduced by XLA; one pw.jit per step.

Per schedule it reports:

- the bubble *measured from the hosts' timelines*: each schedule's steps are traced (``pw.trace``) and, per
  step, the fraction of the window from the step's first forward to its last backward span that each device
  waits (neither computes nor sends or receives activations) is averaged over the devices
  (``Pipeline.measured_bubble``); next to it the fraction spent sending and receiving ("moving": a device's
  island does it between computations, where a GPU's copy engines would overlap it), the schedule's formula
  (for ZB-H1, evaluated at the forward, input-gradient and weight-gradient times measured from the same
  spans), and the schedule replayed on the formulas' cost model with each stage's measured times (so what
  remains between "replayed" and "measured" is waiting the runtime causes, and the machine's noise);
- the peak per-micro-batch state each stage's slice holds, replayed from the lowered program;
- tokens/s against SPMD DP, medians of interleaved rounds.

On a machine with fewer cores than devices, the hosts share the cores: a stage computes faster while others
wait, so the timelines are not those of P devices. Where it can (root and a cgroup CPU controller), the
benchmark therefore caps every pipeline host at the same share of the cores and the DP host at P shares
(``benchmarks.cpu_caps``): each device then computes at one fixed speed, and DP gets the same CPU as the
pipeline. ``--no-caps`` runs without. The closing lines say which it was.

    python -m benchmarks.pipeline [--quick] [--no-caps] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import pathways as pw
from benchmarks import cpu_caps
from benchmarks.common import Table, default_out, median, rate_text, write_json
from client.pipeline import order

WIDTH, DEPTH, BATCH = 1024, 8, 4096
DEVICES = 4
TIMEOUT_S = 300.0
WARMUP = 2  # steps after the compiling one, before timing
TRACED = 5  # steps traced per schedule for the bubble
SHARE = 0.8  # of the cores, split between the devices when capping (the rest for the client and Ray)


def make_step(per_stage: int, optimizer: optax.GradientTransformation):
    """The training step, marked every ``per_stage`` layers (0: unmarked)."""
    def model(params, x):
        x = x + params[0]["offset"]
        for k, p in enumerate(params):
            x = x + jnp.tanh(x @ p["w"] + p["b"])
            if per_stage and k % per_stage == per_stage - 1:
                x = pw.pipeline.end_stage(x)
        return x

    def loss_fn(params, x, y):
        return jnp.mean((model(params, x) - y) ** 2)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def init_params(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    params = [{"w": (rng.normal(size=(WIDTH, WIDTH)) * 0.5 / np.sqrt(WIDTH)).astype(np.float32),
               "b": np.zeros(WIDTH, np.float32)} for _ in range(DEPTH)]
    params[0]["offset"] = np.zeros(WIDTH, np.float32)
    return params


@dataclass
class Row:
    setup: str
    schedule: str | None = None
    p: int = DEVICES
    m: int = 1
    v: int = 1
    step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    ratio_to_dp: float | None = None
    bubble_measured: float | None = None  # waiting: neither computing nor moving activations
    bubble_per_device: list[float] | None = None
    moving: float | None = None  # in the island's sends and receives
    bubble_formula: float | None = None  # the papers' model (equal F, B, W times)
    bubble_formula_at_times: float | None = None  # at the measured F, B, W times
    bubble_replayed: float | None = None  # the schedule replayed with each stage's measured times
    times_ms: dict[str, float] = field(default_factory=dict)
    window_ms: float | None = None
    peak_bytes: list[int] | None = None
    round_ms: list[float] | None = None


class Setup:
    """One way to run the step, warmed up, timed in rounds interleaved with the others."""

    def __init__(self, row: Row, step: Any, state: tuple, data: tuple) -> None:
        self.row, self.step, self.state, self.data = row, step, state, data
        self.times: list[float] = []
        self.run(1 + WARMUP)

    def run(self, steps: int) -> None:
        """``steps`` back-to-back steps (each feeds the next), then wait for every output."""
        for _ in range(steps):
            params, opt_state, _ = self.step(*self.state, *self.data)
            self.state = (params, opt_state)
        for leaf in jax.tree_util.tree_leaves(self.state):
            leaf.block_until_ready(TIMEOUT_S)

    def time(self, steps: int) -> None:
        start = time.perf_counter()
        self.run(steps)
        self.times.append((time.perf_counter() - start) / steps)


def data_parallel(optimizer, data, s) -> Setup:
    fn = pw.jit(make_step(0, optimizer), slice=s, in_specs=(None, None, P("data"), P("data")),
                out_specs=(None, None, None), name=f"dp{DEVICES}")
    params = [{k: pw.put(v, s) for k, v in p.items()} for p in init_params()]
    x, y = pw.put(data[0], s, P("data")), pw.put(data[1], s, P("data"))
    return Setup(Row(f"SPMD DP x{DEVICES}"), fn, (params, pw.jit(optimizer.init, slice=s)(params)), (x, y))


def pipelined(schedule: str, m: int, v: int, optimizer, data, slices) -> Setup:
    stages = DEVICES * v
    step = pw.pipeline.jit(make_step(DEPTH // stages, optimizer), slices, n_micro=m, schedule=schedule,
                           batch_argnums=(2, 3), name=f"{schedule}_m{m}")
    params = init_params()
    x, y = pw.put(data[0], slices[0]), pw.put(data[1], slices[-1])
    placed, state, _ = step(params, optimizer.init(params), x, y)  # placed on the stages' slices, compiled
    row = Row(f"pipeline {schedule}", schedule, DEVICES, m, v,
              peak_bytes=[d.peak_bytes for d in step.memory(placed, state, x, y)])
    return Setup(row, step, (placed, state), (x, y))


def measure_bubble(setup: Setup) -> None:
    """Trace TRACED steps and read the bubble off the hosts' timelines."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with pw.trace(path):
            setup.run(TRACED)
        measured = setup.step.measured_bubble(path)
    r = setup.row
    r.bubble_measured, r.bubble_per_device, r.moving = measured.bubble, list(measured.per_device), measured.moving
    r.times_ms = {k: t * 1e3 for k, t in measured.times_s.items()}
    r.window_ms = measured.window_s * 1e3
    r.bubble_formula = pw.pipeline.bubble(r.schedule, r.p, r.m, r.v)
    t = measured.times_s
    r.bubble_formula_at_times = pw.pipeline.bubble(r.schedule, r.p, r.m, r.v, t.get("F", 1.0), t.get("B", 1.0),
                                                   t.get("W", 0.0))
    r.bubble_replayed = replayed(pw.pipeline.make(r.schedule, r.p, r.m, r.v), measured.stage_times_s)


def replayed(schedule: pw.pipeline.Schedule, times: dict[str, float]) -> float:
    """The schedule's idle fraction on the cost model with each stage's measured F, B and W times (a stage
    without a W span does its weight gradients inside B), moving activations for free: what the timelines
    would show without the runtime's own costs and the machine's noise."""
    def cost(w: pw.pipeline.Work) -> float:
        return times.get(f"stage{w.stage}.{w.kind}", 0.0)

    done = order.emission(schedule.name, schedule.order, order.chain_deps(schedule),
                          list(range(schedule.n_devices)), cost)
    span = max(t.finish for t in done) - min(t.start for t in done)
    return 1.0 - sum(t.finish - t.start for t in done) / schedule.n_devices / span


def cap_hosts(slices: list, dp_slice: Any, cores: int) -> tuple[cpu_caps.Caps | None, str]:
    """Cap each pipeline host at SHARE * cores / DEVICES CPUs and the DP host at DEVICES times that."""
    caps, why = cpu_caps.Caps.start()
    if caps is None:
        return None, f"not capped ({why}): they share the cores"
    spin = {}

    def busy(island: int) -> None:
        where = dp_slice if island == dp_slice.island else slices[island]
        if island not in spin:
            spin[island] = pw.jit(lambda a: jax.lax.fori_loop(0, 40, lambda _, b: jnp.tanh(b @ b), a), slice=where)
        spin[island](np.eye(512, dtype=np.float32)).block_until_ready(TIMEOUT_S)

    try:
        hosts = cpu_caps.hosts_by_island([s.island for s in slices] + [dp_slice.island], busy)
        share = SHARE * cores / DEVICES
        for island, pid in hosts.items():
            caps.cap(pid, share * (DEVICES if island == dp_slice.island else 1))
    except OSError as exc:
        caps.release()
        return None, f"not capped (capping failed: {exc}): they share the cores"
    return caps, f"each device capped at {share:.2f} cores ({why})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-caps", action="store_true", help="let the hosts share the cores uncapped")
    parser.add_argument("--out", type=Path, default=default_out("pipeline"))
    args = parser.parse_args(argv)
    rounds, steps = (3, 2) if args.quick else (6, 3)
    configs = [("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 8, 2), ("zb-h1", 8, 1)]
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(1)
    data = tuple(rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for _ in range(2))
    optimizer = optax.adam(1e-3)
    start = time.perf_counter()
    pw.init(topology=pw.Topology(islands=DEVICES + 1, hosts_per_island=1, devices_per_host=DEVICES),
            timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S))
    print(f"cluster up in {time.perf_counter() - start:.1f}s: {DEVICES + 1} islands x 1 host x {DEVICES} CPU devices; "
          f"{cores} cores, load average {os.getloadavg()[0]:.2f}")
    caps = None
    try:
        slices = [pw.slice((1,), ("x",), island=k) for k in range(DEVICES)]
        dp_slice = pw.slice((DEVICES,), ("data",), island=DEVICES)
        caps, capped = (None, "not capped (--no-caps)") if args.no_caps else cap_hosts(slices, dp_slice, cores)
        print(f"hosts: {capped}")
        setups = [data_parallel(optimizer, data, dp_slice)]
        setups += [pipelined(name, m, v, optimizer, data, slices) for name, m, v in configs]
        for _ in range(rounds):  # round-robin, so load from elsewhere falls on every setup alike
            for setup in setups:
                setup.time(steps)
        for setup in setups[1:]:
            measure_bubble(setup)
    finally:
        if caps is not None:
            caps.release()
        pw.shutdown()
    dp = setups[0].row
    for setup in setups:
        r = setup.row
        r.step_s = median(setup.times)
        r.round_ms = [round(t * 1e3, 2) for t in setup.times]
        r.tokens_per_s = BATCH / r.step_s
        r.ratio_to_dp = median(setups[0].times) / r.step_s
    rows = [s.row for s in setups]

    def num(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(["setup", "p", "m", "v", "ms/step", "tokens/s", "vs DP", "bubble meas", "moving", "formula",
                   "formula at F/B/W", "replayed", "per device", "F/B/W ms", "peak MiB per stage"])
    for r in rows:
        pipe = r.schedule is not None
        times = "/".join(f"{r.times_ms[k]:.1f}" for k in ("F", "B", "W") if k in r.times_ms) if pipe else "-"
        table.add(r.setup, r.p, r.m if pipe else "-", r.v if pipe else "-", f"{r.step_s * 1e3:.1f}",
                  rate_text(r.tokens_per_s), num(r.ratio_to_dp, ".2f"), num(r.bubble_measured), num(r.moving),
                  num(r.bubble_formula), num(r.bubble_formula_at_times), num(r.bubble_replayed),
                  " ".join(f"{b:.2f}" for b in r.bubble_per_device) if pipe else "-", times,
                  " ".join(f"{b / 2**20:.1f}" for b in r.peak_bytes) if pipe else "-")
    print()
    print(f"MLP {DEPTH} x {WIDTH}, batch {BATCH} tokens, Adam; medians of {rounds} interleaved rounds of {steps} "
          f"steps after {WARMUP + 1} warm-up steps; bubbles: medians over {TRACED} traced steps; {cores} cores, "
          f"load average now {os.getloadavg()[0]:.2f}; SPMD DP {dp.step_s * 1e3:.1f} ms/step")
    print(table.render())
    print(f"{DEVICES} devices on {cores} cores; hosts {capped}; no GPU. Bubble: the fraction of a step a device "
          "waits; moving: the fraction its island spends sending and receiving activations.")
    for r in rows[1:]:
        formula = r.bubble_formula_at_times if r.schedule == "zb-h1" else r.bubble_formula
        print(f"pipeline {r.schedule} p={r.p} m={r.m} v={r.v}: bubble measured {r.bubble_measured:.3f} "
              f"(formula {formula:.3f}), tokens/s vs DP {r.ratio_to_dp:.2f}")
    payload = {"model": {"width": WIDTH, "depth": DEPTH, "batch": BATCH}, "hosts": capped,
               "rows": [asdict(r) for r in rows]}
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
