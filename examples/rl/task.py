"""A verifiable task: sort a short list of digits.

A prompt is ``^`` then ``length`` random digits then ``=``; the answer is the same digits in ascending order,
exactly ``length`` tokens (so every completion has one fixed shape and needs no stop token):

    ^53181=11358

The vocabulary is the digits plus the two markers. Generation, scoring and decoding are pure ``jnp`` on fixed
shapes, so prompts and rewards are made and checked inside the jitted sampler step, on the sampler's devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

START = "^"
SEPARATOR = "="


@dataclass(frozen=True)
class Task:
    """Sorting ``length`` digits drawn uniformly from ``0 .. digits-1`` (hashable: a static jit argument)."""

    length: int = 5
    digits: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"Task.length must be a positive int, got {self.length!r}")
        if not isinstance(self.digits, int) or not 2 <= self.digits <= 10:
            raise ValueError(f"Task.digits must be an int in [2, 10], got {self.digits!r}")

    @property
    def start(self) -> int:
        """Token id of ``^``, which opens every prompt."""
        return self.digits

    @property
    def separator(self) -> int:
        """Token id of ``=``, which ends every prompt."""
        return self.digits + 1

    @property
    def vocab_size(self) -> int:
        return self.digits + 2

    @property
    def prompt_len(self) -> int:
        return self.length + 2

    @property
    def answer_len(self) -> int:
        return self.length

    def prompts(self, key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
        """``n`` fresh prompts int32 [n, prompt_len] and their answers int32 [n, answer_len]."""
        values = jax.random.randint(key, (n, self.length), 0, self.digits, dtype=jnp.int32)
        start = jnp.full((n, 1), self.start, jnp.int32)
        separator = jnp.full((n, 1), self.separator, jnp.int32)
        return jnp.concatenate([start, values, separator], axis=1), jnp.sort(values, axis=1)

    def reward(self, completions: jax.Array, answers: jax.Array) -> jax.Array:
        """float32 [n]: the fraction of answer positions the completion gets right.

        Partial credit, not exact match: a policy that has learned nothing still matches about one position in
        ``vocab_size``, so the completions of one prompt score differently from the first step and GRPO's
        group-relative advantages carry signal at once; an exact-match reward is almost always 0 for such a
        policy (about ``vocab_size ** -length``) and gives no gradient until a lucky group. A fully sorted
        answer, and only that, scores 1.
        """
        if completions.shape != answers.shape or completions.ndim != 2 or completions.shape[1] != self.answer_len:
            raise ValueError(f"completions and answers must both be [n, {self.answer_len}], got "
                             f"{completions.shape} and {answers.shape}: generate answer_len tokens per prompt")
        return jnp.mean((completions == answers).astype(jnp.float32), axis=1)

    def decode(self, tokens: jax.Array | np.ndarray) -> str:
        """The text of one token row [T], prompt and completion alike; unknown ids print as ``?``."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"decode takes one row of tokens [T], got shape {tokens.shape}: decode rows one by one")
        symbols = [str(d) for d in range(self.digits)] + [START, SEPARATOR]
        return "".join(symbols[t] if 0 <= t < len(symbols) else "?" for t in tokens.tolist())
