"""Pipeline parallelism across islands against SPMD data parallelism on the same number of devices.

Model: a token-wise MLP of DEPTH residual tanh layers of width WIDTH, trained with Adam on a batch of
BATCH tokens (rows). Each step is forward, backward and the optimizer.

  pipeline  S stages of DEPTH/S layers, stage k on a 1-device slice of island k (the stages' params live
            there); the batch is split into M micro-batches; one @pw.program per step (pw.pipeline).
  SPMD DP   the whole model replicated on an S-device slice of one island, the batch split over the
            devices, gradients all-reduced by XLA; one pw.jit per step.
  1 device  the whole model on one device: the work the pipeline splits S ways (T1).

Reported per pipeline row: tokens/s; the ratio to SPMD DP on the same S devices (target >= 0.9);
the bubble predicted for a synchronous pipeline, (S-1)/(M+S-1); the bubble measured from the hosts'
busy time (1 - busy/wall, averaged over the stages: idle waiting for data, which includes transfers);
the idle fraction against the ideal split of the 1-device step, 1 - T1/(S*T); and the peak activation
bytes of stage 0 from the lowered program (1F1B stays at S micro-batches, GPipe holds all M).

On a machine with fewer cores than S, stages share cores: T1/(S*T) cannot exceed cores/S and both DP
and the pipeline are capped by the cores. The printed cores and load average say how much to trust it.

    python -m benchmarks.pipeline [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import ray  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, median, rate_text, write_json  # noqa: E402

WIDTH, DEPTH, BATCH = 512, 8, 4096
TARGET = 0.9
TIMEOUT_S = 300.0


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
    step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    ratio_to_dp: float | None = None
    bubble_predicted: float | None = None
    bubble_measured: float | None = None
    idle_vs_t1: float | None = None
    stage0_activation_bytes: int | None = None


def busy(session: Any, islands: list[int]) -> list[float]:
    refs = [session.islands[i].hosts[0].stats.remote() for i in islands]
    return [s["busy_s"] for s in ray.get(refs, timeout=TIMEOUT_S)]


class Setup:
    """One way to run the training step, warmed up, timed in rounds interleaved with the others."""

    def __init__(self, row: Row, step, state: tuple, islands: list[int]) -> None:
        self.row, self._step, self._state, self.islands = row, step, state, islands
        self.times: list[float] = []
        self.wall = 0.0
        self.busy = [0.0] * len(islands)
        np.asarray(self.run(1)[-1])  # compile and warm up

    def run(self, steps: int) -> tuple:
        for _ in range(steps):
            self._state = self._step(*self._state[:2])
        return self._state

    def time(self, session: Any, steps: int) -> None:
        """``steps`` back-to-back steps (each feeds the next), waited at the end; adds the hosts' busy time."""
        before = busy(session, self.islands)
        start = time.perf_counter()
        np.asarray(self.run(steps)[-1])
        elapsed = time.perf_counter() - start
        self.times.append(elapsed / steps)
        self.wall += elapsed
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
    row = Row(f"pipeline {schedule}", n_stages, n_micro,
              bubble_predicted=pw.pipeline.predicted_bubble(n_stages, n_micro),
              stage0_activation_bytes=pipe.memory(params, states, xa, ta)[0].peak_bytes)
    setup = Setup(row, lambda p, o: pipe.step(p, o, xa, ta), (params, states), list(range(n_stages)))
    return setup, slices


def measure(session: Any, setups: list[Setup], rounds: int, steps: int) -> None:
    """Round-robin over the setups, so load from elsewhere on the machine falls on all of them alike."""
    for _ in range(rounds):
        for setup in setups:
            setup.time(session, steps)
    for setup in setups:
        r = setup.row
        r.step_s = median(setup.times)
        r.tokens_per_s = BATCH / r.step_s
        if r.setup.startswith("pipeline"):
            r.bubble_measured = 1.0 - float(np.mean(setup.busy)) / setup.wall


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and repetitions")
    parser.add_argument("--out", type=Path, default=default_out("pipeline"))
    args = parser.parse_args(argv)
    rounds, steps = (2, 2) if args.quick else (5, 2)
    configs = {2: [2, 4, 8, 16], 4: [4, 8, 16]} if not args.quick else {2: [4, 8], 4: [8]}
    schedules = ("1f1b", "gpipe")

    rng = np.random.default_rng(1)
    data = (rng.normal(size=(BATCH, WIDTH)).astype(np.float32), rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    optimizer = optax.adam(1e-3)
    start = time.perf_counter()
    session = pw.init(topology=pw.Topology(islands=4, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S))
    print(f"cluster up in {time.perf_counter() - start:.1f}s: 4 islands x 1 host x 4 CPU devices; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    rows: list[Row] = []
    try:
        for n_stages, micros in configs.items():
            setups, slices = [], []
            for made in [spmd(1, optimizer, data), spmd(n_stages, optimizer, data)] + [
                    pipelined(n_stages, m, schedule, optimizer, data) for m in micros for schedule in schedules]:
                setups.append(made[0])
                slices += made[1]
            measure(session, setups, rounds, steps)
            t1, t_dp = setups[0].row.step_s, setups[1].row.step_s
            for setup in setups[1:]:
                r = setup.row
                r.ratio_to_dp = t_dp / r.step_s
                r.idle_vs_t1 = 1.0 - t1 / (n_stages * r.step_s)
            rows += [setups[0].row] + [st.row for st in setups[1:]]
            for s in slices:
                s.release()
    finally:
        pw.shutdown()

    table = Table(["setup", "S", "M", "ms/step", "tokens/s", "vs DP", "bubble pred", "bubble meas",
                   "1-T1/(S*T)", "stage0 act MiB"])

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        table.add(r.setup, r.stages, r.micro if r.setup.startswith("pipeline") else "-", f"{r.step_s * 1e3:.1f}",
                  rate_text(r.tokens_per_s), pct(r.ratio_to_dp), pct(r.bubble_predicted), pct(r.bubble_measured),
                  pct(r.idle_vs_t1),
                  "-" if r.stage0_activation_bytes is None else f"{r.stage0_activation_bytes / 2**20:.1f}")
    print()
    print(f"MLP {DEPTH} x {WIDTH}, batch {BATCH} tokens, Adam; medians of {rounds} interleaved rounds of "
          f"{steps} steps; {os.cpu_count()} cores, load average now {os.getloadavg()[0]:.2f}")
    print(table.render())
    best = {s: max((r.ratio_to_dp for r in rows if r.setup.startswith("pipeline") and r.stages == s), default=None)
            for s in configs}
    for s, value in best.items():
        verdict = "meets" if value is not None and value >= TARGET else "misses"
        print(f"S={s}: best pipeline/DP ratio {value:.2f} ({verdict} the {TARGET} target)")
    if os.cpu_count() < max(configs):
        print(f"note: {os.cpu_count()} cores for up to {max(configs)} stages; stages and DP devices share cores, "
              "so neither scales with S here and the S=4 rows measure contention as much as pipelining")
    payload = {"model": {"width": WIDTH, "depth": DEPTH, "batch": BATCH}, "target": TARGET,
               "rows": [asdict(r) for r in rows]}
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
