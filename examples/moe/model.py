"""The MoE Transformer as ordinary JAX: pure functions over a params pytree, written once.

Pre-LayerNorm decoder blocks (causal multi-head attention, then a feed-forward block); the feed-forward block
of every other layer is a mixture of experts with GShard's top-2 gating (``routing``). Params are
``{"shared": ..., "experts": [per MoE layer {"wi": [E, D, H], "wo": [E, H, D]}]}``: everything but the experts
is "shared" (every island holds a copy), while experts may live anywhere.

The forward pass is cut at each MoE layer's dispatch into **segments**: segment m runs from the previous MoE
layer's combine to MoE layer m's dispatch (the last one to the loss). ``loss`` composes the segments with any
way of running the experts between them (``experts_local``, ``experts_all_to_all`` across the devices of one
island); the cross-island step runs the same segments as separate computations with the experts on other
islands in between. So every run computes the same function of the same parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from examples.moe import routing
from examples.moe.config import MoeConfig
from examples.moe.routing import Table

Params = dict


def _normal(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: Any) -> jax.Array:
    return jax.random.normal(key, shape, dtype) / math.sqrt(fan_in)


def init_params(config: MoeConfig, key: jax.Array) -> Params:
    """Fresh parameters (fan-in scaled normals, unit norms, a zero router bias)."""
    d, dtype = config.d_model, jnp.dtype(config.dtype)
    keys = iter(jax.random.split(key, 4 * config.n_layers + 2))
    layers, experts = [], []
    for layer in range(config.n_layers):
        p = {"ln1": jnp.ones((d,), dtype), "qkv": _normal(next(keys), (d, 3 * d), d, dtype),
             "o": _normal(next(keys), (d, d), d, dtype), "ln2": jnp.ones((d,), dtype)}
        if layer in config.moe_layers:
            p["router"] = _normal(next(keys), (d, config.n_experts), d, dtype)
            p["router_bias"] = jnp.zeros((config.n_experts,), dtype)
            e, h = config.n_experts, config.expert_dim
            ki, ko = jax.random.split(next(keys))
            experts.append({"wi": _normal(ki, (e, d, h), d, dtype), "wo": _normal(ko, (e, h, d), h, dtype)})
        else:
            p["wi"] = _normal(next(keys), (d, config.ffn_dim), d, dtype)
            p["wo"] = _normal(next(keys), (config.ffn_dim, d), config.ffn_dim, dtype)
        layers.append(p)
    shared = {"embed": jax.random.normal(next(keys), (config.vocab_size, d), dtype),
              "pos": 0.02 * jax.random.normal(next(keys), (config.seq_len, d), dtype),
              "final_norm": jnp.ones((d,), dtype), "layers": layers}
    return {"shared": shared, "experts": experts}


def layer_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    centered = x32 - x32.mean(axis=-1, keepdims=True)
    normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale


def attention(layer: dict, x: jax.Array, config: MoeConfig) -> jax.Array:
    """x + causal multi-head self-attention of LN(x)."""
    b, t, d = x.shape
    heads, head_dim = config.n_heads, d // config.n_heads
    q, k, v = jnp.split(layer_norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, head_dim) for a in (q, k, v))
    scores = jnp.einsum("bthq,bshq->bhts", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(x.dtype)
    return x + jnp.einsum("bhts,bshq->bthq", probs, v).reshape(b, t, d) @ layer["o"]


def ffn(w: dict, x: jax.Array) -> jax.Array:
    """The feed-forward block of a dense layer and of every expert: gelu(x @ wi) @ wo."""
    return jax.nn.gelu(x @ w["wi"]) @ w["wo"]


def dense_layer(layer: dict, x: jax.Array, config: MoeConfig) -> jax.Array:
    x = attention(layer, x, config)
    return x + ffn(layer, layer_norm(x, layer["ln2"]))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Gate:
    """What an MoE layer's dispatch hands to its combine: the combine weights [G, S, F] (differentiable, they
    carry the router's gradient) and the statistics."""

    combine: jax.Array
    aux: jax.Array
    demand: jax.Array
    kept: jax.Array


def segment_bounds(config: MoeConfig, m: int) -> tuple[int, int]:
    """Dense layers [start, stop) that segment ``m`` runs before its MoE layer's dispatch (or the head)."""
    moe = config.moe_layers
    start = moe[m - 1] + 1 if m else 0
    stop = moe[m] if m < len(moe) else config.n_layers
    return start, stop


def dispatch_into(shared: Params, x: jax.Array, m: int, config: MoeConfig, table: Table) -> tuple:
    """Segment ``m``'s end: MoE layer m's attention and gating; (x, gate, dispatched tokens [G, F, D])."""
    layer = shared["layers"][config.moe_layers[m]]
    x = attention(layer, x, config)
    h = layer_norm(x, layer["ln2"])
    r = routing.route(h @ layer["router"] + layer["router_bias"], table)
    return x, Gate(r.combine, r.aux, r.demand, r.kept), routing.dispatch(h, r)


def combine_from(x: jax.Array, gate: Gate, expert_out: jax.Array) -> jax.Array:
    """The next segment's start: the residual plus the gated expert outputs (dropped tokens get nothing)."""
    return x + jnp.einsum("gsf,gfd->gsd", gate.combine.astype(expert_out.dtype), expert_out)


def run_dense(shared: Params, x: jax.Array, m: int, config: MoeConfig) -> jax.Array:
    start, stop = segment_bounds(config, m)
    for layer in shared["layers"][start:stop]:
        x = dense_layer(layer, x, config)
    return x


def embed(shared: Params, tokens: jax.Array, config: MoeConfig) -> jax.Array:
    return jnp.take(shared["embed"], tokens, axis=0).astype(jnp.dtype(config.dtype)) + shared["pos"][:tokens.shape[1]]


def head(shared: Params, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and accuracy of the shared-embedding logits (scaled by 1/sqrt(D), as PaLM's)."""
    logits = (layer_norm(x, shared["final_norm"]) @ shared["embed"].T).astype(jnp.float32) / math.sqrt(x.shape[-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return ce, jnp.mean(jnp.argmax(logits, axis=-1) == targets)


def total_loss(ce: jax.Array, aux_sum: jax.Array, config: MoeConfig) -> jax.Array:
    """Cross-entropy plus the balancing loss, averaged over the MoE layers, at its weight."""
    n = max(1, len(config.moe_layers))
    return ce + config.aux_weight * aux_sum / n


# (MoE layer m's expert weights, m, its dispatched tokens [G, F, D]) -> the experts' outputs [G, F, D]
ExpertsFn = Callable[[dict, int, jax.Array], jax.Array]


def loss(params: Params, batch: dict, config: MoeConfig, tables: list[Table], experts_fn: ExpertsFn
         ) -> tuple[jax.Array, dict]:
    """The training loss and its metrics, with MoE layer m's experts run by ``experts_fn(weights, m, dispatched)``.

    Metrics: loss, cross-entropy, aux (summed over MoE layers), accuracy, and per MoE layer the experts'
    ``demand`` and ``kept`` token counts [M, E].
    """
    shared = params["shared"]
    x = embed(shared, batch["inputs"], config)
    aux_sum, demand, kept = jnp.float32(0.0), [], []
    for m in range(len(config.moe_layers)):
        x, gate, sent = dispatch_into(shared, run_dense(shared, x, m, config), m, config, tables[m])
        x = combine_from(x, gate, experts_fn(params["experts"][m], m, sent))
        aux_sum, demand, kept = aux_sum + gate.aux, demand + [gate.demand], kept + [gate.kept]
    ce, accuracy = head(shared, run_dense(shared, x, len(config.moe_layers), config), batch["targets"])
    value = total_loss(ce, aux_sum, config)
    return value, {"loss": value, "cross_entropy": ce, "aux": aux_sum, "accuracy": accuracy,
                   "demand": _stack(demand, config), "kept": _stack(kept, config)}


def _stack(counts: list, config: MoeConfig) -> jax.Array:
    return jnp.stack(counts) if counts else jnp.zeros((0, max(1, config.n_experts)), jnp.int32)


def experts_table(experts: dict, sent: jax.Array, table: Table) -> jax.Array:
    """Every expert on this device: expert e's FFN on positions ``table.offset[e]`` onward, ``table.cap[e]`` of them."""
    out = jnp.zeros_like(sent)
    for e, (start, cap) in enumerate(zip(table.offset, table.cap)):
        w = jax.tree.map(lambda a, e=e: a[e], experts)
        out = out.at[:, start:start + cap].set(ffn(w, sent[:, start:start + cap]))
    return out


def experts_local(tables: list[Table]) -> ExpertsFn:
    """Run MoE layer m's experts where the tokens are (one device, or GSPMD's choice)."""
    return lambda weights, m, sent: experts_table(weights, sent, tables[m])


def experts_all_to_all(config: MoeConfig, axis: str) -> ExpertsFn:
    """Expert parallelism inside one island: experts and groups both split over mesh axis ``axis``.

    Each device dispatches its own groups to every expert (GShard's uniform [E, C] layout), one all-to-all
    hands each device the tokens of its experts from every device, the device runs its experts, and a second
    all-to-all returns the outputs to the devices whose groups they belong to.
    """
    e, c = config.n_experts, config.capacity

    def local(w: dict, sent: jax.Array) -> jax.Array:
        g, _, d = sent.shape
        by_expert = jax.lax.all_to_all(sent.reshape(g, e, c, d), axis, split_axis=1, concat_axis=0, tiled=True)
        out = jax.vmap(ffn, in_axes=(0, 1), out_axes=1)(w, by_expert)  # [G_all, E_local, C, D]
        back = jax.lax.all_to_all(out, axis, split_axis=0, concat_axis=1, tiled=True)
        return back.reshape(g, e * c, d)

    def run(weights: dict, m: int, sent: jax.Array) -> jax.Array:
        mesh = jax.typeof(sent).sharding.mesh
        return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=P(axis),
                             check_vma=False)(weights, sent)

    return run


def uniform_tables(config: MoeConfig) -> list[Table]:
    """GShard's layout for every MoE layer: each expert ``config.capacity`` positions, in expert order."""
    return [Table.uniform(config.n_experts, config.capacity) for _ in config.moe_layers]


def count_params(tree: Any) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree)))
