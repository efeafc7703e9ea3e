"""ZeRO over PaLM's two pods: what each stage saves in memory, what it sends, and what it costs in step time.

For stages 0-3 (examples/palm/zero_step.py) on two pods of a (2, 2) slice each:

- peak buffer bytes per pod during one step, with only that stage's state on the pods;
- bytes crossing between the pods in that step (both pods' hosts' ``bytes_out``);
- time per step in blocks of ``--block`` steps dispatched back to back, every stage once per round, the
  stages' order rotating each round so that a noisy machine hurts them alike; the median per stage, and the
  ratio R = stage 0's median / the stage's (R >= 0.97 is the goal for stages 1-2, 0.9 for stage 3);
- then a few blocks per stage under ``pw.trace``: how long each pod's executor waited for receives per step
  (gradients, stage 3's gathers, stage 2-3's norm scalars, stage 1-2's shares). Where the pods share cores, as
  on one machine, a pod's wait is not the step's: the other pod has the cores meanwhile.

    python -m benchmarks.zero --config small --batch 16 --blocks 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import jax

import pathways as pw
from benchmarks.common import RESULTS, default_out, write_json
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.memory import DEVICES_PER_POD, make_step, measure_zero, run_block, zero_report


def recv_wait_ms(path: str, steps: int) -> list[float]:
    """Per island, ms per step its executor spent waiting at receives, from a pw.trace file."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    waits = [0.0, 0.0]
    for e in events:
        island = e.get("pid", 0) - 100
        if 0 <= island < 2 and e.get("ph") == "X" and e.get("cat") == "wait" and e["args"].get("op") == "recv":
            waits[island] += e["dur"] / 1e3 / steps
    return waits


def exposed(config_name: str, batch: int, block: int, traced: int, trace_dir: str) -> dict[int, list[float]]:
    """Each stage's receive waits per island (ms per step), the median of ``traced`` traced blocks."""
    config, opt = CONFIGS[config_name], optim.OptimConfig()
    slices = [pw.slice((2, 2), ("data", "model"), island=p) for p in range(2)]
    try:
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        host_state = (params, optim.init_opt_state(params, opt))
        batches = [data.batch(i, 0, batch, config.seq_len) for i in range(block)]
        steps = {s: make_step(config, opt, slices, s) for s in pw.zero.STAGES}
        states = {s: run_block(steps[s], steps[s].put_state(*host_state), batches[:2])[0] for s in steps}
        waits: dict[int, list[list[float]]] = {s: [] for s in steps}
        for k in range(traced):
            for s in steps:
                path = os.path.join(trace_dir, f"zero{s}_{k}.trace.json")
                with pw.trace(path):
                    states[s], _ = run_block(steps[s], states[s], batches)
                waits[s].append(recv_wait_ms(path, len(batches)))
        del states
    finally:
        for s in slices:
            s.release()
    return {s: [statistics.median(w[i] for w in blocks) for i in (0, 1)] for s, blocks in waits.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows), split over the pods")
    parser.add_argument("--block", type=int, default=4, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks per stage (rounds)")
    parser.add_argument("--traced-blocks", type=int, default=3, help="blocks per stage run under pw.trace")
    parser.add_argument("--json", default=str(default_out("zero")))
    parser.add_argument("--trace-dir", default=str(RESULTS / "zero_traces"), help="where the trace files go")
    args = parser.parse_args(argv)
    os.makedirs(args.trace_dir, exist_ok=True)
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=DEVICES_PER_POD))
    try:
        result = measure_zero(args.config, args.batch, args.blocks, args.block)
        waits = exposed(args.config, args.batch, args.block, args.traced_blocks, args.trace_dir)
    finally:
        pw.shutdown()
    result["recv_wait_ms"] = waits
    print(zero_report(result))
    print(f"wrote {write_json(Path(args.json), result)}")
    return result


if __name__ == "__main__":
    main()
