"""What recording a trace costs: Chained (one 128-node program) with and without ``pw.trace``.

    python -m benchmarks.trace_overhead [--reps 7] [--calls 20]

Rounds alternate traced and untraced runs so load drifts hit both; the table
reports median computations/s and the overhead (target: under 5%).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from benchmarks.common import Table, default_out, median, write_json

CHAIN = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="program calls per repetition")
    parser.add_argument("--size", type=int, default=64, help="vector length of each computation")
    parser.add_argument("--out", default=str(default_out("trace_overhead")))
    args = parser.parse_args()

    import pathways as pw

    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=1))
    s = pw.slice((1,), ("x",), island=0)
    f = pw.jit(lambda v: v * 1.0001 + 0.5, slice=s)

    @pw.program
    def chained(v):
        for _ in range(CHAIN):
            v = f(v)
        return v

    v = pw.put(np.ones(args.size, np.float32), s)
    chained(v).block_until_ready()

    def run() -> float:
        start = time.perf_counter()
        outs = [chained(v) for _ in range(args.calls)]
        outs[-1].block_until_ready()
        return args.calls * CHAIN / (time.perf_counter() - start)

    plain, traced, events = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            path = os.path.join(tmp, f"t{rep}.json")
            for traced_turn in ((False, True) if rep % 2 == 0 else (True, False)):  # ABBA: no mode always first
                if traced_turn:
                    with pw.trace(path):
                        traced.append(run())
                    events = os.path.getsize(path)
                else:
                    plain.append(run())
    off, on = median(plain), median(traced)
    overhead = off / on - 1.0
    table = Table(["mode", "computations/s (median)", "reps"])
    table.add("Chained, tracing off", f"{off:.0f}", len(plain))
    table.add("Chained, pw.trace on", f"{on:.0f}", len(traced))
    print(table.render())
    print(f"recording overhead {100 * overhead:+.1f}% (target under 5%): {'MET' if overhead < 0.05 else 'NOT MET'}; "
          f"last trace file {events / 1e6:.1f} MB")
    print(f"wrote {write_json(args.out, {'off': plain, 'on': traced, 'overhead': overhead})}")
    pw.shutdown()


if __name__ == "__main__":
    main()
