"""Pathways' Figure 5 on this machine: computations per second against the time of one computation.

Modes, with Pathways' names:
  O        op-by-op: each pw.jit call is its own one-node program; all in flight, one wait at the end.
  C        chained: one @pw.program of 128 nodes per call; calls in flight, one wait at the end.
  F        fused: one pw.jit whose body applies the step 128 times.
  jax-O/C  in-process jax.jit, 128 separately dispatched calls in a Python loop (JAX has no O/C difference).
  jax-F    in-process jax.jit of the fused function.
  ray-O    naive Ray: one actor call per computation, the value handed call to call as an ObjectRef.

Setups (D = devices per slice = hosts per island; every computation is the step on D devices):
  1 island        one chain on a slice of island 0.
  2 isl parallel  independent chains on both islands at once: one message per island per call; JAX runs
                  the step sharded over 2D devices. Twice the work of one island, on twice the devices.
  2 isl split     the 128 nodes cross islands: 64 on island 0, one transfer, 64 on island 1; the next call
                  goes back (64 on 1, transfer, 64 on 0), so every call is serial and has one transfer. JAX
                  does the same with one jax.device_put between two device sets.

The JAX baseline runs in this process, interleaved with the runtime's repetitions so the machine's noise
hits both alike. The client needs no devices (it exports against abstract meshes), so this process gives
its own JAX 2D CPU devices before the backend starts; the islands' hosts set theirs in their runtime_env.

    python -m benchmarks.dispatch [--quick] [--hosts-per-island 1 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Table,
    attach_ray,
    default_out,
    median,
    plot_lines,
    rate_text,
    ratio,
    ratio_text,
    timed,
    units_for,
    write_json,
)

CHAIN = 128  # computations per chained program / fused computation, as in Pathways
WIDTH = 256  # float32 elements per device: a tiny array, so dispatch (not data) is what is measured
FULL_SIZES_US = (0, 10, 30, 100, 300, 1000, 3000)
QUICK_SIZES_US = (0, 100, 1000)
PATHWAYS_CROSSOVER_MS = 2.3  # the paper's Figure 5: Chained matched JAX from 2.3 ms per computation at 16 hosts
TIMEOUT_S = 120.0


# -- the computation -----------------------------------------------------------------------------
def step(x: jax.Array, iters: int) -> jax.Array:
    """One computation: a single add, or ``iters`` rounds of an elementwise map (its cost grows linearly)."""
    if iters == 0:
        return x + 1.0
    return jax.lax.fori_loop(0, iters, lambda _, v: jnp.sin(v) * 0.999 + 0.001, x)


def fused(x: jax.Array, iters: int) -> jax.Array:
    """``CHAIN`` computations fused into one."""
    return jax.lax.fori_loop(0, CHAIN, lambda _, v: step(v, iters), x)


def chain(fn: Callable, v: Any, n: int) -> Any:
    for _ in range(n):
        v = fn(v)
    return v


class StepActor:
    """Naive Ray: an actor holding a jitted step, applied to whatever value it is handed."""

    def __init__(self) -> None:
        self._fn: Callable | None = None

    def configure(self, iters: int) -> None:
        fn = jax.jit(functools.partial(step, iters=iters))
        fn(np.zeros((1, WIDTH), np.float32)).block_until_ready()
        self._fn = fn

    def step(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._fn(x))


# -- measuring -----------------------------------------------------------------------------------
@dataclass
class Mode:
    """``run(units)`` does ``units`` units of work and waits for the last result; a unit is ``comps`` computations."""

    name: str
    run: Callable[[int], None]
    comps: int
    units: int = 0
    rates: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return median(self.rates)


def measure(modes: Sequence[Mode], reps: int, target_s: float) -> None:
    """Warm every mode, size its repetitions to about ``target_s``, then time them round-robin."""
    for mode in modes:
        mode.run(1)  # compiles everywhere
        per_unit = timed(lambda m=mode: m.run(1))
        if per_unit * 8 < target_s:
            per_unit = timed(lambda m=mode: m.run(8)) / 8
        mode.units = units_for(per_unit, target_s, 1, 100_000)
    for _ in range(reps):
        for mode in modes:
            mode.rates.append(mode.units * mode.comps / timed(lambda m=mode: m.run(m.units)))


def runtime_mode(name: str, calls: Sequence[Callable[..., tuple]], xs: tuple, comps: int) -> Mode:
    """Unit k applies ``calls[k % len(calls)]`` to the values of the previous unit (all futures)."""

    def run(units: int) -> None:
        vs = xs
        for k in range(units):
            vs = calls[k % len(calls)](*vs)
        for v in vs:
            v.block_until_ready(timeout=TIMEOUT_S)

    return Mode(name, run, comps)


def jax_mode(name: str, calls: Sequence[Callable[[jax.Array], jax.Array]], x: jax.Array, comps: int) -> Mode:
    def run(units: int) -> None:
        v = x
        for k in range(units):
            v = calls[k % len(calls)](v)
        v.block_until_ready()

    return Mode(name, run, comps)


def ray_mode(plans: list[list[list[tuple[Any, int]]]], comps: int) -> Mode:
    """One chain of actor calls per shard; ``plans[s][k % len]`` lists (actor, calls) for unit k of shard s."""

    def run(units: int) -> None:
        refs = [ray.put(np.zeros((1, WIDTH), np.float32)) for _ in plans]
        for k in range(units):
            for s, plan in enumerate(plans):
                for actor, calls in plan[k % len(plan)]:
                    for _ in range(calls):
                        refs[s] = actor.step.remote(refs[s])
        ray.get(refs, timeout=TIMEOUT_S)

    return Mode("ray-O", run, comps)


# -- one cluster --------------------------------------------------------------------------------
@dataclass
class Point:
    hosts: int
    setup: str
    target_us: float
    iters: int
    step_us: float = math.nan
    modes: dict[str, Mode] = field(default_factory=dict)

    def rate(self, name: str) -> float:
        mode = self.modes.get(name)
        return mode.rate if mode is not None else math.nan

    def to_json(self) -> dict:
        return {"hosts_per_island": self.hosts, "setup": self.setup, "target_us": self.target_us,
                "iters": self.iters, "step_us": self.step_us,
                "modes": {n: {"comps_per_s": m.rate, "reps": m.rates, "units": m.units, "comps_per_unit": m.comps}
                          for n, m in self.modes.items()}}


class Bench:
    """Slices, actors and JAX shardings for one topology (D hosts per island, one device each)."""

    def __init__(self, hosts: int) -> None:
        self.d = hosts
        self.slices = [pw.slice((hosts,), ("x",), island=i) for i in (0, 1)]
        remote = ray.remote(StepActor).options(
            num_cpus=0, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu",
                                                  "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}})
        self.actors = [[remote.remote() for _ in range(hosts)] for _ in (0, 1)]
        devices = jax.devices()[:2 * hosts]
        self.shardings = [NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
                          for devs in (devices[:hosts], devices[hosts:], devices)]

    def points(self, target_us: float, iters: int, reps: int, target_s: float) -> list[Point]:
        ray.get([a.configure.remote(iters) for group in self.actors for a in group], timeout=TIMEOUT_S)
        f_step, f_fused = functools.partial(step, iters=iters), functools.partial(fused, iters=iters)
        spec = P("x")
        fns = [pw.jit(f_step, slice=s, in_specs=spec, out_specs=spec, name=f"step{iters}") for s in self.slices]
        big = [pw.jit(f_fused, slice=s, in_specs=spec, out_specs=spec, name=f"fused{iters}") for s in self.slices]
        xs = [pw.put(np.zeros((self.d, WIDTH), np.float32), s, spec) for s in self.slices]
        jf, jF = jax.jit(f_step), jax.jit(f_fused)
        jx = [jax.device_put(np.zeros((n * self.d, WIDTH), np.float32), sh)
              for n, sh in zip((1, 1, 2), self.shardings)]
        a, b = self.actors
        out = []

        one = Point(self.d, "1 island", target_us, iters)
        one.modes = {m.name: m for m in [
            runtime_mode("O", [lambda v: (fns[0](v),)], (xs[0],), 1),
            runtime_mode("C", [pw.program(parallel_chains([fns[0]]))], (xs[0],), CHAIN),
            runtime_mode("F", [lambda v: (big[0](v),)], (xs[0],), CHAIN),
            jax_mode("jax-O/C", [lambda v: chain(jf, v, CHAIN)], jx[0], CHAIN),
            jax_mode("jax-F", [jF], jx[0], CHAIN),
            ray_mode([[[(actor, CHAIN)]] for actor in a[:self.d]], CHAIN)]}
        out.append(one)

        par = Point(self.d, "2 isl parallel", target_us, iters)
        par.modes = {m.name: m for m in [
            runtime_mode("O", [lambda u, v: (fns[0](u), fns[1](v))], tuple(xs), 2),
            runtime_mode("C", [pw.program(parallel_chains(fns))], tuple(xs), 2 * CHAIN),
            runtime_mode("F", [pw.program(parallel_fused(big))], tuple(xs), 2 * CHAIN),
            jax_mode("jax-O/C", [lambda v: chain(jf, v, CHAIN)], jx[2], 2 * CHAIN),
            jax_mode("jax-F", [jF], jx[2], 2 * CHAIN),
            ray_mode([[[(actor, CHAIN)]] for group in (a, b) for actor in group], 2 * CHAIN)]}
        out.append(par)

        half = CHAIN // 2
        there = jax_crossing(jf, half, self.shardings[1])
        back = jax_crossing(jf, half, self.shardings[0])
        split = Point(self.d, "2 isl split", target_us, iters)
        split.modes = {m.name: m for m in [
            runtime_mode("C", [pw.program(split_chain(fns[0], fns[1])), pw.program(split_chain(fns[1], fns[0]))],
                         (xs[0],), CHAIN),
            jax_mode("jax-O/C", [there, back], jx[0], CHAIN),
            ray_mode([[[(a[k], half), (b[k], half)], [(b[k], half), (a[k], half)]] for k in range(self.d)],
                     CHAIN)]}
        out.append(split)

        for point in out:
            measure(list(point.modes.values()), reps, target_s)
        one_f = one.rate("jax-F")
        for point in out:
            point.step_us = 1e6 / one_f if one_f > 0 else math.nan
        return out

    def close(self) -> None:
        for group in self.actors:
            for actor in group:
                ray.kill(actor)
        for s in self.slices:
            s.release()


def parallel_chains(fns: Sequence[pw.CompiledFunction]) -> Callable[..., tuple]:
    def chained(*vs: Any) -> tuple:
        return tuple(chain(f, v, CHAIN) for f, v in zip(fns, vs))

    return chained


def parallel_fused(fns: Sequence[pw.CompiledFunction]) -> Callable[..., tuple]:
    def fused_nodes(*vs: Any) -> tuple:
        return tuple(f(v) for f, v in zip(fns, vs))

    return fused_nodes


def split_chain(first: pw.CompiledFunction, second: pw.CompiledFunction) -> Callable[..., tuple]:
    def split(v: Any) -> tuple:
        return (chain(second, chain(first, v, CHAIN // 2), CHAIN // 2),)

    return split


def jax_crossing(fn: Callable, half: int, to: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    def crossing(v: jax.Array) -> jax.Array:
        return chain(fn, jax.device_put(chain(fn, v, half), to), half)

    return crossing


def calibrate() -> float:
    """Seconds per iteration of the step's loop on one device, in this process."""
    fn = jax.jit(functools.partial(fused, iters=64))
    x = jnp.zeros((1, WIDTH), jnp.float32)
    fn(x).block_until_ready()
    return median([timed(lambda: fn(x).block_until_ready()) for _ in range(5)]) / (CHAIN * 64)


def run_topology(hosts: int, sizes: Sequence[tuple[float, int]], reps: int, target_s: float) -> list[Point]:
    topology = pw.Topology(islands=2, hosts_per_island=hosts, devices_per_host=1)
    start = time.perf_counter()
    attach_ray(pw.init(topology=topology, timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=60.0, start=300.0)))
    bench = None
    try:
        print(f"cluster {topology} up in {time.perf_counter() - start:.1f}s", flush=True)
        bench = Bench(hosts)
        points = []
        for target_us, iters in sizes:
            t = time.perf_counter()
            got = bench.points(target_us, iters, reps, target_s)
            points.extend(got)
            print(f"  hosts/island={hosts} step~{got[0].step_us:.1f}us (iters={iters}) measured in "
                  f"{time.perf_counter() - t:.1f}s", flush=True)
        return points
    finally:
        if bench is not None:
            bench.close()
        pw.shutdown()


# -- report ----------------------------------------------------------------------------------------
def step_text(us: float) -> str:
    return f"{us / 1e3:.2f}ms" if us >= 1000 else f"{us:.3g}us"


def report(points: list[Point]) -> Table:
    table = Table(["setup", "step", "O", "C", "F", "jax-O/C", "jax-F", "ray-O", "C/jax", "F/jax-F", "C/ray-O"])
    for p in points:
        setup = p.setup if p.hosts == 1 else f"{p.setup} ({p.hosts} hosts/isl)"
        table.add(setup, step_text(p.step_us), *(rate_text(p.rate(n)) for n in
                                                 ("O", "C", "F", "jax-O/C", "jax-F", "ray-O")),
                  ratio_text(ratio(p.rate("C"), p.rate("jax-O/C"))), ratio_text(ratio(p.rate("F"), p.rate("jax-F"))),
                  ratio_text(ratio(p.rate("C"), p.rate("ray-O"))))
    return table


def crossover(points: list[Point], level: float = 0.95) -> dict:
    """Where C reaches ``level`` of jax-O/C: first at all, and from which size on at every larger size.

    ``holds_from_us`` is log-interpolated between the last size below ``level`` and the first above it.
    """
    pts = sorted((p.step_us, ratio(p.rate("C"), p.rate("jax-O/C"))) for p in points)
    best = max(pts, key=lambda p: p[1] if not math.isnan(p[1]) else -1.0)
    out: dict = {"level": level, "best_ratio": best[1], "best_at_us": best[0],
                 "first_us": next((x for x, r in pts if r >= level), None), "holds_from_us": None}
    first = next((i for i in range(len(pts)) if all(r >= level for _, r in pts[i:])), None)
    if first is None:
        return out
    out["holds_from_us"] = out["interpolated_us"] = pts[first][0]
    if first > 0:
        (x0, r0), (x1, r1) = pts[first - 1], pts[first]
        if x0 > 0 and r1 > r0:
            frac = (level - r0) / (r1 - r0)
            out["interpolated_us"] = math.exp(math.log(x0) + frac * (math.log(x1) - math.log(x0)))
    return out


def targets(points: list[Point]) -> tuple[list[str], dict]:
    lines, summary = [], {}
    groups: dict[tuple[int, str], list[Point]] = {}
    for p in points:
        groups.setdefault((p.hosts, p.setup), []).append(p)
    for (hosts, setup), pts in groups.items():
        name = setup if hosts == 1 else f"{setup} ({hosts} hosts/isl)"
        smallest = min(pts, key=lambda p: p.step_us)
        c_ray = ratio(smallest.rate("C"), smallest.rate("ray-O"))
        fused = [(p.step_us, ratio(p.rate("F"), p.rate("jax-F"))) for p in pts if "F" in p.modes]
        met_f = [s for s, r in fused if r >= 0.9]
        cross = crossover(pts)
        summary[name] = {"chained_vs_ray_at_smallest": c_ray, "chained_vs_ray_met": c_ray >= 10,
                         "fused_vs_jax": fused, "fused_met_all": bool(fused) and len(met_f) == len(fused),
                         "chained_95pct_of_jax": cross}
        lines.append(f"  {name}: Chained >= 10x ray-O at {step_text(smallest.step_us)}: {ratio_text(c_ray)} "
                     f"{'MET' if c_ray >= 10 else 'NOT met'}")
        if fused:
            where = ", ".join(step_text(s) for s in met_f) or "no size"
            lines.append(f"  {name}: Fused >= 0.9x jax-F: met at {len(met_f)}/{len(fused)} sizes ({where})")
        if cross["holds_from_us"] is not None:
            lines.append(f"  {name}: Chained >= 95% of jax-O/C first at {step_text(cross['first_us'])}, at every "
                         f"larger size from {step_text(cross['holds_from_us'])} (interpolated "
                         f"{step_text(cross['interpolated_us'])}; Pathways: {PATHWAYS_CROSSOVER_MS} ms at 16 hosts)")
        else:
            first = "never" if cross["first_us"] is None else f"first at {step_text(cross['first_us'])} but not"
            lines.append(f"  {name}: Chained >= 95% of jax-O/C {first} at every larger size (best "
                         f"{ratio_text(cross['best_ratio'])} at {step_text(cross['best_at_us'])})")
    return lines, summary


def plot(points: list[Point], path: Path) -> Path | None:
    """Every mode of the first topology's single island, and Chained for every setup."""
    series: dict[str, tuple[list, list]] = {}
    for p in points:
        names = tuple(p.modes) if (p.hosts, p.setup) == (points[0].hosts, "1 island") else ("C",)
        where = p.setup if p.hosts == 1 else f"{p.setup}, {p.hosts} hosts/isl"
        for n in names:
            xs, ys = series.setdefault(f"{n} ({where})", ([], []))
            xs.append(p.step_us / 1e3)
            ys.append(p.rate(n))
    return plot_lines(path, "Computations per second vs. computation time (cf. Pathways Fig. 5)",
                      "time of one computation (ms)", "computations / s", series)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_US} us, 3 reps, short reps")
    parser.add_argument("--sizes", type=float, nargs="+", help="target microseconds per computation (0 = one add)")
    parser.add_argument("--reps", type=int, help="timed repetitions per mode (median reported)")
    parser.add_argument("--rep-seconds", type=float, help="about how long one timed repetition lasts")
    parser.add_argument("--hosts-per-island", type=int, nargs="+", default=[1],
                        help="one cluster per value; 2 needs multi-host islands (skipped with a message if they fail)")
    parser.add_argument("--out", type=Path, default=default_out("dispatch"), help="JSON output path")
    parser.add_argument("--no-plot", action="store_true", help="do not write a PNG next to the JSON")
    args = parser.parse_args(argv)
    if any(h < 1 for h in args.hosts_per_island):
        parser.error("--hosts-per-island values must be positive")
    sizes_us = args.sizes or (QUICK_SIZES_US if args.quick else FULL_SIZES_US)
    reps = args.reps or (3 if args.quick else 5)
    target_s = args.rep_seconds or (0.15 if args.quick else 0.3)

    load_at_start = os.getloadavg()
    jax.config.update("jax_num_cpu_devices", 2 * max(args.hosts_per_island))
    per_iter = calibrate()
    sizes = [(us, 0 if us <= 0 else max(1, round(us * 1e-6 / per_iter))) for us in sizes_us]
    print(f"step loop: {per_iter * 1e6:.3f}us per iteration; sizes (target us, iters): {sizes}", flush=True)

    points: list[Point] = []
    skipped: dict[int, str] = {}
    for hosts in args.hosts_per_island:
        try:
            points.extend(run_topology(hosts, sizes, reps, target_s))
        except Exception as exc:  # multi-host islands may not work yet: report, keep the other results
            if hosts == 1:
                raise
            skipped[hosts] = f"{type(exc).__name__}: {exc}"
            print(f"SKIPPED {hosts} hosts per island: {skipped[hosts]}", flush=True)
            traceback.print_exc(limit=3)

    print()
    print(f"Computations per second (medians of {reps}); a computation = the step on one slice "
          f"({CHAIN} per chained program / fused call); load average {load_at_start[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(report(points).render())
    lines, summary = targets(points)
    print("Targets:")
    print("\n".join(lines))
    for hosts, why in skipped.items():
        print(f"  {hosts} hosts per island: skipped ({why})")
    out = write_json(args.out, {"benchmark": "dispatch", "chain": CHAIN, "width": WIDTH, "reps": reps,
                                "rep_seconds": target_s, "loop_iteration_us": per_iter * 1e6,
                                "load_average_at_start": load_at_start,
                                "points": [p.to_json() for p in points], "targets": summary,
                                "skipped": {str(k): v for k, v in skipped.items()}})
    print(f"wrote {out}")
    if not args.no_plot:
        png = plot(points, out.with_suffix(".png"))
        if png is not None:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
