"""The optimizer as PaLM ran it (section 5), assembled from optax.

Global-norm gradient clipping at 1.0, then Adafactor without factorization
(equivalent to Adam with parameter-scaled updates), beta1 = 0.9, second-moment
decay beta2 = 1 - k^-0.8 (optax's ``decay_rate=0.8``), update clipping at 1.0,
and weight decay lr^2. The learning rate is held at its peak for
``const_steps`` and then decays as 1/sqrt(k); PaLM used 1e-2 for 10k steps,
which is exactly 1/sqrt(max(k, 10k)). Short runs shrink ``const_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from pathways import zero


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings (hashable, so jit can take it as a static argument).

    ``momentum=None`` drops the first moment, as the original Adafactor paper did;
    ``factored=True`` switches to Adafactor's factored second moments, which PaLM
    did not use. ``warmup_steps`` adds a linear warmup that PaLM did not have.
    """

    peak_lr: float = 1e-2
    const_steps: int = 10_000
    warmup_steps: int = 0
    momentum: float | None = 0.9
    decay_rate: float = 0.8
    clip_norm: float = 1.0
    update_clip: float = 1.0
    factored: bool = False
    lr_squared_weight_decay: bool = True


def learning_rate(config: OptimConfig) -> optax.Schedule:
    """Linear warmup to ``peak_lr``, constant until ``const_steps``, then peak * sqrt(const_steps / k)."""
    def schedule(count: jax.Array) -> jax.Array:
        k = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (k + 1.0) / max(config.warmup_steps, 1))
        decay = jnp.sqrt(config.const_steps / jnp.maximum(k, float(config.const_steps)))
        return config.peak_lr * warm * decay

    return schedule


def _adafactor(config: OptimConfig) -> optax.GradientTransformation:
    """optax.adafactor with PaLM's settings: every statistic is per parameter leaf."""
    schedule = learning_rate(config)
    weight_decay = (lambda count: schedule(count) ** 2) if config.lr_squared_weight_decay else None
    return optax.adafactor(
        learning_rate=schedule,
        decay_rate=config.decay_rate,
        multiply_by_parameter_scale=True,
        clipping_threshold=config.update_clip,
        momentum=config.momentum,
        weight_decay_rate=weight_decay,
        factored=config.factored,
    )


def make_optimizer(config: OptimConfig = OptimConfig()) -> optax.GradientTransformation:
    """clip_by_global_norm then optax.adafactor with PaLM's settings."""
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), _adafactor(config))


def init_opt_state(params: optax.Params, config: OptimConfig = OptimConfig()) -> optax.OptState:
    """Optimizer state for ``params``."""
    return make_optimizer(config).init(params)


def apply_update(params: optax.Params, opt_state: optax.OptState, grads: optax.Updates,
                 config: OptimConfig = OptimConfig()) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step; pure, so ``jax.jit(apply_update, static_argnames="config")`` works."""
    updates, opt_state = make_optimizer(config).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def apply_share_update(params: list, opt_state: optax.OptState, grads: list, norm: jax.Array,
                       config: OptimConfig = OptimConfig()) -> tuple[list, optax.OptState]:
    """One optimizer step on a share of the parameter leaves (ZeRO), given the global gradient norm.

    ``opt_state`` is ``make_optimizer``'s state cut to the share (``pw.zero.shard_state``). The clipping uses
    the norm of every pod's gradients, not the share's, so each leaf moves exactly as in ``apply_update``.
    """
    clipped = zero.clip(grads, norm, config.clip_norm)
    updates, adafactor_state = _adafactor(config).update(clipped, opt_state[1], params)
    return optax.apply_updates(params, updates), (opt_state[0], adafactor_state)
