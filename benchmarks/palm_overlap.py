"""Does sending each layer group's gradients as soon as they exist shorten PaLM's two-pod step?

Runs three programs on the same two pods, in interleaved blocks so that a noisy
machine hurts them alike, and reports the median time per step of each:

- ``local``: each pod applies only its own gradients (no exchange; pods diverge): the floor.
- ``after``: the exchange follows the whole backward pass, as PaLM ran it.
- ``overlap``: each piece is sent (``pw.transfer``) as soon as the backward produced it.
- ``late``: no ``pw.transfer`` at all; the transfers are traced where the optimizer reads them.

A block dispatches ``--block`` steps back to back and waits for the last, so
the numbers are per-step throughput with asynchronous dispatch. It also times
one direction of the exchange alone (every gradient piece, pod 0 to pod 1).

    python -m benchmarks.palm_overlap --config small --batch 16 --blocks 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import pathways as pw
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.step import PodState, TrainStep

MODES = ("local", "after", "overlap", "late")


class LocalStep(TrainStep):
    """The same backward on every pod, but each pod applies only its own gradients: no exchange at all."""

    def _step(self, params: list, opt_state: list, batch: list) -> tuple:
        pods = range(self.pods)
        staged = [dict(self._backward(params[p], batch[p])) for p in pods]
        outs = []
        for p in pods:
            grads = {"head": staged[p]["head"][1], "lookup": staged[p]["lookup"],
                     "groups": [staged[p][g] for g in range(self.config.layer_groups)]}
            outs.append(self.fns.apply[1](params[p], opt_state[p], grads))
        return [o[0] for o in outs], [o[1] for o in outs], [s["head"][0] for s in staged], [o[2] for o in outs]


class LateStep(TrainStep):
    """No pw.transfer during the backward: the transfers are traced where the optimizer reads them."""

    def _send(self, pod: int, tree: Any) -> None:
        return None


def run_block(step: TrainStep, state: PodState, batches: list[dict]) -> tuple[PodState, float]:
    """Dispatch the steps back to back, then wait for every pod's last update; seconds per step."""
    start = time.perf_counter()
    for batch in batches:
        state, _, norms = step(state, batch)
    for norm in norms:
        norm.block_until_ready()
    return state, (time.perf_counter() - start) / len(batches)


def exchange_alone(step: TrainStep, state: PodState, repeats: int) -> float:
    """Median seconds to move one pod's worth of gradient-shaped arrays (the params) from pod 0 to pod 1."""
    total = pw.jit(lambda tree: sum(jnp.sum(x) for x in jax.tree.leaves(tree)), slice=step.slices[1],
                   in_specs=(step.fns.param_specs,), name="touch_all")
    move = pw.program(lambda tree: total(pw.transfer(tree, step.slices[1])))
    move(state.params[0]).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        move(state.params[0]).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exposed_exchange(step: TrainStep, state: PodState, batches: list[dict], path: str) -> tuple[PodState, dict]:
    """Run a block under pw.trace; per island, ms per step spent waiting for receives, and spent sending."""
    with pw.trace(path):
        state, _ = run_block(step, state, batches)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out: dict[str, dict[str, float]] = {}
    for e in events:
        island = e.get("pid", 0) - 100
        if island < 0 or e.get("ph") != "X":
            continue
        kind = ("recv_wait_ms" if e["cat"] == "wait" and e["args"].get("op") == "recv"
                else "send_ms" if e["cat"] == "send" and e["name"] == "send shards" else None)
        if kind:
            per_island = out.setdefault(f"island {island}", {"recv_wait_ms": 0.0, "send_ms": 0.0})
            per_island[kind] += e["dur"] / 1e3 / len(batches)
    return state, out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--layer-groups", type=int, default=None, help="override the config's layer groups")
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows), split over the pods")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per mode (interleaved)")
    parser.add_argument("--json", default="palm_overlap.json")
    parser.add_argument("--trace-dir", default=".", help="where the pw.trace files of one block per mode go")
    args = parser.parse_args(argv)

    config = CONFIGS[args.config]
    if args.layer_groups:
        config = dataclasses.replace(config, layer_groups=args.layer_groups)
    optim_config = optim.OptimConfig()
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4))
    try:
        slices = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
        steps = {"local": LocalStep(config, optim_config, slices),
                 "after": TrainStep(config, optim_config, slices, overlap=False),
                 "overlap": TrainStep(config, optim_config, slices, overlap=True),
                 "late": LateStep(config, optim_config, slices, overlap=True)}
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        host_state = (params, optim.init_opt_state(params, optim_config))
        batches = [data.batch(i, 0, args.batch, config.seq_len) for i in range(args.block)]
        states = {}
        for mode, step in steps.items():  # compile, and warm every path
            states[mode], _ = run_block(step, step.put_state(*host_state), batches[:2])
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.blocks):
            for mode in MODES:
                states[mode], per_step = run_block(steps[mode], states[mode], batches)
                times[mode].append(per_step)
        exposed = {}
        for mode in MODES[1:]:
            path = os.path.join(args.trace_dir, f"palm_{mode}.trace.json")
            states[mode], exposed[mode] = exposed_exchange(steps[mode], states[mode], batches, path)
        alone = exchange_alone(steps["after"], states["after"], repeats=5)
    finally:
        pw.shutdown()

    medians = {m: statistics.median(t) for m, t in times.items()}
    grad_bytes = 4 * config.n_params()
    result = {"config": args.config, "layer_groups": config.layer_groups, "batch": args.batch,
              "grad_bytes": grad_bytes, "exchange_one_way_s": alone, "median_step_s": medians, "step_s": times,
              "exposed_exchange": exposed}
    print(f"PaLM two-pod step, config {args.config} ({config.layer_groups} layer groups), global batch "
          f"{args.batch}, {args.blocks} blocks x {args.block} steps per mode")
    print(f"gradients per pod: {grad_bytes / 2**20:.2f} MiB; one direction alone: {alone * 1e3:.1f} ms")
    print(f"{'mode':<9}{'median s/step':>14}{'vs local':>9}{'recv wait ms/step':>19}{'send ms/step':>14}"
          "   s/step of every block")
    for mode in MODES:
        ratio = medians[mode] / medians["local"]
        stats = [exposed.get(mode, {}).get(f"island {i}", {}) for i in (0, 1)]
        waits = "/".join(f"{st.get('recv_wait_ms', 0):.0f}" for st in stats)
        sends = "/".join(f"{st.get('send_ms', 0):.0f}" for st in stats)
        blocks = " ".join(f"{t:.3f}" for t in times[mode])
        print(f"{mode:<9}{medians[mode]:>14.3f}{ratio:>9.3f}{waits:>19}{sends:>14}   {blocks}")
    print("(recv wait and send: island 0/island 1, from one traced block per mode)")
    saved = medians["after"] - medians["overlap"]
    print(f"overlap saves {saved * 1e3:.1f} ms/step ({100 * saved / medians['after']:.1f}% of 'after')")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
