"""The RL policy: the PaLM decoder of ``examples/palm``, with KV-cached sampling and per-token log-probs.

The architecture, its parameters and its full-sequence forward are ``examples.palm.model``'s, unchanged. What
RL adds is beside it: ``generate`` samples completions one token at a time, reading the keys and values of
earlier tokens from a cache instead of recomputing them (multi-query attention keeps that cache small: one
key and one value head per layer), and ``token_logprobs`` scores given tokens under teacher forcing, which the
trainer differentiates. Both are pure JAX on static shapes; ``param_specs`` (tensor parallel, for a sampler)
and ``fsdp_specs`` (fully sharded data parallel, for a trainer) lay the same params out on a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from examples.palm import model as palm
from examples.palm.config import PalmConfig

Params = dict


@dataclass(frozen=True)
class Config(PalmConfig):
    """A PaLM decoder's shapes plus GRPO's hyperparameters (hashable: a static jit argument).

    ``clip_eps``, ``kl_coef`` and ``ratio_cap`` go to ``pw.rl.grpo_loss``; ``learning_rate`` to the trainer's
    Adam; ``temperature`` is the sampling temperature, which the trainer's log-probs use too so that its ratio
    compares the same distributions the sampler drew from. ``decoupled`` selects ``grpo_loss``'s decoupled form
    for stale rollouts: the clip around the weights the step starts from (one update per rollout), the
    staleness corrected by the truncated importance weight ``min(pi_start / pi_behavior, ratio_cap)``.
    """

    clip_eps: float = 0.2
    kl_coef: float = 0.01
    ratio_cap: float | None = 3.0
    learning_rate: float = 2e-3
    temperature: float = 1.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.temperature > 0.0:
            raise ValueError(f"Config.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not self.learning_rate > 0.0:
            raise ValueError(f"Config.learning_rate must be > 0, got {self.learning_rate}")


# The sorting task (examples/rl/task.py, 5 digits) has a vocabulary of 12 and sequences of 7 + 5 tokens.
#   tiny  -- unit tests: compiles and runs in a second on CPU
#   sort  -- learns the task with GRPO from scratch within minutes on 2 CPU cores (python -m examples.rl.local)
CONFIGS: dict[str, Config] = {
    "tiny": Config(d_model=32, n_layers=2, n_heads=2, head_dim=16, ffn_dim=64, seq_len=12, vocab_size=12),
    "sort": Config(d_model=64, n_layers=2, n_heads=4, head_dim=16, ffn_dim=256, seq_len=12, vocab_size=12),
}


def init(config: PalmConfig, key: jax.Array) -> Params:
    """Fresh policy parameters (``examples.palm.model.init_params``)."""
    return palm.init_params(config, key)


def token_logprobs(params: Params, tokens: jax.Array, config: PalmConfig, temperature: float = 1.0) -> jax.Array:
    """float32 [B, T-1]: log-prob of ``tokens[:, 1:]`` given the tokens before each (teacher forcing).

    At ``temperature`` the distribution is softmax(logits / temperature), the one ``generate`` samples from.
    """
    logits = palm.forward(params, tokens[:, :-1], config).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def _cached_block(layer: dict, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array,
                  config: PalmConfig) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``palm.block`` for the tokens at positions ``pos .. pos+t-1``, reading earlier keys/values from the cache.

    Writes this chunk's key and value into the cache [B, L, Q] at ``pos`` and attends over the whole cache with
    a causal mask by absolute position, so entries not yet written are never read.
    """
    h = palm.layer_norm(x, layer["norm"])
    positions = pos + jnp.arange(x.shape[1])
    q, k, v = palm.project_qkv(layer, h, positions, config)
    keys = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, axis=1)
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]
    out = palm.attend(layer, q, keys, values, visible, config)
    return x + out + palm.mlp(layer, h), (keys, values)


def init_cache(config: PalmConfig, batch: int, length: int) -> list[tuple[jax.Array, jax.Array]]:
    """An empty KV cache: per layer, (keys, values) [batch, length, head_dim] of the one shared head."""
    shape, dtype = (batch, length, config.head_dim), jnp.dtype(config.dtype)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.n_layers)]


def cached_forward(params: Params, tokens: jax.Array, cache: list, pos: jax.Array | int, config: PalmConfig
                   ) -> tuple[jax.Array, list]:
    """Logits [B, t, V] of a chunk of tokens [B, t] at positions ``pos .. pos+t-1``, and the updated cache.

    The cache must hold the keys and values of positions ``0 .. pos-1`` (written by earlier calls); the
    logits are then those of ``palm.forward`` over the whole sequence at these positions.
    """
    x = palm.embed_forward(params["embed"], tokens, config)
    updated = []
    for layer, entry in zip(params["layers"], cache):
        x, entry = _cached_block(layer, x, entry, jnp.asarray(pos, jnp.int32), config)
        updated.append(entry)
    return palm.logits_from_hidden(palm.head_params(params), x, config), updated


def _draw(logits: jax.Array, key: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """One token per row from logits [B, V] and its log-prob under the distribution it was drawn from.

    ``temperature == 0`` is greedy decoding; its log-prob is then the temperature-1 one.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        token = jnp.argmax(logits, axis=-1)
    else:
        logits = logits / temperature
        token = jax.random.categorical(key, logits, axis=-1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def generate(params: Params, prompts: jax.Array, key: jax.Array, config: PalmConfig, max_new: int,
             temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Sample ``max_new`` tokens after each prompt: (tokens int32 [B, P + max_new], logprobs float32 [B, max_new]).

    Prompts share one length P (no padding). One forward over them fills the KV cache, then a
    ``lax.fori_loop`` draws one token per step and runs only that token through the model. The cache is a
    value inside this function (``kv_cache_bytes(config, B, P + max_new - 1)``), so it is freed when
    generation returns. ``logprobs`` are
    the log-probs of the drawn tokens under softmax(logits / temperature); ``temperature=0`` decodes greedily.
    jit with ``config``, ``max_new`` and ``temperature`` static.
    """
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts must be integer token ids [B, P], got {prompts.dtype} {prompts.shape}")
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new must be a positive int, got {max_new!r}")
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    batch, prompt_len = prompts.shape
    prompts = prompts.astype(jnp.int32)
    length = prompt_len + max_new - 1  # the last drawn token is never fed back, so never cached
    logits, cache = cached_forward(params, prompts, init_cache(config, batch, length), 0, config)
    tokens = jnp.concatenate([prompts, jnp.zeros((batch, max_new), jnp.int32)], axis=1)
    logprobs = jnp.zeros((batch, max_new), jnp.float32)

    def draw_into(i: jax.Array, last: jax.Array, tokens: jax.Array, logprobs: jax.Array):
        token, logp = _draw(last, jax.random.fold_in(key, i), temperature)
        return token, tokens.at[:, prompt_len + i].set(token), logprobs.at[:, i].set(logp)

    def step(i: jax.Array, carry: tuple) -> tuple:
        last, cache, tokens, logprobs = carry
        token, tokens, logprobs = draw_into(i, last, tokens, logprobs)
        logits, cache = cached_forward(params, token[:, None], cache, prompt_len + i, config)
        return logits[:, 0], cache, tokens, logprobs

    last, _, tokens, logprobs = jax.lax.fori_loop(0, max_new - 1, step, (logits[:, -1], cache, tokens, logprobs))
    _, tokens, logprobs = draw_into(jnp.int32(max_new - 1), last, tokens, logprobs)
    return tokens, logprobs


def kv_cache_bytes(config: PalmConfig, batch: int, length: int) -> int:
    """Bytes of the KV cache for ``batch`` sequences of ``length`` cached positions: one key and one value head
    per layer (multi-query attention), ``head_dim`` wide."""
    return 2 * config.n_layers * batch * length * config.head_dim * jnp.dtype(config.dtype).itemsize


def param_specs(config: PalmConfig, mesh_axis: str) -> Params:
    """Tensor-parallel PartitionSpecs for a sampler: query/output heads and the MLP hidden dim split over
    ``mesh_axis``; the one key/value head, the norms and the embedding replicated (PaLM's in-pod layout without
    its data axis). ``n_heads`` and ``ffn_dim`` must divide by the axis size."""
    return palm.param_specs({"layers": [None] * config.n_layers}, data_axis=None, model_axis=mesh_axis)


def fsdp_specs(config: PalmConfig, mesh_axis: str) -> Params:
    """Fully-sharded data-parallel PartitionSpecs for a trainer: the d_model dim of every kernel split over
    ``mesh_axis`` (the batch goes over the same axis, ``batch_spec``); norms and the small embedding replicated.
    ``d_model`` must divide by the axis size."""
    return palm.param_specs({"layers": [None] * config.n_layers}, data_axis=mesh_axis, model_axis=None)


def batch_spec(mesh_axis: str) -> P:
    """The PartitionSpec of a batch's leading (sequence) dim for data parallelism over ``mesh_axis``."""
    return P(mesh_axis)

