"""Train the sorting policy with GRPO across islands: the sampler on one slice, the trainer on another.

    python -m examples.rl.train --placement colocated --steps 150
    python -m examples.rl.train --placement disaggregated --steps 150
    python -m examples.rl.train --placement async --staleness 1 --steps 150

The model, the task and the loss are ``examples/rl/model.py``, ``task.py`` and ``step.py``, the same functions
``python -m examples.rl.local`` runs in one process; only ``--placement`` says where they run (``pw.rl``). The
sampler generates on a tensor-parallel slice (``model.param_specs``), the trainer updates on a fully sharded
data-parallel one (``model.fsdp_specs``); each step syncs the weights trainer to sampler. The run prints the
mean reward per step on a progress bar and writes a JSONL log and, with matplotlib, a plot under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import pathways as pw
from examples.palm.step import opt_state_specs
from examples.rl import model, step
from examples.rl.task import Task

PLACEMENTS = ("colocated", "disaggregated", "async")


@dataclass(frozen=True)
class TrainOptions:
    placement: str = "async"
    staleness: int | None = None  # async: 1 unless given; the others: 0
    steps: int = 150
    config: str = "sort"
    length: int = 5
    prompts: int = 16
    group: int = 8
    devices: int = 2  # each slice's devices
    seed: int = 0
    out: str = ""
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown --placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.staleness is None:
            object.__setattr__(self, "staleness", int(self.placement == "async"))
        if self.placement == "async" and self.staleness < 1:
            raise ValueError(f"--staleness must be at least 1 with --placement async (0 is --placement "
                             f"disaggregated), got {self.staleness}")
        if self.placement != "async" and self.staleness:
            raise ValueError(f"--staleness applies to --placement async only: {self.placement} is on-policy")
        if self.config not in model.CONFIGS:
            raise ValueError(f"unknown --config {self.config!r}; choose from {sorted(model.CONFIGS)}")
        if self.steps < 1 or self.prompts < 1 or self.group < 2 or self.devices < 1:
            raise ValueError("--steps, --prompts and --devices must be positive and --group at least 2")
        if (self.prompts * self.group) % self.devices:
            raise ValueError(f"--prompts x --group ({self.prompts * self.group}) must divide over --devices "
                             f"{self.devices}")

    @property
    def model_config(self) -> model.Config:
        return model.CONFIGS[self.config]

    @property
    def folder(self) -> str:
        return self.out or os.path.join("runs", f"rl_{self.placement}")

    def rl_placement(self) -> pw.rl.Placement:
        return pw.rl.placement(self.placement, self.staleness)


@dataclass
class TrainResult:
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    steps_per_s: float = 0.0
    plot: str | None = None


def make_loop(opts: TrainOptions, name: str = "rl") -> tuple[pw.rl.Loop, tuple]:
    """The example's loop on its placement, and the host state to start it from: (params, opt_state, ref)."""
    config, task = opts.model_config, Task(length=opts.length)
    optimizer = step.optimizer(config)
    params = model.init(config, jax.random.key(opts.seed))
    opt_state = optimizer.init(params)
    trainer_specs = model.fsdp_specs(config, "data")
    rows = P("data")

    def sample(p: model.Params, key: jax.Array, version: jax.Array) -> pw.rl.Rollout:
        return step.sample_step(p, key, task, config, opts.group, opts.prompts, version)

    def train(p: model.Params, o: object, rollout: pw.rl.Rollout, ref: model.Params) -> tuple:
        return step.train_step(p, o, ref, rollout, config, optimizer)

    loop = pw.rl.Loop(opts.rl_placement(), sample=sample, train=train, name=name,
                      sampler=((opts.devices,), ("model",)), trainer=((opts.devices,), ("data",)),
                      sampler_specs=model.param_specs(config, "model"), trainer_specs=trainer_specs,
                      opt_specs=opt_state_specs(opt_state, params, trainer_specs),
                      rollout_specs=pw.rl.Rollout(rows, rows, rows, rows, rows, P()))
    return loop, (params, opt_state, params)


def train(opts: TrainOptions) -> TrainResult:
    """The run, on an initialized session: dispatch steps ahead, read each step's metrics as it lands."""
    os.makedirs(opts.folder, exist_ok=True)
    result = TrainResult()
    loop, (params, opt_state, ref) = make_loop(opts)
    started = None
    with loop, open(os.path.join(opts.folder, "log.jsonl"), "w") as log, \
            tqdm(total=opts.steps, disable=not opts.progress, dynamic_ncols=True, file=sys.stdout) as bar:
        loop.start(params, opt_state, consts=ref, key=jax.random.key(opts.seed + 1))
        waiting: list[pw.rl.StepResult] = []
        for n in range(opts.steps + loop.depth):
            if n < opts.steps:
                waiting.append(loop.step())
            if len(waiting) > loop.depth or (n >= opts.steps and waiting):
                done = waiting.pop(0)
                metrics = done.read()  # a few floats: the only bytes that come back
                if started is None:
                    started = time.perf_counter()  # the first step compiles
                result.rewards.append(metrics["reward"])
                result.versions.append(done.version)
                log.write(json.dumps({"step": done.step + 1, "version": done.version, **metrics,
                                      "time": time.time()}) + "\n")
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", solved=f"{metrics['solved']:.2f}",
                                stale=done.staleness)
                bar.update(1)
        if started is not None and opts.steps > 1:
            result.steps_per_s = (opts.steps - 1) / (time.perf_counter() - started)
    if opts.plot:
        result.plot = plot(result, os.path.join(opts.folder, "reward.png"), opts)
    return result


def plot(result: TrainResult, path: str, opts: TrainOptions) -> str | None:
    """The mean reward against the step, as a PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(result.rewards) + 1), result.rewards)
    ax.set(xlabel="step", ylabel="mean reward", title=f"GRPO, {opts.rl_placement()}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> TrainOptions:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--placement", default="async", choices=PLACEMENTS)
    p.add_argument("--staleness", type=int, default=None,
                   help="k: the most updates a rollout's weights may lag (async; default 1)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--config", default="sort", choices=sorted(model.CONFIGS))
    p.add_argument("--length", type=int, default=5, help="digits to sort")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--devices", type=int, default=2, help="devices of the sampler's and of the trainer's slice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="run folder (default runs/rl_<placement>)")
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
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=max(4, opts.devices)))
    try:
        result = train(opts)
    finally:
        pw.shutdown()
    window = max(1, min(10, opts.steps // 5))
    print(f"reward {np.mean(result.rewards[:window]):.3f} -> {np.mean(result.rewards[-window:]):.3f} over "
          f"{opts.steps} steps ({opts.rl_placement()}), {result.steps_per_s:.2f} steps/s"
          + (f", plot {result.plot}" if result.plot else ""))
    return result


if __name__ == "__main__":
    main()
