"""Peak buffer bytes on each pod during one PaLM training step: with and without donation, and by ZeRO stage.

    python -m examples.palm.memory --config small --pods 2

Without donation, the update writes new parameters and optimizer state beside
the old ones, so a pod holds two copies of them at the end of a step. With
donation (the default in ``TrainStep``), the update takes the old buffers, so
the peak drops by about one copy of the parameters and optimizer state. Each
host's buffer table counts the bytes it holds; the peak is read after one
step that starts from a settled table (``session.usage(island, reset_peak=True)``,
then ``session.usage(island)["peak_buffer_bytes"]``).

On two pods it then measures ZeRO stages 0-3 (examples/palm/zero_step.py), one
stage's state on the pods at a time: the peak per pod, the bytes both pods sent
to each other in that step (the hosts' ``bytes_out`` counters), and the time per
step against stage 0 in alternating blocks (``benchmarks.zero`` runs more).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

import pathways as pw
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.step import PodState, TrainStep
from examples.palm.zero_step import ZeroTrainStep

DEVICES_PER_POD = 4


def _settled(session: object, islands: list[int]) -> list[int]:
    """Buffer bytes per pod once the frees of dropped handles have landed (two equal readings in a row)."""
    last = None
    for _ in range(50):
        session.frees.flush()
        time.sleep(0.2)
        now = [session.usage(i)["buffer_bytes"] for i in islands]
        if now == last:
            return now
        last = now
    return last


def measure(config_name: str, pods: int, batch: int, donate: bool, warmup: int = 2) -> dict:
    """Peak bytes per pod in one step after ``warmup`` steps (which compile), and the state's bytes."""
    session = pw.init()
    config, opt = CONFIGS[config_name], optim.OptimConfig()
    slices = [pw.slice((2, 2), ("data", "model"), island=p) for p in range(pods)]
    try:
        step = TrainStep(config, opt, slices, donate=donate)
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        opt_state = optim.init_opt_state(params, opt)
        state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves((params, opt_state)))
        state = step.put_state(params, opt_state)
        for i in range(warmup):
            state, _, norms = step(state, data.batch(i, 0, batch, config.seq_len))
            for n in norms:
                n.block_until_ready()
        islands = [s.island for s in slices]
        batch_arrays = data.batch(warmup, 0, batch, config.seq_len)
        base = _settled(session, islands)
        for i in islands:
            session.usage(i, reset_peak=True)
        state, _, norms = step(state, batch_arrays)
        for n in norms:
            n.block_until_ready()
        peaks = [session.usage(i)["peak_buffer_bytes"] for i in islands]
        del state, norms
        return {"donate": donate, "state_bytes": state_bytes, "base_bytes": base, "peak_bytes": peaks}
    finally:
        for s in slices:
            s.release()


def make_step(config: Any, opt: optim.OptimConfig, slices: list, stage: int) -> TrainStep:
    """The donating step of a ZeRO stage (0: the replicated ``TrainStep``)."""
    return TrainStep(config, opt, slices) if stage == 0 else ZeroTrainStep(config, opt, slices, stage)


def run_block(step: TrainStep, state: PodState, batches: list[dict]) -> tuple[PodState, float]:
    """Dispatch the steps back to back, then wait for every output of the last (each pod's parameters and norm,
    so every send has landed); seconds per step."""
    start = time.perf_counter()
    for batch in batches:
        state, _, norms = step(state, batch)
    for x in jax.tree.leaves((state.params, norms)):
        x.block_until_ready()
    return state, (time.perf_counter() - start) / len(batches)


def _bytes_out(session: Any, islands: list[int]) -> int:
    return sum(session.host_stats(i)["bytes_out"] for i in islands)


def measure_stage(session: Any, step: TrainStep, host_state: tuple, batches: list[dict]) -> dict:
    """One stage alone on the pods: after ``batches[:-1]`` (which compile), the peak bytes per pod during the
    last step, the bytes held before it, and the bytes both pods sent in it."""
    islands = [s.island for s in step.slices]
    state, _ = run_block(step, step.put_state(*host_state), batches[:-1])
    base = _settled(session, islands)
    for i in islands:
        session.usage(i, reset_peak=True)
    before = _bytes_out(session, islands)
    state, _ = run_block(step, state, batches[-1:])
    sent = _bytes_out(session, islands) - before
    peaks = [session.usage(i)["peak_buffer_bytes"] for i in islands]
    del state
    _settled(session, islands)
    return {"peak_bytes": peaks, "base_bytes": base, "sent_bytes": sent}


def measure_zero(config_name: str, batch: int, blocks: int, block: int, stages: tuple = pw.zero.STAGES) -> dict:
    """Every stage's memory and traffic (one at a time), then its step time in blocks that rotate the stages'
    order each round, all on the current session's two pods."""
    session = pw.init()
    config, opt = CONFIGS[config_name], optim.OptimConfig()
    slices = [pw.slice((2, 2), ("data", "model"), island=p) for p in range(2)]
    try:
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        host_state = (params, optim.init_opt_state(params, opt))
        steps = {s: make_step(config, opt, slices, s) for s in stages}
        batches = [data.batch(i, 0, batch, config.seq_len) for i in range(max(block, 3))]
        rows = {s: measure_stage(session, steps[s], host_state, batches[:3]) for s in stages}
        states = {s: run_block(steps[s], steps[s].put_state(*host_state), batches[:2])[0] for s in stages}
        times: dict[int, list[float]] = {s: [] for s in stages}
        for k in range(blocks):
            for s in stages[k % len(stages):] + stages[:k % len(stages)]:
                states[s], per_step = run_block(steps[s], states[s], batches[:block])
                times[s].append(per_step)
        del states
    finally:
        for s in slices:
            s.release()
    state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(host_state))
    param_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    for s in stages:
        rows[s]["step_s"] = times[s]
        rows[s]["median_step_s"] = statistics.median(times[s])
    return {"config": config_name, "batch": batch, "blocks": blocks, "block": block, "state_bytes": state_bytes,
            "param_bytes": param_bytes, "stages": rows}


def zero_report(result: dict) -> str:
    """The table of stages and one summary line per stage, stage 0 against each."""
    rows, mib = result["stages"], 2**20
    base = rows[0]
    waits = result.get("recv_wait_ms")  # benchmarks.zero adds each pod's receive waits, from pw.trace
    header = ("stage", "peak MiB per pod", "held before the step", "network MiB/step", "s/step (median)",
              "t0 / t") + (("recv wait ms/step",) if waits else ())
    cells = [header] + [(str(s), "/".join(f"{b / mib:.2f}" for b in row["peak_bytes"]),
                         "/".join(f"{b / mib:.2f}" for b in row["base_bytes"]), f"{row['sent_bytes'] / mib:.2f}",
                         f"{row['median_step_s']:.3f}", f"{base['median_step_s'] / row['median_step_s']:.3f}")
                        + (("/".join(f"{w:.1f}" for w in waits[s]),) if waits else ())
                        for s, row in rows.items()]
    widths = [max(len(c[k]) for c in cells) for k in range(len(header))]
    text = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cell, widths)))
            for cell in cells]
    table = "\n".join([text[0], "-" * len(text[0]), *text[1:]])
    lines = [f"ZeRO over 2 pods, PaLM {result['config']}, global batch {result['batch']}: parameters "
             f"{result['param_bytes'] / mib:.2f} MiB, with the optimizer state {result['state_bytes'] / mib:.2f} MiB; "
             f"{result['blocks']} blocks x {result['block']} steps per stage, the order rotating each block",
             table]
    for s, row in rows.items():
        if s:
            lines.append(f"zero: stage {s} peak per pod {max(base['peak_bytes']) / mib:.1f} -> "
                         f"{max(row['peak_bytes']) / mib:.1f} MiB, network bytes per step {base['sent_bytes']:,} -> "
                         f"{row['sent_bytes']:,}, step time ratio "
                         f"{base['median_step_s'] / row['median_step_s']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.palm.memory", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--pods", type=int, default=2, choices=(1, 2))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per ZeRO stage (two pods only)")
    p.add_argument("--block", type=int, default=3, help="steps per timed block")
    a = p.parse_args(argv)
    pw.init(topology=pw.Topology(islands=a.pods, hosts_per_island=1, devices_per_host=DEVICES_PER_POD))
    try:
        rows = [measure(a.config, a.pods, a.batch, donate) for donate in (False, True)]
        zero = measure_zero(a.config, a.batch, a.blocks, a.block) if a.pods == 2 else None
    finally:
        pw.shutdown()
    state = rows[0]["state_bytes"]
    print(f"PaLM {a.config}, {a.pods} pod(s), batch {a.batch}: parameters + optimizer state "
          f"{state / 2**20:.2f} MiB per pod")
    for row in rows:
        peaks = ", ".join(f"{b / 2**20:.2f}" for b in row["peak_bytes"])
        print(f"  donate={row['donate']!s:5}  peak buffer MiB per pod: {peaks}  "
              f"(settled before the step: {', '.join(f'{b / 2**20:.2f}' for b in row['base_bytes'])})")
    saved = [a - b for a, b in zip(rows[0]["peak_bytes"], rows[1]["peak_bytes"])]
    print("  donation saves per pod: " + ", ".join(f"{s / 2**20:.2f} MiB ({s / state:.2f} x the state)"
                                                   for s in saved) +
          "; peak ratio with/without: " + ", ".join(f"{b / a:.3f}" for a, b in zip(rows[0]["peak_bytes"],
                                                                                      rows[1]["peak_bytes"])))
    if zero is not None:
        print(zero_report(zero))
    return 0


if __name__ == "__main__":
    sys.exit(main())
