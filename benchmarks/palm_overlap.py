"""Does sending each layer group's gradients as soon as they exist shorten PaLM's two-pod step?

Runs four programs on the same two pods, in interleaved blocks so that a noisy
machine hurts them alike, and reports the median time per step of each:

- ``local``: each pod applies only its own gradients (no exchange; pods diverge): the floor.
- ``after``: the exchange follows the whole backward pass, as PaLM ran it.
- ``overlap``: the default step: the runtime sends each piece right after the stage that produced it,
  and the receives wait where the optimizer reads them.
- ``explicit``: each stage's pieces get a ``pw.transfer`` right after the stage (receives placed there too).

A block dispatches ``--block`` steps back to back and waits for the last, so
the numbers are per-step throughput with asynchronous dispatch. Then a few
blocks per mode run under ``pw.trace``; from the hosts' events it reports how
long each pod's executor waited for receives (the exchange left exposed) and
how long the sender threads were busy. It also times one direction of the
exchange alone (every gradient piece, pod 0 to pod 1).

    python -m benchmarks.palm_overlap --config small --batch 16 --blocks 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw
from benchmarks.common import RESULTS, Table, default_out, ratio, ratio_text, write_json
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.step import PodState, TrainStep

MODES = ("local", "after", "overlap", "explicit")


class LocalStep(TrainStep):
    """The same backward on every pod, but each pod applies only its own gradients: no exchange at all."""

    def _step(self, params: list, opt_state: list, batch: list) -> tuple:
        metrics, grads = self._all_grads(params, batch)
        outs = [self.fns.apply[1](params[p], opt_state[p], grads[p]) for p in range(self.pods)]
        return [o[0] for o in outs], [o[1] for o in outs], metrics, [o[2] for o in outs]


class ExplicitStep(TrainStep):
    """The pods' backward passes advance stage by stage, and each stage's pieces get a pw.transfer at once.

    That places each receive right after the stage too, so a pod waits for the other pod's piece of a
    stage before it starts its next one.
    """

    def _all_grads(self, params: list, batch: list) -> tuple[list, list]:
        pieces: list[dict] = [{} for _ in range(self.pods)]
        for stage in zip(*[self._backward(params[p], batch[p]) for p in range(self.pods)]):
            for p, (key, piece) in enumerate(stage):
                pieces[p][key] = piece
                for q, s in enumerate(self.slices):
                    if q != p:
                        pw.transfer(piece[1] if key == "head" else piece, s)
        metrics, grads = zip(*[self._assemble(p) for p in pieces])
        return list(metrics), list(grads)


def run_block(step: TrainStep, state: PodState, batches: list[dict]) -> tuple[PodState, float]:
    """Dispatch the steps back to back, then wait for every pod's last update; seconds per step."""
    start = time.perf_counter()
    for batch in batches:
        state, _, norms = step(state, batch)
    for norm in norms:
        norm.block_until_ready()
    return state, (time.perf_counter() - start) / len(batches)


def exchange_alone(step: TrainStep, repeats: int) -> float:
    """Median seconds to move one pod's gradient pieces (as packed buffers) from pod 0 to pod 1."""
    config = step.config
    sizes = [config.n_embed_params() + config.d_model, config.n_embed_params()]
    sizes += [(stop - start) * config.params_per_layer() for start, stop in config.group_bounds()]
    pieces = [pw.put(np.zeros(n, np.float32), step.slices[0]) for n in sizes]
    total = pw.jit(lambda xs: sum(jnp.sum(x) for x in xs), slice=step.slices[1], name="touch_all")
    move = pw.program(lambda xs: total(pw.transfer(xs, step.slices[1])))
    move(pieces).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        move(pieces).block_until_ready()
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
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks per mode (interleaved)")
    parser.add_argument("--json", default=str(default_out("palm_overlap")))
    parser.add_argument("--trace-dir", default=str(RESULTS / "palm_overlap_traces"),
                        help="where the pw.trace files of the traced blocks go")
    parser.add_argument("--traced-blocks", type=int, default=3, help="blocks per mode run under pw.trace")
    args = parser.parse_args(argv)

    os.makedirs(args.trace_dir, exist_ok=True)
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
                 "explicit": ExplicitStep(config, optim_config, slices, overlap=True)}
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
        traced: dict[str, list[dict]] = {m: [] for m in MODES[1:]}
        for k in range(args.traced_blocks):
            for mode in MODES[1:]:
                path = os.path.join(args.trace_dir, f"palm_{mode}_{k}.trace.json")
                states[mode], stats = exposed_exchange(steps[mode], states[mode], batches, path)
                traced[mode].append(stats)
        alone = exchange_alone(steps["after"], repeats=5)
    finally:
        pw.shutdown()

    medians = {m: statistics.median(t) for m, t in times.items()}
    exposed = {mode: {island: {kind: statistics.median(b.get(island, {}).get(kind, 0.0) for b in blocks)
                               for kind in ("recv_wait_ms", "send_ms")}
                      for island in ("island 0", "island 1")}
               for mode, blocks in traced.items()}
    grad_bytes = 4 * config.n_params()
    table = Table(["mode", "s/step (median)", "vs local", "recv wait ms/step", "send ms/step", "s/step per block"])
    for mode in MODES:
        stats = [exposed.get(mode, {}).get(f"island {i}", {}) for i in (0, 1)]
        table.add(mode, f"{medians[mode]:.3f}", ratio_text(ratio(medians[mode], medians["local"])),
                  "/".join(f"{st.get('recv_wait_ms', 0):.0f}" for st in stats),
                  "/".join(f"{st.get('send_ms', 0):.0f}" for st in stats),
                  " ".join(f"{t:.3f}" for t in times[mode]))
    saved = medians["after"] - medians["overlap"]
    print(f"PaLM two-pod step, config {args.config} ({config.layer_groups} layer groups), global batch "
          f"{args.batch}, {args.blocks} blocks x {args.block} steps per mode, interleaved")
    print(f"gradients per pod: {grad_bytes / 2**20:.2f} MiB in {config.layer_groups + 2} packed pieces; "
          f"moving them one way alone: {alone * 1e3:.1f} ms")
    print(table.render())
    print(f"recv wait, send: island 0/island 1, medians of {args.traced_blocks} traced blocks per mode")
    print(f"overlap saves {saved * 1e3:.1f} ms/step ({100 * saved / medians['after']:.1f}% of 'after')")
    result = {"config": args.config, "layer_groups": config.layer_groups, "batch": args.batch,
              "grad_bytes": grad_bytes, "exchange_one_way_s": alone, "median_step_s": medians, "step_s": times,
              "exposed_exchange": exposed}
    print(f"wrote {write_json(Path(args.json), result)}")
    return result


if __name__ == "__main__":
    main()
