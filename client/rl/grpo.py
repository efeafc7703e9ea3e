"""GRPO's objective: group-relative advantages and the clipped, KL-regularised policy loss.

GRPO (Shao et al., 2024) samples a group of completions per prompt and scores each against its own group:
the advantage of a completion is its reward minus the group's mean, over the group's standard deviation. No
value model is trained. The policy loss is PPO's clipped surrogate with those advantages, plus a KL penalty
to a frozen reference policy.

The ratio is taken against the *behavior* log-probs, the ones the sampler recorded when it generated the
tokens. With asynchronous RL the sampler's weights lag the trainer's by up to ``k`` versions; each
``Rollout`` records the version it was sampled with, and the ratio ``pi_theta / pi_behavior`` is the
importance weight that corrects the gradient for that lag, clipped so that a stale batch cannot move the
policy far from the one that produced it. Pure JAX: everything here runs inside a jitted step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Rollout:
    """One batch of sampled completions, ready for a GRPO step (a pytree: every field is a leaf).

    ``tokens`` int32 [n, P + C]: prompts followed by completions, groups of one prompt contiguous.
    ``behavior_logp`` float32 [n, C]: the sampler's log-prob of each completion token when it drew it.
    ``rewards`` float32 [n]; ``advantages`` float32 [n] (``group_advantages`` of the rewards).
    ``mask`` float32 [n, C]: 1 for completion tokens that count in the loss, 0 for padding.
    ``version``: the weight version the sampler generated with (an int32 scalar under jit); the trainer's
    version minus this one is the batch's staleness.
    """

    tokens: jax.Array
    behavior_logp: jax.Array
    rewards: jax.Array
    advantages: jax.Array
    mask: jax.Array
    version: jax.Array | int

    @property
    def prompt_len(self) -> int:
        """Tokens before the completion (static: from the shapes)."""
        return self.tokens.shape[1] - self.behavior_logp.shape[1]


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """(reward - group mean) / (group std + eps) for rewards [n] whose groups of ``group_size`` are contiguous.

    A group whose completions all scored the same gets advantage 0 throughout: it carries no signal.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be [n] with n a multiple of group_size={group_size}, got shape "
                         f"{rewards.shape}: sample group_size completions per prompt")
    groups = rewards.astype(jnp.float32).reshape(-1, group_size)
    centered = groups - groups.mean(axis=1, keepdims=True)
    return (centered / (groups.std(axis=1, keepdims=True) + eps)).reshape(-1)


def grpo_loss(logp: jax.Array, behavior_logp: jax.Array, ref_logp: jax.Array, advantages: jax.Array,
              mask: jax.Array, clip_eps: float = 0.2, kl_coef: float = 0.04, ratio_cap: float | None = 3.0,
              prox_logp: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """GRPO's loss over completion tokens [n, C], and its metrics.

    Per token, with ratio ``r = exp(logp - behavior_logp)`` and the sequence's advantage ``A``:

        surrogate = min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps) * A)
        if A < 0 and ratio_cap: surrogate = max(surrogate, ratio_cap * A)     (dual clip)
        kl = exp(ref_logp - logp) - (ref_logp - logp) - 1                       (k3, >= 0, unbiased)
        loss = mean over mask of (-surrogate + kl_coef * kl)

    The clip stops a batch from pushing a token's probability past ``1 ± clip_eps`` of the behavior policy's
    in the direction its advantage favours. ``ratio_cap`` is the truncated importance weight for stale batches:
    when the trainer's policy already gives a token far more probability than the (older) sampler did and the
    advantage is negative, the unclipped ``r * A`` would grow without bound; capping the weight at
    ``ratio_cap`` keeps one stale token from dominating the step (its gradient is then zero). ``None`` turns
    the cap off. The mean is over all unmasked tokens of the batch (each token weighs the same).

    Decoupled (``prox_logp`` given: the log-probs under the weights the step starts from, the proximal policy;
    Hilton et al., 2021): the trust region is taken around the proximal policy instead of the stale behavior
    one, and the staleness is corrected by a truncated importance weight,

        w = min(exp(prox_logp - behavior_logp), ratio_cap)                      (no cap if ratio_cap is None)
        r = exp(logp - prox_logp);  surrogate = w * min(r * A, clip(r, 1 ± clip_eps) * A)

    so a stale token keeps its gradient, reweighted, instead of being clipped to zero once the trainer has moved
    ``clip_eps`` away from the sampler. With no staleness both forms are the same.
    ``logp`` carries the gradient; the other log-probs are constants (stop-gradient is applied here).
    """
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if ratio_cap is not None and ratio_cap <= 1.0 + clip_eps:
        raise ValueError(f"ratio_cap must exceed 1 + clip_eps = {1.0 + clip_eps}, got {ratio_cap} (None: no cap)")
    shapes = [x.shape for x in (logp, behavior_logp, ref_logp, mask) + ((prox_logp,) if prox_logp is not None else ())]
    if len(set(shapes)) != 1:
        raise ValueError(f"logp, behavior_logp, ref_logp, mask (and prox_logp) must share one shape [n, C], got "
                         f"{', '.join(map(str, shapes))}")
    if advantages.shape not in ((logp.shape[0],), logp.shape):
        raise ValueError(f"advantages must be [n] or [n, C] for log-probs {logp.shape}, got {advantages.shape}")
    behavior_logp = jax.lax.stop_gradient(behavior_logp.astype(jnp.float32))
    ref_logp = jax.lax.stop_gradient(ref_logp.astype(jnp.float32))
    adv = jax.lax.stop_gradient(jnp.broadcast_to(advantages.reshape(logp.shape[0], -1), logp.shape))
    mask = mask.astype(jnp.float32)
    logp = logp.astype(jnp.float32)

    if prox_logp is None:
        anchor, weight = behavior_logp, jnp.ones_like(logp)
    else:
        anchor = jax.lax.stop_gradient(prox_logp.astype(jnp.float32))
        weight = jnp.exp(anchor - behavior_logp)
        weight = weight if ratio_cap is None else jnp.minimum(weight, ratio_cap)
    ratio = jnp.exp(logp - anchor)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    if prox_logp is None and ratio_cap is not None:
        surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, ratio_cap * adv), surrogate)
    was_clipped = surrogate != ratio * adv  # the token's gradient is zero: a clip or the cap chose its value
    surrogate = weight * surrogate
    log_ref_ratio = ref_logp - logp
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0

    tokens = jnp.maximum(mask.sum(), 1.0)

    def mean(x: jax.Array) -> jax.Array:
        return (x * mask).sum() / tokens

    policy_loss = -mean(surrogate)
    kl_mean = mean(kl)
    loss = policy_loss + kl_coef * kl_mean
    behavior_ratio = jnp.exp(logp - behavior_logp)
    metrics = {
        "loss": loss,
        "policy_loss": policy_loss,
        "kl": kl_mean,
        "clip_fraction": mean(was_clipped.astype(jnp.float32)),
        "ratio_mean": mean(behavior_ratio),
        "ratio_max": jnp.max(jnp.where(mask > 0, behavior_ratio, 0.0)),
    }
    return loss, metrics
