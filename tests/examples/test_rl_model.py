"""The RL policy (examples/rl/model.py): KV-cached generation against the no-cache forward, log-probs, shardings.

CPU only; the sharded cases use 2 of the process's simulated CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.palm import model as palm
from examples.rl import model
from examples.rl.task import Task

TINY = model.CONFIGS["tiny"]
TASK = Task()

_generate = jax.jit(model.generate, static_argnames=("config", "max_new", "temperature"))
_forward = jax.jit(palm.forward, static_argnames="config")
_token_logprobs = jax.jit(model.token_logprobs, static_argnames=("config", "temperature"))
_cached_forward = jax.jit(model.cached_forward, static_argnames="config")


@pytest.fixture(scope="module")
def params() -> dict:
    return jax.jit(model.init, static_argnums=0)(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts() -> jax.Array:
    return TASK.prompts(jax.random.key(1), 6)[0]


def test_the_cache_gives_the_no_cache_logits_at_every_position(params: dict, prompts: jax.Array) -> None:
    tokens = jnp.concatenate([prompts, jax.random.randint(jax.random.key(2), (6, 5), 0, TINY.vocab_size)], axis=1)
    expected = _forward(params, tokens, TINY)
    prompt_len = prompts.shape[1]
    logits, cache = _cached_forward(params, prompts, model.init_cache(TINY, 6, tokens.shape[1]), 0, TINY)
    chunks = [logits]
    for pos in range(prompt_len, tokens.shape[1]):  # then one token at a time, as generation feeds them
        logits, cache = _cached_forward(params, tokens[:, pos:pos + 1], cache, pos, TINY)
        chunks.append(logits)
    np.testing.assert_allclose(jnp.concatenate(chunks, axis=1), expected, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_step_by_step_argmax_without_a_cache(params: dict, prompts: jax.Array) -> None:
    tokens, logprobs = _generate(params, prompts, jax.random.key(3), TINY, 5, 0.0)
    assert tokens.shape == (6, prompts.shape[1] + 5) and tokens.dtype == jnp.int32
    assert logprobs.shape == (6, 5) and logprobs.dtype == jnp.float32
    expected = prompts
    for _ in range(5):
        logits = _forward(params, expected, TINY)
        expected = jnp.concatenate([expected, jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)], 1)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(tokens[:, :prompts.shape[1]], prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generated_logprobs_are_the_teacher_forced_ones(params: dict, prompts: jax.Array, temperature: float) -> None:
    tokens, logprobs = _generate(params, prompts, jax.random.key(4), TINY, 5, temperature)
    scored = _token_logprobs(params, tokens, TINY, temperature)
    assert scored.shape == (6, tokens.shape[1] - 1) and scored.dtype == jnp.float32
    np.testing.assert_allclose(scored[:, -5:], logprobs, rtol=1e-5, atol=1e-5)
    assert (logprobs < 0).all()


def test_sampling_draws_from_the_policy_and_is_fixed_by_the_key(params: dict, prompts: jax.Array) -> None:
    batch = jnp.repeat(prompts[:1], 4000, axis=0)
    tokens, _ = _generate(params, batch, jax.random.key(5), TINY, 1, 1.0)
    probs = jax.nn.softmax(_forward(params, prompts[:1], TINY)[0, -1])
    counts = np.bincount(np.asarray(tokens[:, -1]), minlength=TINY.vocab_size) / 4000
    np.testing.assert_allclose(counts, probs, atol=0.03)  # 4000 draws: a few standard errors
    again, _ = _generate(params, batch[:8], jax.random.key(5), TINY, 3, 1.0)
    np.testing.assert_array_equal(again, _generate(params, batch[:8], jax.random.key(5), TINY, 3, 1.0)[0])


def test_generation_under_tensor_parallel_specs_matches_the_unsharded_policy(params: dict, prompts: jax.Array) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    specs = model.param_specs(TINY, "model")
    assert specs["layers"][0]["q"] == P(None, "model", None) and specs["layers"][0]["down"] == P("model", None)
    sharded = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    tokens, logprobs = _generate(sharded, prompts, jax.random.key(6), TINY, 5, 1.0)
    expected_tokens, expected_logprobs = _generate(params, prompts, jax.random.key(6), TINY, 5, 1.0)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_allclose(logprobs, expected_logprobs, rtol=1e-5, atol=1e-5)


def test_fsdp_specs_shard_d_model_and_give_the_same_logprobs(params: dict, prompts: jax.Array) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    specs = model.fsdp_specs(TINY, "data")
    assert specs["layers"][0]["q"] == P("data", None, None) and specs["layers"][0]["down"] == P(None, "data")
    sharded = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    tokens = jax.device_put(jnp.tile(prompts, (2, 1)), NamedSharding(mesh, model.batch_spec("data")))
    np.testing.assert_allclose(_token_logprobs(sharded, tokens, TINY), _token_logprobs(params, tokens, TINY),
                               rtol=1e-5, atol=1e-5)


def test_kv_cache_bytes_counts_the_cache_generation_holds() -> None:
    cache = model.init_cache(TINY, 3, 11)
    assert model.kv_cache_bytes(TINY, 3, 11) == sum(k.nbytes + v.nbytes for k, v in cache)
    assert model.kv_cache_bytes(TINY, 3, 11) == 2 * TINY.n_layers * 3 * 11 * TINY.head_dim * 4


def test_bad_generation_arguments_are_refused(params: dict, prompts: jax.Array) -> None:
    with pytest.raises(ValueError, match="max_new must be a positive int"):
        model.generate(params, prompts, jax.random.key(0), TINY, 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(params, prompts, jax.random.key(0), TINY, 2, -1.0)
    with pytest.raises(ValueError, match=r"integer token ids \[B, P\]"):
        model.generate(params, prompts[0], jax.random.key(0), TINY, 2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        model.Config(d_model=8, n_layers=1, n_heads=1, head_dim=8, ffn_dim=8, seq_len=4, temperature=0.0)
