"""The two steps of GRPO, pure JAX: the sampler's (prompts to a scored ``Rollout``) and the trainer's (one Adam
update on a rollout). Each is one jit-able function; a runtime puts them on different slices with different
shardings and moves the weights from the trainer to the sampler between them.

    sample = jax.jit(sample_step, static_argnames=("task", "config", "group_size", "n_prompts"))
    train = jax.jit(train_step, static_argnames=("config", "optimizer"))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import pathways as pw
from examples.rl import model
from examples.rl.model import Config, Params
from examples.rl.task import Task


def optimizer(config: Config) -> optax.GradientTransformation:
    """Adam at ``config.learning_rate`` after clipping the global gradient norm to 1 (keep one object per run:
    jit takes it as a static argument, so a new one compiles the step again)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.learning_rate))


def sample_step(params: Params, key: jax.Array, task: Task, config: Config, group_size: int, n_prompts: int,
                version: jax.Array | int = 0) -> pw.rl.Rollout:
    """``n_prompts`` fresh prompts, each repeated ``group_size`` times (groups contiguous), completed by the
    policy at ``config.temperature`` and scored by the task: a ``Rollout`` of ``n_prompts * group_size`` rows,
    stamped with the weight ``version`` of ``params``."""
    if config.vocab_size != task.vocab_size:
        raise ValueError(f"the policy's vocab_size ({config.vocab_size}) must equal the task's ({task.vocab_size})")
    prompt_key, sample_key = jax.random.split(key)
    prompts, answers = task.prompts(prompt_key, n_prompts)
    prompts, answers = jnp.repeat(prompts, group_size, axis=0), jnp.repeat(answers, group_size, axis=0)
    tokens, logprobs = model.generate(params, prompts, sample_key, config, task.answer_len, config.temperature)
    rewards = task.reward(tokens[:, task.prompt_len:], answers)
    return pw.rl.Rollout(tokens=tokens, behavior_logp=logprobs, rewards=rewards,
                         advantages=pw.rl.group_advantages(rewards, group_size),
                         mask=jnp.ones(logprobs.shape, jnp.float32),  # answers have a fixed length: no padding
                         version=jnp.asarray(version, jnp.int32))


def completion_logprobs(params: Params, rollout: pw.rl.Rollout, config: Config) -> jax.Array:
    """float32 [n, C]: the log-probs of the rollout's completion tokens under ``params``."""
    logp = model.token_logprobs(params, rollout.tokens, config, config.temperature)
    return logp[:, rollout.prompt_len - 1:]


def train_step(params: Params, opt_state: optax.OptState, ref_params: Params, rollout: pw.rl.Rollout,
               config: Config, optimizer: optax.GradientTransformation) -> tuple[Params, optax.OptState, dict]:
    """One GRPO update on ``rollout``: (params, opt_state, metrics).

    The loss is ``pw.rl.grpo_loss`` with the rollout's behavior log-probs (the correction for a stale sampler)
    and a KL penalty to ``ref_params``, the frozen reference policy. Metrics are scalars: the loss terms, the
    rollout's mean reward and the fraction of rows solved exactly, and the gradient norm.
    """
    ref_logp = completion_logprobs(ref_params, rollout, config)

    def loss(p: Params) -> tuple[jax.Array, dict]:
        logp = completion_logprobs(p, rollout, config)
        return pw.rl.grpo_loss(logp, rollout.behavior_logp, ref_logp, rollout.advantages, rollout.mask,
                               clip_eps=config.clip_eps, kl_coef=config.kl_coef, ratio_cap=config.ratio_cap,
                               prox_logp=jax.lax.stop_gradient(logp) if config.decoupled else None)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, reward=rollout.rewards.mean(), solved=(rollout.rewards == 1.0).mean(),
                   grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics
