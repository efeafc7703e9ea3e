"""Island-to-island bandwidth across two Ray nodes: the network path, the object store, and the bare link.

Setup. A Ray cluster of two nodes on this machine (``benchmarks.nodes``: each node its own raylet and object
store of ``--store-gib``), and one runtime of three single-host islands of 4 CPU devices, pinned
by node labels: islands 0 and 1 on the head node, island 2 on the worker. Island 0 -> island 2 crosses the
nodes; island 0 -> island 1 (the same-node path: the receiver copies shards out of the sender) is measured
for reference.

Phases, on the same cluster:
  1. ``runtime (network)``: the runtime as deployed: island 0's host pushes shards to island 2's over the
     network data path (``resource_manager/network``). Interleaved with it, ``raw TCP``: the same number of
     bytes between the same two host processes over one plain TCP connection of that path (``probe_network``:
     one header, then the bytes, landed in a buffer there and acknowledged; no serialization, no chunking).
     And ``Ray actors``: plain Ray, actor A on the head returns ``np.asarray`` of its jax array, actor B on
     the worker ``jax.device_put``s it.
  2. ``runtime (object store)``: the runtime restarted with ``PATHWAYS_NETWORK=off`` (set for the runtime's
     actors through the job's runtime_env), so the same transfer goes through Ray's object stores, the
     fallback.

Method, as ``benchmarks/transfer.py``: ``x`` (float32, rows sharded ``P("x")`` over island 0's 4 devices) is
resident; a ``@pw.program`` moves it to the other island, where the consumer reads one element; the same
probe without the move gives the fixed cost; the transfer time is the difference of the medians. Each
repetition takes the move, the probe without it, and the raw TCP probe in turn. Cases: ``P(x)->P(x)`` and the
reshard ``P(x)->P(None,x)`` (whose raw baseline is the same bytes over the same link).

``--streams-sweep 1 2 4`` then restarts the runtime with 1, 2 and 4 connections per peer
(``PATHWAYS_NETWORK_STREAMS``) and times the ``P(x)->P(x)`` moves again with each.

    python -m benchmarks.transfer_nodes [--quick] [--sizes-mib 64 256] [--reps N] [--streams-sweep N ...]
                                        [--out PATH]

It ends with one line: ``cross-node: runtime/object-store R1x, runtime/raw-tcp R2x (256 MiB, P(x)->P(x))``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":
    # Before Ray loads: a private temp dir (unless one is given), so this cluster's address file does not become
    # the one a plain ray.init() elsewhere on the machine would join; token auth on every node, as `ray start`.
    os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pwbench-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, median, ratio, ratio_text, write_json  # noqa: E402
from benchmarks.nodes import TwoNodes  # noqa: E402
from benchmarks.transfer import (  # noqa: E402
    CASES,
    DEVICES,
    MIB,
    TIMEOUT_S,
    Endpoint,
    Row,
    ray_times,
    runtime_times,
)
from pathways.names import RAY_SYSTEM_CONFIG  # noqa: E402

LABEL = "pathways-bench/node"
SAME, CROSS = 1, 2  # destination islands: the same node as island 0, and the other node
HEADLINE = ("256 MiB", "P(x)->P(x)")
RUNTIME: dict = {}  # the runtime started last: its address and credentials


def start_cluster(store_bytes: int) -> TwoNodes:
    """The head node (islands 0 and 1) and the worker (island 2), each with an object store of ``store_bytes``."""
    return TwoNodes(store_bytes, LABEL, RAY_SYSTEM_CONFIG)


def start_runtime(address: str, network: bool, streams: int | None = None) -> None:
    """The runtime on the cluster, its actors with the network path on or off and ``streams`` connections per
    peer (the job's runtime_env, which the resource manager's actors inherit)."""
    from pathways.names import NAMESPACE
    from resource_manager.launch import enable_token_auth, start_with_credentials

    enable_token_auth()
    env = {"env_vars": {"PATHWAYS_NETWORK": "on" if network else "off"}}
    if streams:
        env["env_vars"]["PATHWAYS_NETWORK_STREAMS"] = str(streams)
    ray.init(address=address, namespace=NAMESPACE, runtime_env=env, logging_level="WARNING")
    topology = pw.Topology(3, 1, DEVICES, node_labels={0: {LABEL: "head"}, 1: {LABEL: "head"}, 2: {LABEL: "worker"}})
    timeouts = {"fetch": TIMEOUT_S, "op": TIMEOUT_S, "start": 300.0}
    RUNTIME.update(start_with_credentials(topology.to_wire(), timeouts))
    pw.init(address=RUNTIME["address"], tenant=RUNTIME["tenant"], credential=RUNTIME["credential"],
            timeouts=pw.Timeouts(**timeouts))


def stop_runtime(timeout: float = 60.0) -> None:
    """Kill the resource manager and the islands (as `pathways down`), then leave the job."""
    from pathways.names import NAMESPACE

    pw.shutdown()
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE:
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
    deadline = time.monotonic() + timeout
    while any(a["namespace"] == NAMESPACE for a in ray.util.list_named_actors(all_namespaces=True)):
        if time.monotonic() > deadline:
            raise TimeoutError("the runtime's actors did not go away")
        time.sleep(0.2)
    ray.shutdown()


def host_stats(island: int) -> dict:
    from client.session import current

    return current().host_stats(island, 0)


def raw_probe(nbytes: int) -> float:
    """One plain connection from island 0's host to island 2's: seconds for ``nbytes`` landed and acknowledged."""
    return pw.admin(RUNTIME["admin_credential"]).probe_network((0, 0), (CROSS, 0), nbytes)


def check_nodes(cluster: TwoNodes) -> None:
    nodes = [h.node for isl in pw.status().islands for h in isl.hosts]
    if nodes != [cluster.head, cluster.head, cluster.worker]:
        raise RuntimeError(f"islands are on nodes {nodes}; expected [head, head, worker]")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB only, 3 repetitions")
    parser.add_argument("--sizes-mib", type=float, nargs="+", help="array sizes in MiB (default 64 256)")
    parser.add_argument("--reps", type=int, help="timed repetitions (median reported; default 5)")
    parser.add_argument("--store-gib", type=float, default=1.5, help="object store of each node (default 1.5)")
    parser.add_argument("--streams-sweep", type=int, nargs="*", default=[], metavar="N",
                        help="also time P(x)->P(x) with N connections per peer (the runtime restarted for each)")
    parser.add_argument("--out", type=Path, default=default_out("transfer_nodes"), help="JSON output path")
    args = parser.parse_args(argv)
    sizes = args.sizes_mib or ((64,) if args.quick else (64, 256))
    reps = args.reps or (3 if args.quick else 5)
    load_at_start = os.getloadavg()
    plan = [(f"{s:g} MiB", int(s * MIB), case) for s in sizes for case in CASES]

    start = time.perf_counter()
    cluster = start_cluster(int(args.store_gib * 2**30))
    network: dict[tuple, Row] = {}
    same: dict[tuple, Row] = {}
    store: dict[tuple, Row] = {}
    raw: dict[str, list[float]] = {}
    carried: dict[str, int] = {}
    sweep: list[tuple[int, Row]] = []  # (connections per peer, row), in the order run
    actors = []
    try:
        start_runtime(cluster.address, network=True)
        check_nodes(cluster)
        print(f"two-node cluster and runtime up in {time.perf_counter() - start:.1f}s", flush=True)
        slices = [pw.slice((DEVICES,), ("x",), island=i) for i in range(3)]
        env = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
        actors = [ray.remote(Endpoint).options(num_cpus=0, runtime_env=env, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(n, soft=False))).remote() for n in (cluster.head, cluster.worker)]
        before = host_stats(CROSS)["net_bytes_in"]
        for label, nbytes, case in plan:
            t = time.perf_counter()
            row = network[(label, case)] = Row(label, nbytes, case)
            samples = raw.setdefault(label, [])
            raw_probe(nbytes)  # warm: the landing buffer there
            runtime_times(row, [slices[0], slices[CROSS]], reps,
                          lambda out=samples, n=nbytes: out.append(raw_probe(n)))
            if case == "P(x)->P(x)":
                ray_times(row, actors, reps)
                same[(label, case)] = Row(label, nbytes, case)
                runtime_times(same[(label, case)], [slices[0], slices[SAME]], reps)
            print(f"  network path: {label} {case} in {time.perf_counter() - t:.1f}s", flush=True)
        stats = host_stats(CROSS)
        carried["network"] = stats["net_bytes_in"] - before
        carried["fallbacks"] = host_stats(0)["net_fallbacks"]
        for s in slices:
            s.release()
        for actor in actors:
            ray.kill(actor)
        actors = []
        stop_runtime()

        start_runtime(cluster.address, network=False)
        check_nodes(cluster)
        slices = [pw.slice((DEVICES,), ("x",), island=i) for i in range(3)]
        for label, nbytes, case in plan:
            t = time.perf_counter()
            row = store[(label, case)] = Row(label, nbytes, case)
            runtime_times(row, [slices[0], slices[CROSS]], reps)
            print(f"  object store: {label} {case} in {time.perf_counter() - t:.1f}s", flush=True)
        for s in slices:
            s.release()
        for streams in args.streams_sweep:
            stop_runtime()
            start_runtime(cluster.address, network=True, streams=streams)
            slices = [pw.slice((DEVICES,), ("x",), island=i) for i in range(3)]
            for label, nbytes, case in plan:
                if case == "P(x)->P(x)":
                    row = Row(label, nbytes, case)
                    sweep.append((streams, row))
                    runtime_times(row, [slices[0], slices[CROSS]], reps)
                    print(f"  {streams} streams: {label} {case}: {row.runtime_gbps:.2f} GB/s", flush=True)
            for s in slices:
                s.release()
    finally:
        for actor in actors:
            ray.kill(actor)
        pw.shutdown()
        ray.shutdown()
        cluster.shutdown()

    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 1e9

    table = Table(["size", "sharding", "runtime (network)", "streamed", "runtime (object store)", "Ray actors",
                   "raw TCP", "same node", "network/object store", "network/raw TCP", "network/Ray"])
    results = []
    for label, nbytes, case in plan:
        net, obj = network[(label, case)], store[(label, case)]
        raw_gbps = gbps(nbytes, median(raw[label])) if label in raw else float("nan")  # the same bytes, same link
        same_gbps = same[(label, case)].runtime_gbps if (label, case) in same else float("nan")
        r1, r2 = ratio(net.runtime_gbps, obj.runtime_gbps), ratio(net.runtime_gbps, raw_gbps)
        table.add(label, case, f"{net.runtime_gbps:.2f} GB/s", f"{net.stream_gbps:.2f} GB/s",
                  f"{obj.runtime_gbps:.2f} GB/s", f"{net.ray_gbps:.2f} GB/s" if net.ray_s else "-",
                  f"{raw_gbps:.2f} GB/s" if raw_gbps == raw_gbps else "-",
                  f"{same_gbps:.2f} GB/s" if same_gbps == same_gbps else "-",
                  ratio_text(r1), ratio_text(r2), ratio_text(ratio(net.runtime_gbps, net.ray_gbps)))
        results.append({"label": label, "case": case, "network": net.to_json(), "object_store": obj.to_json(),
                        "raw_tcp_s": raw.get(label), "raw_tcp_gbps": raw_gbps, "same_node_gbps": same_gbps,
                        "network_over_object_store": r1, "network_over_raw_tcp": r2})
    print()
    print(f"Island 0 (head node) -> island 2 (worker node), {DEVICES} devices each, medians of {reps}; transfer = "
          f"move - the same probe without the move; streamed = back-to-back moves; raw TCP = the same bytes between "
          f"the same two host processes over one plain connection; same node = island 0 -> island 1 (lent shards). "
          f"Load average {load_at_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(table.render())
    print(f"network path carried {carried.get('network', 0) / 2**30:.2f} GiB into island 2 in phase 1; "
          f"fallbacks to the object store: {carried.get('fallbacks', 0)}")
    if sweep:
        sweeps = Table(["connections per peer", "size", "runtime (network)", "streamed"])
        for streams, row in sweep:
            sweeps.add(str(streams), row.label, f"{row.runtime_gbps:.2f} GB/s", f"{row.stream_gbps:.2f} GB/s")
        print(sweeps.render())
    matching = [r for r in results if r["case"] == HEADLINE[1]]  # without 256 MiB: the last size's
    head = next((r for r in matching if r["label"] == HEADLINE[0]), matching[-1])
    out = write_json(args.out, {"benchmark": "transfer_nodes", "reps": reps, "devices_per_slice": DEVICES,
                                "object_store_bytes_per_node": int(args.store_gib * 2**30),
                                "load_average_at_start": load_at_start, "rows": results, "carried": carried,
                                "streams_sweep": [{"streams": n, **row.to_json()} for n, row in sweep]})
    print(f"wrote {out}")
    print(f"cross-node: runtime/object-store {head['network_over_object_store']:.2f}x, runtime/raw-tcp "
          f"{head['network_over_raw_tcp']:.2f}x ({head['label']}, {head['case']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
