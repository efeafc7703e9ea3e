"""The RL example's verifiable task (examples/rl/task.py): prompts, exact rewards, decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.rl.task import Task

TASK = Task(length=5)


def test_prompts_are_start_digits_separator_and_answers_are_the_digits_sorted() -> None:
    prompts, answers = jax.jit(TASK.prompts, static_argnums=1)(jax.random.key(0), 64)
    assert prompts.shape == (64, 7) and answers.shape == (64, 5)
    assert prompts.dtype == answers.dtype == jnp.int32
    prompts, answers = np.asarray(prompts), np.asarray(answers)
    assert (prompts[:, 0] == TASK.start).all() and (prompts[:, -1] == TASK.separator).all()
    assert ((0 <= prompts[:, 1:-1]) & (prompts[:, 1:-1] < 10)).all()
    np.testing.assert_array_equal(answers, np.sort(prompts[:, 1:-1], axis=1))
    assert len({tuple(row) for row in prompts}) > 60  # fresh draws, not one prompt repeated


def test_reward_is_the_fraction_of_positions_in_place() -> None:
    answers = jnp.array([[1, 1, 3, 5, 8]] * 4, jnp.int32)
    completions = jnp.array([
        [1, 1, 3, 5, 8],  # sorted: full credit
        [1, 1, 3, 5, 9],  # one digit wrong
        [8, 5, 3, 1, 1],  # reversed: only the middle one is in place
        [11, 10, 0, 2, 4],  # markers and wrong digits: nothing
    ], jnp.int32)
    rewards = jax.jit(TASK.reward)(completions, answers)
    assert rewards.dtype == jnp.float32
    np.testing.assert_array_equal(rewards, np.array([1.0, 0.8, 0.2, 0.0], np.float32))


def test_decode_prints_the_symbols() -> None:
    assert TASK.decode(jnp.array([10, 5, 3, 1, 8, 1, 11, 1, 1, 3, 5, 8])) == "^53181=11358"
    assert TASK.decode(np.array([12, 0])) == "?0"
    with pytest.raises(ValueError, match="one row of tokens"):
        TASK.decode(np.zeros((2, 3), np.int32))


def test_bad_shapes_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[n, 5\]"):
        TASK.reward(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="Task.length"):
        Task(length=0)
    with pytest.raises(ValueError, match="Task.digits"):
        Task(digits=11)
    assert (Task(length=3, digits=4).vocab_size, Task(length=3).prompt_len) == (6, 5)
