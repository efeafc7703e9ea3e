"""Train a small MLP pipelined over two islands: stage 0 on island 0, stage 1 on island 1.

Each step is one ``@pw.program``: the batch is split into micro-batches on island 0,
activations flow to island 1, the loss and gradients flow back, and each island
applies Adam to its own layers, all in one dispatch (one message per island).

    python examples/pipeline.py [--steps 150] [--micro 4] [--schedule 1f1b|gpipe]
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax

import pathways as pw

WIDTH, DEPTH_PER_STAGE, FEATURES, BATCH = 64, 2, 16, 256


def stage_fn(params: list[dict], x: jnp.ndarray) -> jnp.ndarray:
    """A stack of residual tanh layers; each stage holds DEPTH_PER_STAGE of them."""
    for layer in params:
        x = x + jnp.tanh(x @ layer["w"] + layer["b"])
    return x


def loss_fn(y: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    return jnp.mean((y[:, :1] - targets) ** 2)


def init_stage(rng: np.random.Generator) -> list[dict]:
    return [{"w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
             "b": np.zeros(WIDTH, np.float32)} for _ in range(DEPTH_PER_STAGE)]


def make_batch(rng: np.random.Generator, teacher: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs padded to the model width; the target is a smooth function of the first FEATURES inputs."""
    x = np.zeros((BATCH, WIDTH), np.float32)
    x[:, :FEATURES] = rng.normal(size=(BATCH, FEATURES))
    y = np.sin(x[:, :FEATURES] @ teacher).astype(np.float32)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=pw.pipeline.SCHEDULES)
    args = parser.parse_args()

    start = time.perf_counter()
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=1))
    try:
        stages = [pw.pipeline.Stage(stage_fn, pw.slice((1,), ("x",), island=k)) for k in range(2)]
        pipe = pw.pipeline.build(stages, loss_fn, optax.adam(3e-3), n_micro=args.micro, schedule=args.schedule)
        rng = np.random.default_rng(0)
        teacher = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
        params, opt_states = pipe.init([init_stage(rng), init_stage(rng)])
        print(f"cluster up in {time.perf_counter() - start:.1f}s; {len(stages)} stages on islands "
              f"{[s.slice.island for s in stages]}, {args.micro} micro-batches, schedule {args.schedule}")
        print(pipe.step.graph(params, opt_states, *(pw.put(v, s.slice) for v, s in
                                                   zip(make_batch(rng, teacher), (stages[0], stages[-1])))))
        losses = []
        train_start = time.perf_counter()
        for step in range(args.steps):
            x, y = make_batch(rng, teacher)
            params, opt_states, loss = pipe.step(params, opt_states, pw.put(x, stages[0].slice),
                                                 pw.put(y, stages[-1].slice))
            losses.append(loss)
            if step % 15 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {float(np.asarray(loss)):.4f}")
        elapsed = time.perf_counter() - train_start
        first, last = float(np.asarray(losses[0])), float(np.mean([np.asarray(v) for v in losses[-10:]]))
        print(f"{args.steps} steps in {elapsed:.1f}s ({elapsed / args.steps * 1e3:.1f} ms/step); "
              f"loss {first:.4f} -> {last:.4f} (mean of the last 10)")
        if not last < 0.5 * first:
            raise SystemExit("the loss did not fall by half")
    finally:
        pw.shutdown()


if __name__ == "__main__":
    main()
