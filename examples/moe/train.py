"""Train the MoE Transformer on one island, or with its experts spread over several.

    python -m examples.moe.train --islands 2 --config small --steps 150
    python -m examples.moe.train --islands 1 --devices 2        # experts sharded over one island's 2 devices
    python -m examples.moe.train --islands 2 --skew 3 --place-every 10   # a skewed router; the controller places

With ``--islands 1`` a step is one computation on a (devices,) slice (all-to-all dispatch inside it); with more,
each island is a one-device slice holding some of the experts and a step is one ``@pw.program``
(examples/moe/step.py). ``--skew S`` starts every router biased towards expert 0 (+S) and expert 1 (+S/2);
``--place-every N`` lets the controller re-place the experts from the last steps' token counts every N steps
(examples/moe/placement.py). The run writes a JSONL log and, with matplotlib, a loss plot under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import pathways as pw
from examples.moe import model
from examples.moe.config import CONFIGS, MoeConfig
from examples.moe.placement import Controller, Placement
from examples.moe.step import AXIS, CrossIslandStep, SingleIslandStep, Stats
from examples.palm import data


@dataclass(frozen=True)
class TrainOptions:
    config: str = "small"
    islands: int = 2
    devices: int = 2  # --islands 1: the slice's devices, over which the experts are sharded
    steps: int = 150
    batch: int = 16
    seed: int = 0
    skew: float = 0.0
    place_every: int = 0  # 0: keep the uniform placement
    out: str = ""
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if self.config not in CONFIGS:
            raise ValueError(f"unknown config {self.config!r}; choose from {sorted(CONFIGS)}")
        model_config = CONFIGS[self.config]
        if self.islands < 1 or model_config.n_experts % self.islands:
            raise ValueError(f"--islands {self.islands} must be at least 1 and divide the "
                             f"{model_config.n_experts} experts")
        if self.islands == 1 and (self.devices < 1 or model_config.n_experts % self.devices):
            raise ValueError(f"--devices {self.devices} must divide the {model_config.n_experts} experts")
        if self.batch < 1 or self.batch % (self.islands * (self.devices if self.islands == 1 else 1)):
            raise ValueError(f"--batch {self.batch} must split evenly over the islands' devices")
        if self.steps < 1 or self.place_every < 0:
            raise ValueError("--steps must be positive and --place-every not negative")
        if self.place_every and self.islands < 2:
            raise ValueError("--place-every needs --islands 2 or more: one island has nowhere to move experts")

    @property
    def model_config(self) -> MoeConfig:
        return CONFIGS[self.config]

    @property
    def folder(self) -> str:
        return self.out or os.path.join("runs", f"moe_{self.config}_{self.islands}island")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    dropped: list[float] = field(default_factory=list)  # fraction of routing choices dropped, per step
    placements: list[tuple[int, Placement]] = field(default_factory=list)  # (step, placement) when changed
    tokens_per_s: float = 0.0
    plot: str | None = None


def skewed(params: dict, skew: float) -> dict:
    """The same parameters with every router biased towards expert 0 (+skew) and expert 1 (+skew/2)."""
    if not skew:
        return params
    layers = []
    for layer in params["shared"]["layers"]:
        if "router_bias" in layer:
            bias = np.zeros(layer["router_bias"].shape, np.float32)
            bias[0], bias[1] = skew, skew / 2
            layer = {**layer, "router_bias": layer["router_bias"] + bias}
        layers.append(layer)
    return {**params, "shared": {**params["shared"], "layers": layers}}


def train(opts: TrainOptions) -> TrainResult:
    """The loop, on an initialized session: one step at a time, the controller between steps."""
    config = opts.model_config
    params = skewed(jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(opts.seed)), opts.skew)
    os.makedirs(opts.folder, exist_ok=True)
    log_path = os.path.join(opts.folder, "log.jsonl")
    result = TrainResult()
    if opts.islands == 1:
        slices = [pw.slice((opts.devices,), (AXIS,), island=0)]
        step: Any = SingleIslandStep(config, slices[0])
        controller = None
    else:
        slices = [pw.slice((1,), (AXIS,), island=i) for i in range(opts.islands)]
        placement = Placement.uniform(config.n_experts, opts.islands, config.capacity, len(config.moe_layers))
        step = CrossIslandStep(config, slices, placement)
        controller = Controller(placement, [opts.batch // opts.islands] * opts.islands)
    try:
        state = step.put_state(params)
        started = None
        with open(log_path, "w") as log, tqdm(total=opts.steps, disable=not opts.progress, dynamic_ncols=True,
                                              file=sys.stdout) as bar:
            for i in range(opts.steps):
                state, out = step(state, data.batch(i, opts.seed, opts.batch, config.seq_len))
                stats, per_island = _read(step, out)
                if i == 0:
                    started = time.perf_counter()  # the first step compiles
                result.losses.append(stats.metrics["loss"])
                result.dropped.append(stats.dropped)
                log.write(json.dumps({"step": i + 1, **stats.metrics, "dropped": stats.dropped,
                                      "demand": stats.demand.tolist()}) + "\n")
                if controller is not None:
                    controller.observe([s.demand for s in per_island])
                    if opts.place_every and (i + 1) % opts.place_every == 0:
                        new = controller.decide()
                        if new is not None:
                            state = step.place(state, new)
                            result.placements.append((i + 1, new))
                            tqdm.write(f"step {i + 1}: experts placed anew: {describe(new)}", file=sys.stdout)
                bar.set_postfix(loss=f"{stats.metrics['loss']:.3f}", dropped=f"{100 * stats.dropped:.1f}%")
                bar.update(1)
        if started is not None and opts.steps > 1:
            result.tokens_per_s = (opts.steps - 1) * opts.batch * config.seq_len / (time.perf_counter() - started)
    finally:
        for s in slices:
            s.release()
    if opts.plot:
        result.plot = plot(result, os.path.join(opts.folder, "loss.png"), opts)
    return result


def _read(step: Any, out: Any) -> tuple[Stats, list[Stats]]:
    if isinstance(step, SingleIslandStep):
        stats = step.read(out)
        return stats, [stats]
    return step.read(out)


def describe(placement: Placement) -> str:
    """MoE layer 0's slots per island as ``e<expert>:<capacity>``, e.g. ``island 0: e0:40 e1:9 | island 1: e0:38``."""
    layout = placement.layers[0]
    return " | ".join(f"island {j}: " + " ".join(f"e{s.expert}:{s.capacity}" for s in slots)
                      for j, slots in enumerate(layout))


def plot(result: TrainResult, path: str, opts: TrainOptions) -> str | None:
    """Loss and dropped fraction against the step, as a PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = range(1, len(result.losses) + 1)
    ax.plot(steps, result.losses)
    ax.set(xlabel="step", ylabel="loss", title=f"MoE {opts.config}, {opts.islands} island(s)")
    ax2.plot(steps, [100 * d for d in result.dropped])
    for at, _ in result.placements:
        ax2.axvline(at, color="gray", linestyle=":")
    ax2.set(xlabel="step", ylabel="dropped choices (%)", title="tokens over capacity (dotted: new placement)")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> TrainOptions:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--islands", type=int, default=2)
    p.add_argument("--devices", type=int, default=2, help="--islands 1: devices of the slice")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="router bias towards experts 0 and 1 at the start")
    p.add_argument("--place-every", type=int, default=0, help="let the controller place experts every N steps")
    p.add_argument("--out", default="", help="run folder (default runs/moe_<config>_<islands>island)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    args = p.parse_args(argv)
    try:
        return TrainOptions(**vars(args))
    except ValueError as e:
        p.error(str(e))
        raise


def main(argv: list[str] | None = None) -> TrainResult:
    opts = parse_args(argv)
    pw.init(topology=pw.Topology(islands=max(2, opts.islands), hosts_per_island=1,
                                 devices_per_host=max(4, opts.devices)))
    try:
        result = train(opts)
    finally:
        pw.shutdown()
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    print(f"loss {first:.3f} -> {last:.3f} over {opts.steps} steps, {result.tokens_per_s:,.0f} tokens/s, "
          f"dropped {100 * result.dropped[0]:.1f}% -> {100 * result.dropped[-1]:.1f}%"
          + (f", plot {result.plot}" if result.plot else ""))
    return result


if __name__ == "__main__":
    main()
