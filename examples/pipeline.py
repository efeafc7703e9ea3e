"""Train a small MLP pipelined over two islands, from one training step written as for ``jax.jit``.

The model marks where each stage ends (``pw.pipeline.end_stage``); ``pw.pipeline.jit`` cuts the step there
into each stage's forward, backward and update, places stage k's layers (and their Adam state) on slice k,
and runs every step as one ``@pw.program``: the batch split into micro-batches, activations flowing to the
next island, their gradients flowing back, each island updating its own layers, all in one dispatch.

    python examples/pipeline.py [--steps 150] [--micro 4] [--schedule 1f1b|gpipe|interleaved|zb-h1]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pathways as pw

WIDTH, LAYERS, FEATURES, BATCH = 64, 4, 16, 256


def model(params: list[dict], x: jnp.ndarray, per_stage: int) -> jnp.ndarray:
    """Residual tanh layers; a stage ends after every ``per_stage`` of them (the last stage's end included)."""
    for k, layer in enumerate(params):
        x = x + jnp.tanh(x @ layer["w"] + layer["b"])
        if k % per_stage == per_stage - 1:
            x = pw.pipeline.end_stage(x)
    return x


def make_train_step(optimizer: optax.GradientTransformation, per_stage: int):
    def loss_fn(params, x, y):
        return jnp.mean((model(params, x, per_stage)[:, :1] - y) ** 2)

    def train_step(params, opt_state, x, y):  # exactly what jax.jit would take
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def init_params(rng: np.random.Generator) -> list[dict]:
    return [{"w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
             "b": np.zeros(WIDTH, np.float32)} for _ in range(LAYERS)]


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
        slices = [pw.slice((1,), ("x",), island=k) for k in range(2)]
        stages = 2 * len(slices) if args.schedule == "interleaved" else len(slices)  # 2 chunks per slice
        optimizer = optax.adam(3e-3)
        step = pw.pipeline.jit(make_train_step(optimizer, LAYERS // stages), slices, n_micro=args.micro,
                               schedule=args.schedule, batch_argnums=(2, 3))
        rng = np.random.default_rng(0)
        teacher = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
        params = init_params(rng)
        opt_state = optimizer.init(params)
        x, y = make_batch(rng, teacher)
        print(f"cluster up in {time.perf_counter() - start:.1f}s; {stages} stages on islands "
              f"{[s.island for s in slices]}, {args.micro} micro-batches, schedule {args.schedule}")
        print(step.graph(params, opt_state, x, y))
        losses = []
        train_start = time.perf_counter()
        for i in range(args.steps):  # the first step places each stage's parameters on its slice
            params, opt_state, loss = step(params, opt_state, *make_batch(rng, teacher))
            losses.append(loss)
            if i % 15 == 0 or i == args.steps - 1:
                print(f"step {i:4d}  loss {float(np.asarray(loss)):.4f}")
        elapsed = time.perf_counter() - train_start
        print(f"layers on slices {[p['w'].slice.key for p in params]}")
        first, last = float(np.asarray(losses[0])), float(np.mean([np.asarray(v) for v in losses[-10:]]))
        print(f"{args.steps} steps in {elapsed:.1f}s ({elapsed / args.steps * 1e3:.1f} ms/step); "
              f"loss {first:.4f} -> {last:.4f} (mean of the last 10)")
        if not last < 0.5 * first:
            raise SystemExit("the loss did not fall by half")
    finally:
        pw.shutdown()


if __name__ == "__main__":
    main()
