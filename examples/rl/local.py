"""GRPO on the sorting task in one process, plain JAX on the local devices (no runtime):

    python -m examples.rl.local --steps 300

Each step samples a rollout with the current weights and trains on it (on-policy; ``--staleness k`` samples
with the weights of k steps before, as an asynchronous sampler would). Prints the
mean reward (fraction of answer digits in place) and the fraction solved exactly as training goes, a few
greedy samples at the end, and the reward before and after. The sorting task starts from scratch: a fresh
policy places few digits (3% of them with seed 0); no supervised warm start.
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import numpy as np

from examples.rl import model, step
from examples.rl.task import Task


def evaluate(params: model.Params, key: jax.Array, task: Task, config: model.Config, n: int) -> float:
    """Mean reward of greedy completions of ``n`` fresh prompts."""
    prompts, answers = task.prompts(key, n)
    tokens, _ = _generate(params, prompts, key, config, task.answer_len, 0.0)
    return float(task.reward(tokens[:, task.prompt_len:], answers).mean())


_generate = jax.jit(model.generate, static_argnames=("config", "max_new", "temperature"))
_sample = jax.jit(step.sample_step, static_argnames=("task", "config", "group_size", "n_prompts"))
_train = jax.jit(step.train_step, static_argnames=("config", "optimizer"))


def run(config: model.Config, task: Task, steps: int, n_prompts: int, group_size: int, seed: int,
        staleness: int = 0, log_every: int = 25) -> dict:
    """Train for ``steps`` from a fresh policy; return the rewards before and after, the seconds and the params.

    With ``staleness`` k, step i trains on a rollout sampled with the weights of version max(0, i - k), as an
    asynchronous sampler k versions behind would produce it; the loss corrects for the lag through the
    rollout's behavior log-probs.

    ``reward_before`` is the mean reward of the first rollout (sampled by the fresh policy), ``reward_after`` the
    mean over the last ``log_every`` rollouts; ``greedy_*`` score greedy completions of the same 256 prompts.
    """
    key = jax.random.key(seed)
    init_key, eval_key, key = jax.random.split(key, 3)
    params = model.init(config, init_key)
    ref_params = params
    optimizer = step.optimizer(config)
    opt_state = optimizer.init(params)
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    greedy_before = evaluate(params, eval_key, task, config, 256)
    versions = collections.deque([params], maxlen=staleness + 1)  # versions[0] is max(0, i - staleness)
    history = []
    start = time.perf_counter()
    for i in range(steps):
        version = max(0, i - staleness)
        rollout = _sample(versions[0], jax.random.fold_in(key, i), task, config, group_size, n_prompts, version)
        params, opt_state, metrics = _train(params, opt_state, ref_params, rollout, config, optimizer)
        versions.append(params)
        history.append({k: float(v) for k, v in metrics.items()})
        if i % log_every == 0 or i == steps - 1:
            recent = history[-log_every:]
            print(f"step {i:4d}  reward {np.mean([h['reward'] for h in recent]):.3f}  "
                  f"solved {np.mean([h['solved'] for h in recent]):.3f}  kl {metrics['kl']:.4f}  "
                  f"clip {metrics['clip_fraction']:.3f}  {time.perf_counter() - start:6.1f}s", flush=True)
    seconds = time.perf_counter() - start
    return {
        "reward_before": history[0]["reward"],
        "reward_after": float(np.mean([h["reward"] for h in history[-log_every:]])),
        "solved_after": float(np.mean([h["solved"] for h in history[-log_every:]])),
        "greedy_before": greedy_before,
        "greedy_after": evaluate(params, eval_key, task, config, 256),
        "seconds": seconds,
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="sort", choices=sorted(model.CONFIGS))
    parser.add_argument("--length", type=int, default=5, help="digits to sort")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=0, help="train on rollouts sampled this many versions ago")
    args = parser.parse_args()
    task = Task(length=args.length)
    config = model.CONFIGS[args.config]
    result = run(config, task, args.steps, args.prompts, args.group, args.seed, args.staleness)
    prompts, _ = task.prompts(jax.random.key(args.seed + 1), 4)
    tokens, _ = _generate(result["params"], prompts, jax.random.key(0), config, task.answer_len, 0.0)
    for row in tokens:
        print("  ", task.decode(row))
    print(f"reward {result['reward_before']:.3f} -> {result['reward_after']:.3f} (solved exactly "
          f"{result['solved_after']:.3f}; greedy {result['greedy_before']:.3f} -> {result['greedy_after']:.3f}) "
          f"in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
