"""The PaLM architecture (Chowdhery et al. 2022, section 2) as pure functions over a params pytree.

Parallel blocks ``y = x + Attn(LN(x)) + MLP(LN(x))`` with one bias-free LayerNorm
per block, multi-query attention with rotary embeddings, a SwiGLU MLP, and a
shared input/output embedding whose logits are scaled by 1/sqrt(d_model). No
biases anywhere.

Params are ``{"embed": [V, D], "final_norm": [D], "layers": [layer, ...]}`` with
one flat dict per layer, so ``split_groups`` can cut the stack into the
contiguous groups that the staged backward (``stage_forward``/``stage_backward``)
runs one at a time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from examples.palm.config import PalmConfig

Params = dict
Batch = dict


def _dense(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: jnp.dtype) -> jax.Array:
    """PaLM's fan-in variance scaling: N(0, 1/fan_in)."""
    return jax.random.normal(key, shape, dtype) / math.sqrt(fan_in)


def _init_layer(config: PalmConfig, key: jax.Array) -> dict:
    d, h, q, f = config.d_model, config.n_heads, config.head_dim, config.ffn_dim
    dtype = jnp.dtype(config.dtype)
    kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)
    return {
        "norm": jnp.ones((d,), dtype),
        "q": _dense(kq, (d, h, q), d, dtype),
        "k": _dense(kk, (d, q), d, dtype),
        "v": _dense(kv, (d, q), d, dtype),
        "o": _dense(ko, (h, q, d), h * q, dtype),
        "gate": _dense(kg, (d, f), d, dtype),
        "up": _dense(ku, (d, f), d, dtype),
        "down": _dense(kd, (f, d), f, dtype),
    }


def init_params(config: PalmConfig, key: jax.Array) -> Params:
    """Fresh parameters; the embedding is N(0, 1) because no norm is applied to it (PaLM)."""
    dtype = jnp.dtype(config.dtype)
    keys = jax.random.split(key, config.n_layers + 1)
    return {
        "embed": jax.random.normal(keys[0], (config.vocab_size, config.d_model), dtype),
        "final_norm": jnp.ones((config.d_model,), dtype),
        "layers": [_init_layer(config, k) for k in keys[1:]],
    }


def split_groups(layers: list, config: PalmConfig) -> list[list]:
    """Cut a per-layer list (params, grads or specs) into ``config.layer_groups`` contiguous groups."""
    if len(layers) != config.n_layers:
        raise ValueError(f"expected {config.n_layers} layers, got {len(layers)}")
    return [list(layers[start:stop]) for start, stop in config.group_bounds()]


def layer_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm with a scale and no bias, computed in float32."""
    x32 = x.astype(jnp.float32)
    centered = x32 - x32.mean(axis=-1, keepdims=True)
    normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale


def rope_tables(positions: jax.Array, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [T, head_dim / 2] of the rotary angles at the given token positions [T]."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.sin(angles), jnp.cos(angles)


def _rotate(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary embedding on the last axis (rotate-half layout); sin/cos broadcast over the rest."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def project_qkv(layer: dict, h: jax.Array, positions: jax.Array, config: PalmConfig
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B, T, H, Q], the one rotated key head [B, T, Q] and value head [B, T, Q] of ``h``.

    ``positions`` [T] are the tokens' absolute positions: a decoder that caches keys and values projects
    one new token at a time, at its place in the sequence.
    """
    q = jnp.einsum("btd,dhq->bthq", h, layer["q"])
    k = jnp.einsum("btd,dq->btq", h, layer["k"])
    v = jnp.einsum("btd,dq->btq", h, layer["v"])
    sin, cos = rope_tables(positions, config.head_dim, config.rope_base)
    return _rotate(q, sin[:, None, :], cos[:, None, :]), _rotate(k, sin, cos), v


def attend(layer: dict, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, config: PalmConfig
           ) -> jax.Array:
    """Multi-query attention of queries [B, T, H, Q] over keys/values [B, S, Q], then the output projection.

    ``visible`` [T, S] says which key each query may read (the causal mask, over a cache or not).
    """
    scores = jnp.einsum("bthq,bsq->bhts", q, k).astype(jnp.float32) / math.sqrt(config.head_dim)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bhts,bsq->bthq", probs, v)
    return jnp.einsum("bthq,hqd->btd", out, layer["o"])


def _attention(layer: dict, h: jax.Array, config: PalmConfig) -> jax.Array:
    """Causal multi-query attention: n_heads query heads share one key and one value head."""
    seq_len = h.shape[1]
    q, k, v = project_qkv(layer, h, jnp.arange(seq_len), config)
    return attend(layer, q, k, v, jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool)), config)


def mlp(layer: dict, h: jax.Array) -> jax.Array:
    """SwiGLU: down(swish(h @ gate) * (h @ up))."""
    return (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]


def block(layer: dict, x: jax.Array, config: PalmConfig) -> jax.Array:
    """One parallel block: attention and MLP read the same normalized input."""
    h = layer_norm(x, layer["norm"])
    return x + _attention(layer, h, config) + mlp(layer, h)


def embed_forward(embed: jax.Array, tokens: jax.Array, config: PalmConfig) -> jax.Array:
    """Token ids [B, T] to the residual stream [B, T, D]."""
    return jnp.take(embed, tokens, axis=0).astype(jnp.dtype(config.dtype))


def stage_forward(group: list[dict], x: jax.Array, config: PalmConfig) -> jax.Array:
    """Run one contiguous group of layers on the residual stream."""
    for layer in group:
        x = block(layer, x, config)
    return x


def logits_from_hidden(head: dict, x: jax.Array, config: PalmConfig) -> jax.Array:
    """Final norm, then the shared embedding as output layer, scaled by 1/sqrt(d_model) as in PaLM."""
    h = layer_norm(x, head["final_norm"])
    return jnp.einsum("btd,vd->btv", h, head["embed"]) / math.sqrt(config.d_model)


def forward(params: Params, tokens: jax.Array, config: PalmConfig) -> jax.Array:
    """Logits [B, T, V] for token ids [B, T]."""
    x = embed_forward(params["embed"], tokens, config)
    x = stage_forward(params["layers"], x, config)
    return logits_from_hidden(head_params(params), x, config)


def loss_from_logits(logits: jax.Array, targets: jax.Array, config: PalmConfig) -> tuple[jax.Array, dict]:
    """Mean cross-entropy plus PaLM's z-loss, z_loss * mean(log(Z)^2), which keeps log Z near 0."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    cross_entropy = jnp.mean(log_z - target_logit)
    z_loss = config.z_loss * jnp.mean(log_z * log_z)
    loss = cross_entropy + z_loss
    accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))
    return loss, {"loss": loss, "cross_entropy": cross_entropy, "z_loss": z_loss, "accuracy": accuracy}


def loss_fn(params: Params, batch: Batch, config: PalmConfig) -> tuple[jax.Array, dict]:
    """(loss, metrics) for ``{"inputs": int32[B, T], "targets": int32[B, T]}``."""
    return loss_from_logits(forward(params, batch["inputs"], config), batch["targets"], config)


def head_params(params: Params) -> dict:
    """The parameters the output head reads: the shared embedding and the final norm."""
    return {"embed": params["embed"], "final_norm": params["final_norm"]}


def head_forward_backward(head: dict, x: jax.Array, targets: jax.Array, config: PalmConfig
                          ) -> tuple[dict, dict, jax.Array]:
    """First backward stage: (metrics, head grads, cotangent of the last group's output)."""
    def head_loss(head: dict, x: jax.Array) -> tuple[jax.Array, dict]:
        return loss_from_logits(logits_from_hidden(head, x, config), targets, config)

    loss, vjp, metrics = jax.vjp(head_loss, head, x, has_aux=True)
    head_grads, cotangent = vjp(jnp.ones_like(loss))
    return metrics, head_grads, cotangent


def stage_backward(group: list[dict], x: jax.Array, cotangent: jax.Array, config: PalmConfig
                   ) -> tuple[list[dict], jax.Array]:
    """Gradients of one group, given its input ``x`` and the cotangent of its output.

    Returns (group grads, cotangent of ``x``) for the group before it. The group's
    forward is recomputed from ``x`` so that only group inputs need to be kept
    between stages (this recomputation is what makes HFU exceed MFU).
    """
    _, vjp = jax.vjp(lambda g, h: stage_forward(g, h, config), group, x)
    return vjp(cotangent)


def embed_backward(tokens: jax.Array, cotangent: jax.Array, config: PalmConfig) -> jax.Array:
    """Gradient of the embedding lookup: the cotangent scatter-added into the looked-up rows."""
    flat = cotangent.reshape(-1, config.d_model)
    return jnp.zeros((config.vocab_size, config.d_model), cotangent.dtype).at[tokens.reshape(-1)].add(flat)


def grads_by_group(params: Params, batch: Batch, config: PalmConfig) -> tuple[dict, dict]:
    """Reference composition of the stages: (metrics, grads).

    ``grads`` is ``{"embed", "final_norm", "groups": [group grads, ...]}``. The
    backward produces the head grads first, then groups from last to first, and the
    lookup half of the embedding grad last. ``merge_group_grads`` turns it back
    into the params structure.
    """
    groups = split_groups(params["layers"], config)
    inputs = [embed_forward(params["embed"], batch["inputs"], config)]
    for group in groups:
        inputs.append(stage_forward(group, inputs[-1], config))
    metrics, head_grads, cotangent = head_forward_backward(head_params(params), inputs.pop(), batch["targets"],
                                                           config)
    group_grads: list = [None] * len(groups)
    for g in reversed(range(len(groups))):
        group_grads[g], cotangent = stage_backward(groups[g], inputs[g], cotangent, config)
    embed_grad = head_grads["embed"] + embed_backward(batch["inputs"], cotangent, config)
    return metrics, {"embed": embed_grad, "final_norm": head_grads["final_norm"], "groups": group_grads}


def merge_group_grads(grads: dict) -> Params:
    """Grads from ``grads_by_group`` in the params structure, ready for the optimizer."""
    layers = [layer for group in grads["groups"] for layer in group]
    return {"embed": grads["embed"], "final_norm": grads["final_norm"], "layers": layers}


def param_specs(params: Params, data_axis: str | None = "data", model_axis: str | None = "model") -> Params:
    """PartitionSpecs for the params, in the params structure, following PaLM's in-pod 2D layout.

    Query/output heads and the FFN hidden dim are sharded over ``model_axis``;
    the d_model dim of every kernel is sharded over ``data_axis`` (fully sharded
    data parallelism, as PaLM ran inside a pod; pass ``data_axis=None`` to
    replicate across data instead). The single key/value head of multi-query
    attention cannot be split by heads, so it is sharded over data only. Norm
    scales and the embedding are replicated: a byte vocabulary makes the
    embedding 256·D, too small to be worth a collective in the lookup and logits.
    """
    d, m = data_axis, model_axis
    layer_spec = {
        "norm": P(),
        "q": P(d, m, None),
        "k": P(d, None),
        "v": P(d, None),
        "o": P(m, None, d),
        "gate": P(d, m),
        "up": P(d, m),
        "down": P(m, d),
    }
    return {"embed": P(), "final_norm": P(), "layers": [dict(layer_spec) for _ in params["layers"]]}


def batch_spec(data_axis: str = "data") -> Batch:
    """PartitionSpecs for a batch: the batch dimension split over ``data_axis``."""
    return {"inputs": P(data_axis, None), "targets": P(data_axis, None)}
