"""A tiny RL policy for the loop's tests: T independent categorical choices over V tokens, rewarded for each
position that picks its target token; GRPO-style clipped updates with Adam. It learns in a few dozen steps, so a
test sees the mean reward rise from 1/V; its logits [T, V] shard over either dimension, so a test reshards them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

T, V, N = 6, 8, 64  # positions, tokens, samples per rollout
TARGET = np.arange(T) % V
OPT = optax.adam(0.1)
TRAINER_SPECS = {"logits": P("data", None)}  # on a ("data",) mesh of 2
SAMPLER_SPECS = {"logits": P(None, "model")}  # on a ("model",) mesh of 2


def init() -> tuple[dict, optax.OptState]:
    params = {"logits": np.zeros((T, V), np.float32)}
    return params, OPT.init(params)


def _logp(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits)[None], tokens[..., None], axis=-1)[..., 0]


def sample(params: dict, key: jax.Array, version: jax.Array) -> dict:
    tokens = jax.random.categorical(key, params["logits"], axis=-1, shape=(N, T))
    rewards = (tokens == TARGET).mean(axis=1)
    return {"tokens": tokens, "logp": _logp(params["logits"], tokens), "rewards": rewards,
            "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-6), "version": version}


def train(params: dict, opt_state, rollout: dict, consts) -> tuple:
    def loss(p: dict) -> jax.Array:
        ratio = jnp.exp(_logp(p["logits"], rollout["tokens"]) - rollout["logp"])
        adv = rollout["advantages"][:, None]
        return -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "loss": value, "reward": rollout["rewards"].mean(), "version": rollout["version"].astype(jnp.float32)}


def loop_args() -> dict:
    """What every test's ``pw.rl.Loop`` takes besides its placement: the functions, meshes and specs."""
    return dict(sample=sample, train=train, sampler=((2,), ("model",)), trainer=((2,), ("data",)),
                sampler_specs=SAMPLER_SPECS, trainer_specs=TRAINER_SPECS)
