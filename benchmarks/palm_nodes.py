"""PaLM's two-pod step with its pods on two Ray nodes against both pods on one node: tokens/s, same config.

Setup. A Ray cluster of two nodes on this machine (``benchmarks.nodes``) and one runtime of four
single-host islands of 4 CPU devices, pinned by node labels: islands 0, 1 and 2 on the head node, island 3 on
the worker. ``one node``: the pods are islands 0 and 1 (gradients cross between hosts of one node: lent
shards, ``resource_manager/direct.py``). ``two nodes``: the pods are islands 2 and 3 (gradients cross the
nodes over the network data path, ``resource_manager/network``). Both run the default step
(``TrainStep(overlap=True)``: each layer group's gradients leave as soon as its backward is done), from the
same parameters, on the same batches.

Method, as ``benchmarks/palm_overlap.py``: a block dispatches ``--block`` steps back to back and waits for
the last; blocks of the two placements alternate so a noisy machine hurts both alike; medians per step.
tokens/s = global batch x sequence length / seconds per step. One block per placement then runs under
``pw.trace``: how long each pod waited for the other's gradients (the exchange left exposed), and how long its
sender threads were busy (the exchange that ran under the backward).

    python -m benchmarks.palm_nodes [--config small] [--batch 16] [--block 5] [--blocks 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # before Ray loads: a private temp dir, and token auth on every node (as `ray start`)
    os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pwbench-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import jax  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import RESULTS, Table, default_out, ratio, ratio_text, write_json  # noqa: E402
from benchmarks.palm_overlap import exposed_exchange, run_block  # noqa: E402
from examples.palm import data, model, optim  # noqa: E402
from examples.palm.config import CONFIGS  # noqa: E402
from examples.palm.step import TrainStep  # noqa: E402
from pathways.names import RAY_SYSTEM_CONFIG  # noqa: E402

LABEL = "pathways-bench/node"
PLACEMENTS = {"one node": (0, 1), "two nodes": (2, 3)}
GOAL = 0.9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows), split over the pods")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per placement (interleaved)")
    parser.add_argument("--json", default=str(default_out("palm_nodes")))
    parser.add_argument("--trace-dir", default=str(RESULTS / "palm_nodes_traces"))
    args = parser.parse_args(argv)
    os.makedirs(args.trace_dir, exist_ok=True)
    config = CONFIGS[args.config]
    load_at_start = os.getloadavg()

    from benchmarks.nodes import TwoNodes

    start = time.perf_counter()
    cluster = TwoNodes(label_key=LABEL, system_config=RAY_SYSTEM_CONFIG)
    topology = pw.Topology(4, 1, 4, node_labels={0: {LABEL: "head"}, 1: {LABEL: "head"}, 2: {LABEL: "head"},
                                                 3: {LABEL: "worker"}})
    try:
        import ray

        from pathways.names import NAMESPACE
        from resource_manager.launch import start_with_credentials

        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
        timeouts = {"fetch": 300.0, "op": 300.0, "start": 300.0}
        runtime = start_with_credentials(topology.to_wire(), timeouts)
        pw.init(address=runtime["address"], tenant=runtime["tenant"], credential=runtime["credential"],
                timeouts=pw.Timeouts(**timeouts))
        nodes = [h.node for isl in pw.status().islands for h in isl.hosts]
        head = cluster.head
        if nodes != [head, head, head, cluster.worker]:
            raise RuntimeError(f"islands are on nodes {nodes}; expected three on the head and one on the worker")
        print(f"two-node cluster and runtime up in {time.perf_counter() - start:.1f}s", flush=True)
        optim_config = optim.OptimConfig()
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        host_state = (params, optim.init_opt_state(params, optim_config))
        batches = [data.batch(i, 0, args.batch, config.seq_len) for i in range(args.block)]
        steps, states = {}, {}
        for name, islands in PLACEMENTS.items():
            pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in islands]
            steps[name] = TrainStep(config, optim_config, pods, overlap=True)
            states[name], _ = run_block(steps[name], steps[name].put_state(*host_state), batches[:2])  # compile
        times: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
        for _ in range(args.blocks):
            for name in PLACEMENTS:
                states[name], per_step = run_block(steps[name], states[name], batches)
                times[name].append(per_step)
        exposed = {}
        for name in PLACEMENTS:
            path = os.path.join(args.trace_dir, f"palm_{name.replace(' ', '_')}.trace.json")
            states[name], exposed[name] = exposed_exchange(steps[name], states[name], batches, path)
        from client.session import current

        sent = {name: [current().host_stats(i).get("net_bytes_out", 0) for i in islands]
                for name, islands in PLACEMENTS.items()}
    finally:
        pw.shutdown()
        import ray

        ray.shutdown()
        cluster.shutdown()

    tokens = args.batch * config.seq_len
    medians = {name: statistics.median(t) for name, t in times.items()}
    table = Table(["placement", "pods on islands", "s/step (median)", "tokens/s", "vs one node",
                   "recv wait ms/step", "send ms/step", "bytes over the network", "s/step per block"])
    for name, islands in PLACEMENTS.items():
        stats = [exposed[name].get(f"island {i}", {}) for i in islands]
        table.add(name, "/".join(map(str, islands)), f"{medians[name]:.3f}", f"{tokens / medians[name]:.0f}",
                  ratio_text(ratio(medians["one node"], medians[name])),
                  "/".join(f"{s.get('recv_wait_ms', 0):.0f}" for s in stats),
                  "/".join(f"{s.get('send_ms', 0):.0f}" for s in stats),
                  f"{sum(sent[name]) / 2**20:.0f} MiB", " ".join(f"{t:.3f}" for t in times[name]))
    two_over_one = ratio(medians["one node"], medians["two nodes"])
    print(f"PaLM two-pod step, config {args.config}, global batch {args.batch} x {config.seq_len} tokens, "
          f"{args.blocks} blocks x {args.block} steps per placement, interleaved; gradients per pod "
          f"{4 * config.n_params() / 2**20:.2f} MiB; load average {load_at_start[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(table.render())
    print(f"pods on two nodes / one node: {two_over_one:.2f}x tokens/s (goal >= {GOAL})")
    result = {"config": args.config, "batch": args.batch, "block": args.block, "blocks": args.blocks,
              "step_s": times, "median_step_s": medians, "tokens_per_s": {n: tokens / m for n, m in medians.items()},
              "two_nodes_over_one": two_over_one, "exposed_exchange": exposed, "network_bytes_out": sent,
              "load_average_at_start": load_at_start}
    print(f"wrote {write_json(Path(args.json), result)}")
    return result


if __name__ == "__main__":
    main()
