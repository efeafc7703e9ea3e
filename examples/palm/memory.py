"""Peak buffer bytes on each pod during one PaLM training step, with and without donation.

    python -m examples.palm.memory --config small --pods 2

Without donation, the update writes new parameters and optimizer state beside
the old ones, so a pod holds two copies of them at the end of a step. With
donation (the default in ``TrainStep``), the update takes the old buffers, so
the peak drops by about one copy of the parameters and optimizer state. Each
host's buffer table counts the bytes it holds; the peak is read after one
step that starts from a settled table (``session.usage(island, reset_peak=True)``,
then ``session.usage(island)["peak_buffer_bytes"]``).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import pathways as pw
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.step import TrainStep

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.palm.memory", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--pods", type=int, default=2, choices=(1, 2))
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    pw.init(topology=pw.Topology(islands=a.pods, hosts_per_island=1, devices_per_host=DEVICES_PER_POD))
    try:
        rows = [measure(a.config, a.pods, a.batch, donate) for donate in (False, True)]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
