"""Moving an array between islands: the runtime's bandwidth next to a memcpy and plain Ray.

Method. ``x`` (float32, rows sharded ``P("x")`` over a 4-device slice of island 0) is already resident. A
``@pw.program`` moves it to a 4-device slice of island 1 (the tracer inserts the transfer), where the
consumer reads one element (``v[:1, :1]``, so it costs microseconds and copies nothing big); we time from
dispatch to ``block_until_ready`` of that element on island 1. The same probe run on island 0 without the
transfer gives the fixed cost (dispatch, one execution, the wait's round trip); the transfer's time is the
difference of the medians. An identity consumer would have XLA copy the whole array again, which is why
it is not used. The two islands share this node, so the receiving host copies the shards straight out of
the sender (``resource_manager/direct.py``) into its pool of landing buffers; the first moves land in fresh
memory (page faults) and are reported as "cold", then 1 GiB moves untimed before the timed runs.

That time includes the latency of a program on two islands (two dispatches, the send's frame, the
receiver's wake-up: the 1 KiB row), which a transfer pays once however large it is. The *streamed* column
is bandwidth as MPI benchmarks (osu_bw) measure it: ``STREAM_BYTES`` worth of moves (8 at 64 MiB, 2 at
256 MiB) dispatched back to back, timed from the first dispatch until the last probe is ready, nothing
subtracted; one move's copy then overlaps the next one's dispatch.

Baselines: ``np.copyto`` into a preallocated array of the same size (one core, pages already mapped), and
plain Ray: actor A returns ``np.asarray`` of its resident jax array, the ObjectRef is handed to actor B,
which ``jax.device_put``s it (minus the same two calls on a 1 KiB array).

Cases: matching shardings ``P("x") -> P("x")`` (host i's shards go whole), and a reshard
``P("x") -> P(None, "x")`` (row blocks in, column blocks out: every piece feeds every device).

    python -m benchmarks.transfer [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, attach_ray, default_out, median, ratio, ratio_text, timed, write_json  # noqa: E402

MIB = 2**20
DEVICES = 4
CASES = {"P(x)->P(x)": (P("x", None), P("x", None)), "P(x)->P(None,x)": (P("x", None), P(None, "x"))}
TARGET = 0.5  # of memcpy bandwidth
WARM_BYTES = 2**30  # moved before timing: fresh landing buffers fault on first touch
STREAM_BYTES = 512 * MIB  # moved per streamed repetition (landing buffers stay within the hosts' pools)
TIMEOUT_S = 120.0


def shape_for(nbytes: int) -> tuple[int, int]:
    cols = min(1024, nbytes // (4 * 4 * DEVICES))
    return nbytes // (4 * cols), cols


def corner(v: jax.Array) -> jax.Array:
    """The consumer: one element, so the measured time is the transfer, not a computation."""
    return v[:1, :1]


class Endpoint:
    """A plain Ray actor holding one jax array: the object-store baseline."""

    def __init__(self) -> None:
        self.x: jax.Array | None = None
        self.tiny = jax.device_put(np.ones((4, 64), np.float32))

    def hold(self, shape: tuple[int, int]) -> None:
        self.x = jax.device_put(np.ones(shape, np.float32))
        self.x.block_until_ready()

    def produce(self, tiny: bool = False) -> np.ndarray:
        return np.asarray(self.tiny if tiny else self.x)

    def consume(self, value: np.ndarray) -> int:
        y = jax.device_put(value)
        y.block_until_ready()
        return int(y.size)


@dataclass
class Row:
    label: str
    nbytes: int
    case: str
    cold_s: list[float] = field(default_factory=list)
    move_s: list[float] = field(default_factory=list)
    stay_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    ray_s: list[float] = field(default_factory=list)
    ray_tiny_s: list[float] = field(default_factory=list)
    stream_s: list[float] = field(default_factory=list)

    @property
    def streamed(self) -> int:
        """Moves per streamed repetition."""
        return max(2, STREAM_BYTES // self.nbytes)

    @property
    def stream_gbps(self) -> float:
        return self.gbps(median(self.stream_s) / self.streamed) if self.stream_s else float("nan")

    @property
    def transfer_s(self) -> float:
        return max(median(self.move_s) - median(self.stay_s), 1e-9)

    def gbps(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9

    @property
    def runtime_gbps(self) -> float:
        return self.gbps(self.transfer_s)

    @property
    def cold_gbps(self) -> float:
        return self.gbps(max(median(self.cold_s) - median(self.stay_s), 1e-9))

    @property
    def memcpy_gbps(self) -> float:
        return self.gbps(median(self.memcpy_s))

    @property
    def ray_gbps(self) -> float:
        return self.gbps(max(median(self.ray_s) - median(self.ray_tiny_s), 1e-9)) if self.ray_s else float("nan")

    def to_json(self) -> dict:
        return {"label": self.label, "bytes": self.nbytes, "case": self.case, "transfer_ms": self.transfer_s * 1e3,
                "runtime_gbps": self.runtime_gbps, "cold_gbps": self.cold_gbps, "memcpy_gbps": self.memcpy_gbps,
                "ray_gbps": self.ray_gbps, "runtime_vs_memcpy": ratio(self.runtime_gbps, self.memcpy_gbps),
                "streamed_moves": self.streamed, "streamed_gbps": self.stream_gbps,
                "streamed_vs_memcpy": ratio(self.stream_gbps, self.memcpy_gbps),
                "samples_s": {"cold_move": self.cold_s, "move": self.move_s, "stay": self.stay_s,
                              "memcpy": self.memcpy_s, "ray": self.ray_s, "ray_tiny": self.ray_tiny_s,
                              "streamed": self.stream_s}}


def runtime_times(row: Row, slices: Sequence[pw.VirtualSlice], reps: int,
                  also: Callable[[], None] | None = None) -> None:
    """Time the move (and the same probe without it) ``reps`` times, after warm-up; ``also`` runs in each
    repetition too, so a burst of load on the shared machine hits it and the move alike."""
    src_spec, dst_spec = CASES[row.case]
    shape = shape_for(row.nbytes)
    value = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    x = pw.put(value, slices[0], src_spec).block_until_ready(timeout=TIMEOUT_S)
    stay = pw.jit(corner, slice=slices[0], in_specs=src_spec, out_specs=P(), name="corner")
    there = pw.jit(corner, slice=slices[1], in_specs=dst_spec, out_specs=P(), name="corner")
    move = pw.program(lambda v: there(v))
    got = move(x).fetch(timeout=TIMEOUT_S)
    if got[0, 0] != value[0, 0]:
        raise AssertionError(f"the moved array's first element is {got[0, 0]}, expected {value[0, 0]}")
    stay(x).block_until_ready(timeout=TIMEOUT_S)
    for _ in range(warmups(row.nbytes)):
        row.cold_s.append(timed(lambda: move(x).block_until_ready(timeout=TIMEOUT_S)))
    row.cold_s = row.cold_s[:3]
    for _ in range(reps):
        row.move_s.append(timed(lambda: move(x).block_until_ready(timeout=TIMEOUT_S)))
        row.stay_s.append(timed(lambda: stay(x).block_until_ready(timeout=TIMEOUT_S)))
        if also is not None:
            also()
    if row.nbytes >= MIB:
        def stream() -> None:
            for probe in [move(x) for _ in range(row.streamed)]:
                probe.block_until_ready(timeout=TIMEOUT_S)

        stream()
        row.stream_s = [timed(stream) for _ in range(reps)]


def warmups(nbytes: int) -> int:
    """Untimed transfers before the timed ones; the first three are reported as cold.

    Small values travel inline in Ray's messages and need no landing buffers, so three are enough.
    """
    return 3 if nbytes < MIB else min(64, max(3, -(-WARM_BYTES // nbytes)))


def memcpy_times(row: Row, reps: int) -> None:
    src = np.ones(row.nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    row.memcpy_s = [timed(lambda: np.copyto(dst, src)) for _ in range(reps)]


def ray_times(row: Row, actors: Sequence, reps: int) -> None:
    a, b = actors
    ray.get(a.hold.remote(shape_for(row.nbytes)), timeout=TIMEOUT_S)

    def move(tiny: bool) -> None:
        ray.get(b.consume.remote(a.produce.remote(tiny)), timeout=TIMEOUT_S)

    for _ in range(warmups(row.nbytes)):
        move(False)
    move(True)
    for _ in range(reps):
        row.ray_s.append(timed(lambda: move(False)))
        row.ray_tiny_s.append(timed(lambda: move(True)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB only, 3 repetitions")
    parser.add_argument("--sizes-mib", type=float, nargs="+", help="array sizes in MiB (default 64 256)")
    parser.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    parser.add_argument("--out", type=Path, default=default_out("transfer"), help="JSON output path")
    args = parser.parse_args(argv)
    sizes = args.sizes_mib or ((64,) if args.quick else (64, 256))
    load_at_start = os.getloadavg()
    reps = args.reps or (3 if args.quick else 7)

    start = time.perf_counter()
    attach_ray(pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=DEVICES),
                       timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S, start=300.0)))
    print(f"cluster up in {time.perf_counter() - start:.1f}s", flush=True)
    rows: list[Row] = []
    actors = []
    slices = [pw.slice((DEVICES,), ("x",), island=i) for i in (0, 1)]
    try:
        endpoint = ray.remote(Endpoint).options(num_cpus=0, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
        actors = [endpoint.remote() for _ in range(2)]
        plan = [("1 KiB", 1024, "P(x)->P(x)")]
        plan += [(f"{s:g} MiB", int(s * MIB), case) for s in sizes for case in CASES]
        for label, nbytes, case in plan:
            row = Row(label, nbytes, case)
            t = time.perf_counter()
            runtime_times(row, slices, reps)
            memcpy_times(row, reps)
            if case == "P(x)->P(x)":
                ray_times(row, actors, reps)
            rows.append(row)
            print(f"  {label} {case}: {time.perf_counter() - t:.1f}s", flush=True)
    finally:
        for actor in actors:
            ray.kill(actor)
        for s in slices:
            s.release()
        pw.shutdown()

    table = Table(["size", "sharding", "transfer", "runtime", "runtime cold", "streamed", "memcpy", "ray",
                   "runtime/memcpy", "streamed/memcpy", "ray/memcpy", "runtime/ray"])
    for r in rows:
        table.add(r.label, r.case, f"{r.transfer_s * 1e3:.2f} ms", f"{r.runtime_gbps:.2f} GB/s",
                  f"{r.cold_gbps:.2f} GB/s", f"{r.stream_gbps:.2f} GB/s" if r.stream_s else "-",
                  f"{r.memcpy_gbps:.2f} GB/s", f"{r.ray_gbps:.2f} GB/s" if r.ray_s else "-",
                  ratio_text(ratio(r.runtime_gbps, r.memcpy_gbps)), ratio_text(ratio(r.stream_gbps, r.memcpy_gbps)),
                  ratio_text(ratio(r.ray_gbps, r.memcpy_gbps)),
                  ratio_text(ratio(r.runtime_gbps, r.ray_gbps)))
    print()
    print(f"Island 0 -> island 1 ({DEVICES} devices each), medians of {reps}; transfer = move - the same probe "
          f"without the move; cold = the first moves, before {WARM_BYTES / 2**30:g} GiB had moved; load average "
          f"{load_at_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(table.render())
    print(f"Target: runtime >= {TARGET:.0%} of memcpy (1 KiB row is latency only); one transfer at a time, and "
          "streamed:")
    for r in rows[1:]:
        one, streamed = ratio(r.runtime_gbps, r.memcpy_gbps), ratio(r.stream_gbps, r.memcpy_gbps)
        print(f"  {r.label} {r.case}: one {one:.0%} {'MET' if one >= TARGET else 'NOT met'}, streamed "
              f"({r.streamed} moves) {streamed:.0%} {'MET' if streamed >= TARGET else 'NOT met'}")
    out = write_json(args.out, {"benchmark": "transfer", "reps": reps, "devices_per_slice": DEVICES,
                                "load_average_at_start": load_at_start,
                                "rows": [r.to_json() for r in rows]})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
