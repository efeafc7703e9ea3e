"""Island-to-island bandwidth when the islands share a Ray node and when they sit on different nodes.

Setup. A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``: each node its own raylet
and object store of ``--store-gib``), and one runtime of three single-host islands of 4 CPU devices, pinned
by node labels: islands 0 and 1 on the head node, island 2 on the worker. Island 0 -> island 1 is the
same-node path (one shared-memory object store); island 0 -> island 2 is the cross-node path (Ray's object
manager copies the pieces from one node's store into the other's over TCP, here over loopback).

Method, as ``benchmarks/transfer.py`` (whose measuring functions this reuses): ``x`` (float32, rows sharded
``P("x")`` over island 0's 4 devices) is resident; a ``@pw.program`` moves it to the other island, where the
consumer reads one element; the same probe without the move gives the fixed cost; the transfer time is the
difference of the medians. Baselines: ``np.copyto`` (one memcpy), and plain Ray: actor A on the head returns
``np.asarray`` of its jax array, actor B (on the head, or on the worker) ``jax.device_put``s it.

    python -m benchmarks.transfer_nodes [--quick] [--sizes-mib 64 256] [--reps N] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    # Before Ray loads: a private temp dir, so this cluster's address file does not become the one a plain
    # ray.init() elsewhere on the machine would join; token auth on every node, as `ray start` does.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="pwbench-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, ratio, ratio_text, write_json  # noqa: E402
from benchmarks.transfer import DEVICES, MIB, TIMEOUT_S, Endpoint, Row, memcpy_times, ray_times, runtime_times  # noqa: E402

LABEL = "pathways-bench/node"
CASE = "P(x)->P(x)"
PATHS = {"same node": 1, "cross node": 2}  # destination island of each path; the source is island 0


def start_cluster(store_bytes: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": store_bytes,
                                                            "labels": {LABEL: "head"}})
    worker = cluster.add_node(num_cpus=1, object_store_memory=store_bytes, labels={LABEL: "worker"})
    cluster.wait_for_nodes()
    return cluster, worker


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB only, 3 repetitions")
    parser.add_argument("--sizes-mib", type=float, nargs="+", help="array sizes in MiB (default 64 256)")
    parser.add_argument("--reps", type=int, help="timed repetitions (median reported; default 5)")
    parser.add_argument("--store-gib", type=float, default=1.5, help="object store of each node (default 1.5)")
    parser.add_argument("--out", type=Path, default=default_out("transfer_nodes"), help="JSON output path")
    args = parser.parse_args(argv)
    sizes = args.sizes_mib or ((64,) if args.quick else (64, 256))
    reps = args.reps or (3 if args.quick else 5)
    load_at_start = os.getloadavg()

    start = time.perf_counter()
    cluster, worker = start_cluster(int(args.store_gib * 2**30))
    topology = pw.Topology(3, 1, DEVICES, node_labels={0: {LABEL: "head"}, 1: {LABEL: "head"},
                                                       2: {LABEL: "worker"}})
    rows: dict[str, list[Row]] = {path: [] for path in PATHS}
    actors = []
    try:
        pw.init(topology=topology, address=cluster.address,
                timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S, start=300.0))
        nodes = [h.node for isl in pw.status().islands for h in isl.hosts]
        head, other = cluster.head_node.node_id, worker.node_id
        if nodes != [head, head, other]:
            raise RuntimeError(f"islands are on nodes {nodes}; expected [head, head, worker]")
        print(f"two-node cluster and runtime up in {time.perf_counter() - start:.1f}s", flush=True)
        slices = [pw.slice((DEVICES,), ("x",), island=i) for i in range(3)]
        env = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
        actors = [ray.remote(Endpoint).options(num_cpus=0, runtime_env=env, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(n, soft=False))).remote() for n in (head, head, other)]
        for size in sizes:
            for path, dst in PATHS.items():
                row = Row(f"{size:g} MiB", int(size * MIB), CASE)
                t = time.perf_counter()
                runtime_times(row, [slices[0], slices[dst]], reps)
                memcpy_times(row, reps)
                ray_times(row, [actors[0], actors[dst]], reps)
                rows[path].append(row)
                print(f"  {row.label} {path}: {time.perf_counter() - t:.1f}s", flush=True)
        for s in slices:
            s.release()
    finally:
        for actor in actors:
            ray.kill(actor)
        pw.shutdown()
        ray.shutdown()
        cluster.shutdown()

    table = Table(["size", "islands", "transfer", "runtime", "ray", "memcpy", "runtime/memcpy", "runtime/ray",
                   "vs same node"])
    for path in PATHS:
        for row, same in zip(rows[path], rows["same node"]):
            table.add(row.label, path, f"{row.transfer_s * 1e3:.1f} ms", f"{row.runtime_gbps:.2f} GB/s",
                      f"{row.ray_gbps:.2f} GB/s", f"{row.memcpy_gbps:.2f} GB/s",
                      ratio_text(ratio(row.runtime_gbps, row.memcpy_gbps)),
                      ratio_text(ratio(row.runtime_gbps, row.ray_gbps)),
                      ratio_text(ratio(row.runtime_gbps, same.runtime_gbps)))
    print()
    print(f"Island 0 -> island 1 (same node) and -> island 2 (other node), {DEVICES} devices each, {CASE}, "
          f"medians of {reps}; load average {load_at_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          f"on {os.cpu_count()} cores")
    print(table.render())
    out = write_json(args.out, {
        "benchmark": "transfer_nodes", "reps": reps, "devices_per_slice": DEVICES, "case": CASE,
        "object_store_bytes_per_node": int(args.store_gib * 2**30), "load_average_at_start": load_at_start,
        "rows": [{"path": path, **row.to_json()} for path in PATHS for row in rows[path]],
        "cross_over_same": {row.label: ratio(row.runtime_gbps, same.runtime_gbps)
                            for row, same in zip(rows["cross node"], rows["same node"])}})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
