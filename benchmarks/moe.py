"""A mixture-of-experts Transformer across islands: throughput, bytes between islands, and expert placement.

Runs, on one two-island cluster, in interleaved blocks so that a noisy machine hurts them alike:

- ``one island``: the MoE model's step as one computation on one island's 2 devices, experts split over them
  and tokens dispatched and combined by all-to-all inside the computation (T1).
- ``two islands``: the same model with half of the experts on each of two islands (one device each, so the
  same 2 devices in all); the step is one ``@pw.program`` whose tokens cross islands host to host (T2).
- ``dense``: a dense model of the same active FLOPs per token (each MoE block one feed-forward block twice an
  expert's width) on the one island's 2 devices.

A block dispatches ``--block`` steps back to back and waits for the last, so the numbers are throughput with
asynchronous dispatch. Then every router is biased towards two experts (``--skew``): the controller watches
the token counts of ``--skew-steps`` steps under GShard's uniform placement and places the experts; then the
same fresh steps run from the same state under each placement, alternated ``--repeats`` times, and it reports
the fraction of routing choices dropped and the bytes the islands' hosts sent each other per step (their own
counters), medians.

    python -m benchmarks.moe --config base --blocks 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import pathways as pw
from benchmarks.common import Table, default_out, rate_text, ratio, write_json
from examples.moe import model
from examples.moe.config import CONFIGS
from examples.moe.placement import Controller, Placement, predicted_drops
from examples.moe.step import AXIS, CrossIslandStep, SingleIslandStep
from examples.moe.train import describe, skewed
from examples.palm import data

MODES = ("one island", "two islands", "dense")


def run_block(step: Any, state: Any, batches: list[dict]) -> tuple[Any, float]:
    """Dispatch the steps back to back, wait for the last one's stats; seconds per step."""
    start = time.perf_counter()
    for batch in batches:
        state, out = step(state, batch)
    for vector in out if isinstance(out, list) else [out]:
        vector.block_until_ready()
    return state, (time.perf_counter() - start) / len(batches)


def bytes_sent() -> int:
    """What every island host has sent other islands' hosts so far (the hosts' own counters)."""
    return sum(h.bytes_out for island in pw.status().islands for h in island.hosts)


def skewed_run(step: CrossIslandStep, state: list, batches: list[dict]) -> tuple[float, float, list]:
    """(dropped fraction, bytes across islands per step, each island's demand per step) of steps run from
    ``state`` one at a time (each step's counts read before the next)."""
    before, dropped, demand = bytes_sent(), [], []
    for batch in batches:
        state, out = step(state, batch)
        stats, per_island = step.read(out)
        dropped.append(stats.dropped)
        demand.append([s.demand for s in per_island])
    return float(np.mean(dropped)), (bytes_sent() - before) / len(batches), demand


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="base", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over the islands")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per mode (interleaved)")
    parser.add_argument("--skew", type=float, default=2.0, help="router bias towards experts 0 (+S) and 1 (+S/2)")
    parser.add_argument("--skew-steps", type=int, default=8, help="steps per placement in the skewed runs")
    parser.add_argument("--repeats", type=int, default=2, help="skewed runs per placement (alternated)")
    parser.add_argument("--json", default=str(default_out("moe")))
    args = parser.parse_args(argv)

    config = CONFIGS[args.config]
    dense_config = config.dense_equivalent()
    tokens = args.batch * config.seq_len
    n_moe = len(config.moe_layers)
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4))
    try:
        wide = pw.slice((2,), (AXIS,), island=0)
        singles = [pw.slice((1,), (AXIS,), island=i) for i in range(2)]
        uniform = Placement.uniform(config.n_experts, 2, config.capacity, n_moe)
        steps = {"one island": SingleIslandStep(config, wide), "two islands": CrossIslandStep(config, singles, uniform),
                 "dense": SingleIslandStep(dense_config, wide)}
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        dense_params = jax.jit(model.init_params, static_argnums=0)(dense_config, jax.random.key(0))
        batches = [data.batch(i, 0, args.batch, config.seq_len) for i in range(args.block)]
        states = {m: steps[m].put_state(dense_params if m == "dense" else params) for m in MODES}
        for mode in MODES:  # compile, and warm every path
            states[mode], _ = run_block(steps[mode], states[mode], batches[:2])
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.blocks):
            for mode in MODES:
                states[mode], per_step = run_block(steps[mode], states[mode], batches)
                times[mode].append(per_step)

        # Placement under a skewed router: the same steps from the same state, uniform and then placed.
        cross = steps["two islands"]
        start = skewed(params, args.skew)
        seen = [data.batch(1000 + i, 0, args.batch, config.seq_len) for i in range(args.skew_steps)]
        fresh = [data.batch(2000 + i, 0, args.batch, config.seq_len) for i in range(args.skew_steps)]
        _, _, demand = skewed_run(cross, cross.put_state(start, uniform), seen)  # what the controller sees
        controller = Controller(uniform, [args.batch // 2] * 2, window=len(demand))
        for d in demand:
            controller.observe(d)
        placed = controller.decide() or uniform
        mean_demand = np.mean(controller.history, axis=0)
        skewed_run(cross, cross.put_state(start, placed), seen[:1])  # compile the placed programs
        measured = {}
        for _ in range(args.repeats):  # alternate the two placements on batches the controller has not seen
            for name, placement in (("uniform", uniform), ("placed", placed)):
                measured.setdefault(name, []).append(skewed_run(cross, cross.put_state(start, placement), fresh))
        drops_uniform, drops_placed = (statistics.median(r[0] for r in measured[n]) for n in ("uniform", "placed"))
        bytes_uniform, bytes_placed = (statistics.median(r[1] for r in measured[n]) for n in ("uniform", "placed"))
    finally:
        pw.shutdown()

    medians = {m: statistics.median(t) for m, t in times.items()}
    rates = {m: tokens / medians[m] for m in MODES}
    table = Table(["mode", "s/step (median)", "tokens/s", "vs one island", "s/step per block"])
    for mode in MODES:
        table.add(mode, f"{medians[mode]:.4f}", rate_text(rates[mode]),
                  f"{ratio(rates[mode], rates['one island']):.2f}", " ".join(f"{t:.4f}" for t in times[mode]))
    r = ratio(rates["two islands"], rates["one island"])
    print(f"MoE {args.config}: {config.n_experts} experts, top-2, capacity factor {config.capacity_factor}, "
          f"{n_moe} MoE layers of {config.n_layers}; global batch {args.batch} x {config.seq_len} tokens; "
          f"{args.blocks} blocks x {args.block} steps per mode, interleaved")
    print(table.render())
    placed_text = describe(placed)
    token_bytes = (uniform.bytes_across([args.batch // 2] * 2, config.d_model),
                   placed.bytes_across([args.batch // 2] * 2, config.d_model))
    print(f"skewed router (+{args.skew} on expert 0, +{args.skew / 2} on expert 1), {args.skew_steps} steps each:")
    print(f"  uniform placement: dropped {100 * drops_uniform:.1f}% of choices, {bytes_uniform / 2**20:.2f} MiB "
          f"across islands per step (tokens {token_bytes[0] / 2**20:.2f} MiB by shape)")
    print(f"  placed ({placed_text} in layer 0): dropped {100 * drops_placed:.1f}%, {bytes_placed / 2**20:.2f} MiB "
          f"per step (tokens {token_bytes[1] / 2**20:.2f} MiB by shape); predicted drops "
          f"{100 * predicted_drops(uniform, mean_demand):.1f}% -> {100 * predicted_drops(placed, mean_demand):.1f}%")
    print(f"moe: cross-island T2/T1 = {r:.2f}, dropped tokens {100 * drops_uniform:.1f}% -> {100 * drops_placed:.1f}% "
          f"with placement, bytes across islands {bytes_uniform / 2**20:.2f} MiB -> {bytes_placed / 2**20:.2f} MiB")
    result = {"config": args.config, "batch": args.batch, "tokens_per_step": tokens, "median_step_s": medians,
              "step_s": times, "tokens_per_s": rates, "t2_over_t1": r, "skew": args.skew,
              "dropped": {"uniform": drops_uniform, "placed": drops_placed},
              "bytes_across_per_step": {"uniform": bytes_uniform, "placed": bytes_placed},
              "token_bytes_by_shape": {"uniform": token_bytes[0], "placed": token_bytes[1]},
              "placement": [[[(s.expert, s.capacity) for s in slots] for slots in layout] for layout in placed.layers]}
    print(f"wrote {write_json(Path(args.json), result)}")
    return result


if __name__ == "__main__":
    main()
