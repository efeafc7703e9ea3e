"""GRPO's objective (client/rl/grpo.py, ``pw.rl``): advantages, the clipped loss, the KL term, the Rollout pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw


def test_advantages_are_standardised_within_each_group() -> None:
    rewards = jnp.array([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    advantages = pw.rl.group_advantages(rewards, 4)
    first = np.array([0.0, 1.0, 0.5, 0.5])
    np.testing.assert_allclose(advantages[:4], (first - 0.5) / (first.std() + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(advantages[4:], 0.0)  # one score for the whole group: no signal


def test_advantages_refuse_rewards_that_do_not_split_into_groups() -> None:
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        pw.rl.group_advantages(jnp.zeros(8), 3)
    with pytest.raises(ValueError, match="positive int"):
        pw.rl.group_advantages(jnp.zeros(8), 0)


def _hand_loss(logp, behavior, ref, adv, mask, clip_eps, kl_coef, cap):
    """The GRPO loss token by token in plain Python."""
    total, count = 0.0, 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = np.exp(logp[i][t] - behavior[i][t])
            s = min(r * adv[i], min(max(r, 1 - clip_eps), 1 + clip_eps) * adv[i])
            if adv[i] < 0:
                s = max(s, cap * adv[i])
            d = ref[i][t] - logp[i][t]
            total += -s + kl_coef * (np.exp(d) - d - 1)
            count += 1
    return total / count


def test_loss_matches_a_hand_computation() -> None:
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 3.0, (4, 6))
    behavior = logp + rng.normal(0, 0.6, (4, 6))
    ref = logp + rng.normal(0, 0.3, (4, 6))
    adv = np.array([1.5, -0.5, -2.0, 0.3])
    mask = (rng.uniform(size=(4, 6)) > 0.2).astype(np.float32)
    loss, metrics = pw.rl.grpo_loss(*(jnp.asarray(a, jnp.float32) for a in (logp, behavior, ref, adv, mask)),
                                    clip_eps=0.2, kl_coef=0.1, ratio_cap=3.0)
    np.testing.assert_allclose(loss, _hand_loss(logp, behavior, ref, adv, mask, 0.2, 0.1, 3.0), rtol=1e-5)
    assert metrics["loss"] == loss and 0.0 < metrics["clip_fraction"] < 1.0


def _loss_and_grad(logp: float, behavior: float, adv: float, **kwargs) -> tuple[float, float]:
    def loss(lp):
        return pw.rl.grpo_loss(lp, jnp.full((1, 1), behavior), lp, jnp.array([adv]), jnp.ones((1, 1)),
                               kl_coef=0.0, **kwargs)[0]
    value, grad = jax.value_and_grad(loss)(jnp.full((1, 1), logp))
    return float(value), float(grad[0, 0])


def test_the_clip_stops_the_push_past_one_plus_eps() -> None:
    # ratio 1.5 with a positive advantage: the objective is capped at (1 + 0.2) * A and its gradient is zero
    value, grad = _loss_and_grad(np.log(1.5), 0.0, 1.0, clip_eps=0.2)
    assert value == pytest.approx(-1.2) and grad == 0.0
    # ratio 0.5 with a negative advantage: capped at (1 - 0.2) * A, no further push down
    value, grad = _loss_and_grad(np.log(0.5), 0.0, -1.0, clip_eps=0.2)
    assert value == pytest.approx(0.8) and grad == 0.0
    # inside the clip range the gradient of -r * A with respect to logp is -r * A
    value, grad = _loss_and_grad(np.log(1.1), 0.0, 1.0, clip_eps=0.2)
    assert value == pytest.approx(-1.1) and grad == pytest.approx(-1.1)
    # ratio 0.5 with a positive advantage is not clipped: the unfavourable side keeps its gradient
    value, grad = _loss_and_grad(np.log(0.5), 0.0, 1.0, clip_eps=0.2)
    assert value == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def test_the_ratio_cap_bounds_a_stale_token_with_negative_advantage() -> None:
    # ratio 5 (the sampler gave the token far less probability), negative advantage: -r * A would be 5
    value, grad = _loss_and_grad(np.log(5.0), 0.0, -1.0, clip_eps=0.2, ratio_cap=3.0)
    assert value == pytest.approx(3.0) and grad == 0.0
    value, grad = _loss_and_grad(np.log(5.0), 0.0, -1.0, clip_eps=0.2, ratio_cap=None)
    assert value == pytest.approx(5.0) and grad == pytest.approx(5.0)


def test_the_decoupled_form_reweights_stale_tokens_instead_of_clipping_them() -> None:
    behavior = jnp.log(jnp.array([[0.1, 0.5, 0.5]]))  # the stale sampler's probabilities
    prox = jnp.log(jnp.array([[0.5, 0.5, 0.65]]))  # the weights the step starts from moved away since
    mask, adv = jnp.ones((1, 3)), jnp.array([1.0])

    def loss(lp, **kwargs):
        return pw.rl.grpo_loss(lp, behavior, lp, adv, mask, kl_coef=0.0, ratio_cap=3.0, **kwargs)[0]

    # coupled: the first token's ratio to the sampler is 5, clipped at 1.2: no gradient; the third is 1.3: none
    grad = jax.grad(loss)(prox)
    np.testing.assert_allclose(grad, [[0.0, -1 / 3, 0.0]], rtol=1e-6)
    # decoupled: every token keeps its gradient, weighted by min(prox / behavior, cap) = (3, 1, 1.3)
    value, grad = jax.value_and_grad(lambda lp: loss(lp, prox_logp=prox))(prox)
    assert value == pytest.approx(-(3.0 + 1.0 + 1.3) / 3)
    np.testing.assert_allclose(grad, [[-1.0, -1 / 3, -1.3 / 3]], rtol=1e-6)
    # with no staleness (proximal = behavior) the two forms are one
    assert loss(prox, prox_logp=behavior) == pytest.approx(loss(prox))


def test_kl_is_zero_when_the_policy_is_the_reference_and_positive_otherwise() -> None:
    logp = -jnp.arange(1.0, 7.0).reshape(2, 3) / 3
    adv, mask = jnp.zeros(2), jnp.ones((2, 3))
    _, metrics = pw.rl.grpo_loss(logp, logp, logp, adv, mask)
    assert metrics["kl"] == 0.0 and metrics["loss"] == 0.0
    _, metrics = pw.rl.grpo_loss(logp, logp, logp - 0.5, adv, mask, kl_coef=0.5)
    assert metrics["kl"] == pytest.approx(np.exp(-0.5) + 0.5 - 1, rel=1e-6)
    assert metrics["loss"] == pytest.approx(0.5 * metrics["kl"])


def test_masked_tokens_do_not_count() -> None:
    logp = jnp.zeros((1, 3))
    behavior = jnp.array([[0.0, 0.0, -5.0]])  # the last token would have ratio e^5, but it is padding
    loss, metrics = pw.rl.grpo_loss(logp, behavior, logp, jnp.array([1.0]), jnp.array([[1.0, 1.0, 0.0]]))
    assert loss == pytest.approx(-1.0) and metrics["ratio_max"] == pytest.approx(1.0)


def test_bad_arguments_are_refused() -> None:
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="share one shape"):
        pw.rl.grpo_loss(x, jnp.zeros((2, 4)), x, jnp.zeros(2), x)
    with pytest.raises(ValueError, match="advantages must be"):
        pw.rl.grpo_loss(x, x, x, jnp.zeros(3), x)
    with pytest.raises(ValueError, match="clip_eps"):
        pw.rl.grpo_loss(x, x, x, jnp.zeros(2), x, clip_eps=1.5)
    with pytest.raises(ValueError, match="ratio_cap must exceed"):
        pw.rl.grpo_loss(x, x, x, jnp.zeros(2), x, ratio_cap=1.1)


def test_a_rollout_is_a_pytree_whose_version_is_data() -> None:
    traces = []

    @jax.jit
    def staleness(rollout: pw.rl.Rollout, now: jax.Array) -> jax.Array:
        traces.append(None)
        return now - rollout.version

    def rollout(version: int) -> pw.rl.Rollout:
        return pw.rl.Rollout(tokens=jnp.zeros((2, 5), jnp.int32), behavior_logp=jnp.zeros((2, 3)),
                             rewards=jnp.zeros(2), advantages=jnp.zeros(2), mask=jnp.ones((2, 3)),
                             version=jnp.int32(version))

    assert rollout(0).prompt_len == 2
    assert int(staleness(rollout(3), 5)) == 2 and int(staleness(rollout(4), 5)) == 1
    assert len(traces) == 1  # a new version is new data, not a new compilation
    assert len(jax.tree.leaves(rollout(0))) == 6
