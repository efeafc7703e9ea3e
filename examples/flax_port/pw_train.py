"""The Flax NNX model of ``jax_train.py`` trained through pathways: the same loop, a few lines changed.

    python -m examples.flax_port.pw_train

The model, the loss, the data and the step are untouched. The state goes to
a slice with one ``pw.put`` (a pytree of parameters, optimizer state and the
dropout's typed PRNG key), and the step becomes a ``pw.jit`` on that slice,
with the batch split over its "data" axis and the state still donated.
``python -m examples.flax_port`` runs both and compares the losses.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import pathways as pw


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.gelu(self.hidden(x))))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def batch(step: int, size: int = 32, din: int = 8, dout: int = 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(size, din)).astype(np.float32)
    return x, np.tanh(x[:, :dout] * 2.0 - x[:, dout:2 * dout])


def train(steps: int = 20, hidden: int = 64) -> list[float]:
    model = MLP(8, hidden, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    s = pw.slice((2,), ("data",))
    state = pw.put(state, s)

    @functools.partial(pw.jit, slice=s, donate_argnums=0, in_specs={"x": P("data"), "y": P("data")})
    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    losses = []
    for step in range(steps):
        x, y = batch(step)
        state, loss = train_step(state, x, y)
        losses.append(float(loss))
    return losses


def main() -> None:
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    losses = train()
    pw.shutdown()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {len(losses)} steps")


if __name__ == "__main__":
    main()
