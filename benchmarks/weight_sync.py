"""Weight sync for RL: a PaLM parameter tree resharded island to island by ``pw.WeightSync``, against memcpy and TCP.

The planned sync runs next to a memcpy of the same bytes (one node) and raw TCP between the two hosts (two Ray
nodes).

Setup. The trainer holds PaLM's parameters (``examples/palm/model.py``'s ``init_params``) on a (2, 2) slice
``("data", "model")`` in the trainer's layout (``param_specs``: kernels sharded over both axes); the sampler
is a (1, 4) slice of another island in the sampler's layout (``param_specs(data_axis=None)``: replicated over
data, sharded over model), so every kernel is resharded. Configs: ``small`` (PaLM-small, the CPU demo: 34
leaves, 8.75 MB), ``medium`` (d_model 1024, 4 layers: 34 leaves, 237 MB) and ``medium-stacked`` (the same
parameters with the layers stacked, as a model that scans its layers holds them: 10 leaves, the same copies
over the same runs in fewer transfers).

Method. A repetition dispatches one sync and waits until every leaf is on the sampler (all waits sent at
once): seconds from dispatch to the last leaf, nothing subtracted, so the fixed cost of a program on two
islands (about 1.5-2 ms here) counts. *Streamed* dispatches ``--stream`` syncs back to back (a training loop
syncing every step) and takes the time per sync. Alternating with it, in the same repetition:

- one node (islands 0 and 1): ``np.copyto`` of the same bytes into a preallocated buffer (``measure_memcpy``),
  and ``per leaf``, the same tree moved by ``pw.transfer`` leaf by leaf in one program (what the sync's
  buckets replace);
- two Ray nodes on this machine (``benchmarks.transfer_nodes``' cluster; trainer island 0 on the head node,
  sampler island 2 on the worker): the same bytes over one plain TCP connection between the two hosts'
  processes (``measure_raw_tcp``).

The RL benchmark measures the same baselines in its own run with ``measure_memcpy(nbytes)`` and
``measure_raw_tcp(src, dst, nbytes)`` (below), and times a sync with ``time_sync``.

    python -m benchmarks.weight_sync [--configs small medium medium-stacked] [--reps N] [--stream N] [--no-nodes]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # Before Ray loads (as benchmarks.transfer_nodes): the two-node cluster's files in a private temp dir.
    os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pwbench-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, median, ratio, ratio_text, timed, write_json  # noqa: E402

TIMEOUT_S = 120.0
MEDIUM = {"d_model": 1024, "n_layers": 4, "n_heads": 16, "head_dim": 64, "ffn_dim": 4096, "seq_len": 128}
CONFIG_NAMES = ("small", "medium", "medium-stacked")  # the trees palm_tree builds
TARGET_MEMCPY, TARGET_TCP = 0.8, 0.7
TRAINER_MESH, SAMPLER_MESH = (2, 2), (1, 4)  # FSDP x model parallel for training; model parallel over 4 to sample


def measure_memcpy(nbytes: int, reps: int = 5) -> float:
    """Median seconds of ``np.copyto`` of ``nbytes`` into a preallocated buffer (pages already mapped, one core)."""
    src = np.ones(max(1, nbytes // 4), np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return median([timed(lambda: np.copyto(dst, src)) for _ in range(reps)])


def measure_raw_tcp(src: tuple[int, int], dst: tuple[int, int], nbytes: int, reps: int = 5,
                    credential: str | None = None) -> float:
    """Median seconds for ``nbytes`` sent from host ``src`` (island, host) to host ``dst`` over one plain TCP
    connection of the runtime's data path (landed there and acknowledged). The two hosts must be on different
    Ray nodes; ``credential``: the admin credential (default: the one this session holds)."""
    admin = pw.admin(credential)
    admin.probe_network(src, dst, nbytes)  # warm: the landing buffer there
    return median([admin.probe_network(src, dst, nbytes) for _ in range(reps)])


def first_use(slice_: pw.VirtualSlice, name: str = "first_use") -> Any:
    """A computation on ``slice_`` that reads one element of every leaf of a tree (the sampler's first use of the
    synced weights): microseconds of work, but it runs only once every leaf has landed."""
    import jax.numpy as jnp

    def corners(tree: Any) -> jax.Array:
        return sum(x[(0,) * x.ndim].astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree))

    return pw.jit(corners, slice=slice_, out_specs=jax.sharding.PartitionSpec(), name=name)


def time_sync(sync: Callable[[Any], Any], params: Any, reps: int = 5, stream: int = 1,
              slice_: pw.VirtualSlice | None = None,
              also: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Seconds per sync of ``params`` by ``sync`` (a ``pw.WeightSync``, or any function of the tree run inside a
    program), timed from dispatch until a first use of every synced leaf has run on the destination
    (``first_use``), ``reps`` times; with ``stream`` > 1 that many syncs back to back per repetition, divided by
    ``stream``. Also returns the same first use alone on an already synced tree, ``reps`` times (the fixed cost of
    a program and its wait; subtract its median for the sync's own time). ``also`` runs in every repetition (a
    baseline measured alongside, so a burst of load on a shared machine hits both)."""
    probe = first_use(slice_ or sync.slice)
    move = pw.program(lambda p: probe(sync(p)))
    stay = pw.program(lambda q: probe(q))
    synced = pw.program(sync)(params)
    move(params).block_until_ready(timeout=TIMEOUT_S)  # planned and compiled before timing
    stay(synced).block_until_ready(timeout=TIMEOUT_S)
    moves, stays = [], []
    for _ in range(reps):
        start = time.perf_counter()
        outs = [move(params) for _ in range(stream)]
        for out in outs:
            out.block_until_ready(timeout=TIMEOUT_S)
        moves.append((time.perf_counter() - start) / stream)
        stays.append(timed(lambda: stay(synced).block_until_ready(timeout=TIMEOUT_S)))
        if also is not None:
            also()
    return moves, stays


def palm_tree(config_name: str, trainer: pw.VirtualSlice) -> tuple[Any, Any, int]:
    """PaLM's parameters on ``trainer`` in the trainer's layout, the sampler's specs, and the tree's bytes.

    ``medium-stacked`` is ``medium`` with each layer kernel stacked over the layers on a new leading axis, as a
    model that scans its layers holds them: the same bytes, each element in the same place of its layer's shards,
    so the same copies over the same runs, in 8 transfers instead of 23."""
    from examples.palm import model
    from examples.palm.config import CONFIGS, PalmConfig

    config = CONFIGS["small"] if config_name == "small" else PalmConfig(**MEDIUM)
    host = jax.tree_util.tree_map(np.asarray, model.init_params(config, jax.random.key(0)))
    specs, sampler_specs = model.param_specs(host), model.param_specs(host, data_axis=None)
    if config_name.endswith("-stacked"):
        host, specs, sampler_specs = (_stack_layers(tree) for tree in (host, specs, sampler_specs))
    params = pw.put(host, trainer, specs)
    nbytes = sum(v.nbytes for v in jax.tree_util.tree_leaves(host))
    return params, sampler_specs, nbytes


def _stack_layers(tree: dict) -> dict:
    """PaLM's params (or their specs) with the per-layer leaves stacked on a new leading axis (unsharded)."""
    layers = tree["layers"]
    first = layers[0]
    stacked = {k: P(None, *first[k]) if isinstance(first[k], P) else np.stack([layer[k] for layer in layers])
               for k in first}
    return {**tree, "layers": stacked}


def check_bits(synced: Any, params: Any) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(synced), jax.tree_util.tree_leaves(params)):
        if np.asarray(a.fetch(timeout=TIMEOUT_S)).tobytes() != np.asarray(b.fetch(timeout=TIMEOUT_S)).tobytes():
            raise AssertionError("a synced leaf differs from the trainer's")


def one_node(configs: Sequence[str], reps: int, stream: int) -> list[dict]:
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
            timeouts=pw.Timeouts(fetch=TIMEOUT_S, op=TIMEOUT_S, start=300.0))
    rows = []
    try:
        trainer = pw.slice(TRAINER_MESH, ("data", "model"), island=0)
        sampler = pw.slice(SAMPLER_MESH, ("data", "model"), island=1)
        for name in configs:
            params, specs, nbytes = palm_tree(name, trainer)
            sync = pw.WeightSync(sampler, specs)
            leaves, treedef = jax.tree_util.tree_flatten(params)
            targets = treedef.flatten_up_to(specs)

            def each(p: Any, ss: tuple = tuple(targets)) -> Any:  # pw.transfer leaf by leaf, in the program
                return [pw.transfer(v, sampler, s) for v, s in zip(jax.tree_util.tree_leaves(p), ss)]

            check_bits(sync(params), params)
            row = {"config": name, "bytes": nbytes, "leaves": len(leaves), "plan": sync.plan.describe(),
                   "sync_s": [], "probe_s": [], "streamed_s": [], "per_leaf_s": [], "memcpy_s": []}
            row["sync_s"], row["probe_s"] = time_sync(
                sync, params, reps, also=lambda r=row, n=nbytes: r["memcpy_s"].append(measure_memcpy(n, 3)))
            row["per_leaf_s"] = time_sync(each, params, reps, slice_=sampler)[0]
            row["streamed_s"] = time_sync(sync, params, reps, stream)[0]
            row["plans_made"] = sync.plans_made
            rows.append(row)
            print(f"  one node, {name}: {nbytes / 1e6:.1f} MB, {len(leaves)} leaves; {sync.plan.describe()}",
                  flush=True)
            del params, leaves
        trainer.release()
        sampler.release()
    finally:
        pw.shutdown()
    return rows


def two_nodes(configs: Sequence[str], reps: int, stream: int) -> list[dict]:
    import ray

    from benchmarks import transfer_nodes as tn

    cluster = tn.start_cluster(int(1.5 * 2**30))
    rows = []
    try:
        tn.start_runtime(cluster.address, network=True)
        tn.check_nodes(cluster)
        trainer = pw.slice(TRAINER_MESH, ("data", "model"), island=0)
        sampler = pw.slice(SAMPLER_MESH, ("data", "model"), island=tn.CROSS)
        credential = tn.RUNTIME["admin_credential"]
        for name in configs:
            params, specs, nbytes = palm_tree(name, trainer)
            sync = pw.WeightSync(sampler, specs)
            check_bits(sync(params), params)
            row = {"config": name, "bytes": nbytes, "sync_s": [], "probe_s": [], "streamed_s": [], "raw_tcp_s": []}
            measure_raw_tcp((0, 0), (tn.CROSS, 0), nbytes, 1, credential)
            row["sync_s"], row["probe_s"] = time_sync(sync, params, reps, also=lambda r=row, n=nbytes: r[
                "raw_tcp_s"].append(measure_raw_tcp((0, 0), (tn.CROSS, 0), n, 1, credential)))
            row["streamed_s"] = time_sync(sync, params, reps, stream)[0]
            row["fallbacks"] = tn.host_stats(0)["net_fallbacks"]
            rows.append(row)
            print(f"  two nodes, {name}: done", flush=True)
        trainer.release()
        sampler.release()
        tn.stop_runtime()
    finally:
        pw.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["small", "medium"], choices=CONFIG_NAMES)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--stream", type=int, default=4, help="syncs back to back in a streamed repetition")
    parser.add_argument("--no-nodes", action="store_true", help="skip the two-node phase")
    parser.add_argument("--out", type=Path, default=default_out("weight_sync"), help="JSON output path")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    local = one_node(args.configs, args.reps, args.stream)
    remote = [] if args.no_nodes else two_nodes(args.configs, args.reps, args.stream)

    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 1e9

    table = Table(["config", "bytes", "where", "sync", "first use alone", "sync GB/s", "streamed GB/s", "baseline",
                   "baseline GB/s", "sync/baseline", "streamed/baseline", "net/baseline", "per leaf GB/s"])
    for r in local + remote:
        base_s = r["memcpy_s"] if "memcpy_s" in r else r["raw_tcp_s"]
        sync_s, probe_s = median(r["sync_s"]), median(r["probe_s"])
        sync, base = gbps(r["bytes"], sync_s), gbps(r["bytes"], median(base_s))
        streamed, net = gbps(r["bytes"], median(r["streamed_s"])), gbps(r["bytes"], max(sync_s - probe_s, 1e-9))
        r.update(sync_gbps=sync, streamed_gbps=streamed, net_gbps=net, baseline_gbps=base,
                 ratio=ratio(sync, base), ratio_streamed=ratio(streamed, base), ratio_net=ratio(net, base))
        per_leaf = f"{gbps(r['bytes'], median(r['per_leaf_s'])):.2f}" if "per_leaf_s" in r else "-"
        table.add(r["config"], f"{r['bytes'] / 1e6:.1f} MB", "one node" if "memcpy_s" in r else "two nodes",
                  f"{sync_s * 1e3:.2f} ms", f"{probe_s * 1e3:.2f} ms", f"{sync:.2f}", f"{streamed:.2f}",
                  "memcpy" if "memcpy_s" in r else "raw TCP", f"{base:.2f}", ratio_text(r["ratio"]),
                  ratio_text(r["ratio_streamed"]), ratio_text(r["ratio_net"]), per_leaf)
    print()
    print(f"PaLM params, trainer {TRAINER_MESH} (data, model) -> sampler {SAMPLER_MESH} (data, model) on another "
          f"island, resharded; medians of {args.reps}; sync = dispatch until a first use of every leaf ran on the "
          f"sampler; first use alone = that program without the sync (its fixed cost); net = sync less it; streamed "
          f"= {args.stream} syncs back to back; per leaf = pw.transfer leaf by leaf in one program. Load average "
          f"{load_at_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(table.render())
    for r in local + remote:
        name, target = ("R1", TARGET_MEMCPY) if "memcpy_s" in r else ("R2", TARGET_TCP)
        best = max(r["ratio"], r["ratio_streamed"])
        print(f"  {name} {r['config']}: sync {r['ratio']:.2f}x, streamed {r['ratio_streamed']:.2f}x, net "
              f"{r['ratio_net']:.2f}x of {'memcpy' if name == 'R1' else 'raw TCP'}; target {target}x: "
              f"{'MET' if best >= target else 'NOT met'}")
    out = write_json(args.out, {"benchmark": "weight_sync", "reps": args.reps, "stream": args.stream,
                                "load_average_at_start": load_at_start, "one_node": local, "two_nodes": remote})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
