"""GShard's top-2 gating with a capacity, as dispatch and combine tensors over a flat capacity axis.

Tokens are grouped (a group is one sequence, ``S`` tokens). In each group a token picks its two highest-gated
experts; each expert takes the group's tokens in order, first choices before second choices, up to its
capacity, and drops the rest (a token whose both choices were dropped passes through the layer on the
residual). The kept tokens are laid out on one flat capacity axis of ``F`` positions: expert ``e`` owns the
positions ``offset[e] : offset[e] + cap[e]`` (GShard's ``[E, C]`` when every expert has capacity ``C`` and
``offset[e] = e * C``). Where the experts live only changes that table (``placement.Placement.table``), never
this code.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Table:
    """Where each expert's tokens go on the flat capacity axis, for the groups of one island.

    ``offset[e]`` is the first position of expert ``e``'s copy that these groups use and ``cap[e]`` its
    capacity per group; ``width`` is the axis's length (F).
    """

    offset: tuple[int, ...]
    cap: tuple[int, ...]
    width: int

    @classmethod
    def uniform(cls, n_experts: int, capacity: int) -> Table:
        """GShard's layout: every expert ``capacity`` positions, in expert order."""
        return cls(tuple(e * capacity for e in range(n_experts)), (capacity,) * n_experts, n_experts * capacity)

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.cap):
            raise ValueError(f"offset has {len(self.offset)} experts and cap {len(self.cap)}")
        for e, (o, c) in enumerate(zip(self.offset, self.cap)):
            if c < 1 or o < 0 or o + c > self.width:
                raise ValueError(f"expert {e}'s positions [{o}, {o + c}) do not lie in a capacity axis of "
                                 f"{self.width}: every expert needs a capacity of at least 1 inside the axis")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    """One layer's routing of a batch of groups ``[G, S]``.

    ``combine[g, s, f]`` is the gate weight with which token s of group g reads position f's expert output
    (zero where it was not sent there); ``dispatch`` is 1 where it was sent. ``aux`` is GShard's balancing
    loss (mean over groups), ``demand[e]`` how many choices went to expert e before capacity, ``kept[e]``
    how many it took.
    """

    combine: jax.Array
    dispatch: jax.Array
    aux: jax.Array
    demand: jax.Array
    kept: jax.Array


def route(logits: jax.Array, table: Table) -> Routing:
    """Top-2 gating of ``logits`` [G, S, E] (float32 inside) onto ``table``'s capacity axis."""
    n_experts = logits.shape[-1]
    if n_experts != len(table.cap):
        raise ValueError(f"the router has {n_experts} experts and the table {len(table.cap)}")
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    first = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(first, n_experts, dtype=jnp.float32)
    second = jnp.argmax(gates * (1.0 - mask1), axis=-1)
    mask2 = jax.nn.one_hot(second, n_experts, dtype=jnp.float32)

    # GShard's auxiliary loss: E * sum_e (mean gate of e) * (fraction of first choices that are e), per group.
    aux = jnp.mean(n_experts * jnp.sum(jnp.mean(gates, axis=1) * jnp.mean(mask1, axis=1), axis=-1))

    # Each token's rank among its expert's tokens in the group: first choices, then second choices.
    rank1 = jnp.sum((jnp.cumsum(mask1, axis=1) - 1.0) * mask1, axis=-1)
    rank2 = jnp.sum((jnp.cumsum(mask2, axis=1) - 1.0 + jnp.sum(mask1, axis=1, keepdims=True)) * mask2, axis=-1)
    offset, cap = jnp.asarray(np.array(table.offset, np.int32)), jnp.asarray(np.array(table.cap, np.int32))
    rank1, rank2 = rank1.astype(jnp.int32), rank2.astype(jnp.int32)
    kept1 = rank1 < cap[first]
    kept2 = rank2 < cap[second]

    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    norm = gate1 + gate2
    gate1, gate2 = gate1 / norm, gate2 / norm

    # A dropped choice points at no position (one_hot of -1 is all zeros).
    pos1 = jnp.where(kept1, offset[first] + rank1, -1)
    pos2 = jnp.where(kept2, offset[second] + rank2, -1)
    hot1 = jax.nn.one_hot(pos1, table.width, dtype=jnp.float32)
    hot2 = jax.nn.one_hot(pos2, table.width, dtype=jnp.float32)
    combine = gate1[..., None] * hot1 + gate2[..., None] * hot2
    demand = jnp.sum(mask1 + mask2, axis=(0, 1)).astype(jnp.int32)
    kept = jnp.sum(mask1 * kept1[..., None] + mask2 * kept2[..., None], axis=(0, 1)).astype(jnp.int32)
    return Routing(combine, jax.lax.stop_gradient(hot1 + hot2), aux, demand, kept)


def dispatch(tokens: jax.Array, routing: Routing) -> jax.Array:
    """Tokens [G, S, D] onto the capacity axis: [G, F, D] (empty positions are zeros)."""
    return jnp.einsum("gsf,gsd->gfd", routing.dispatch.astype(tokens.dtype), tokens)


def combine(expert_out: jax.Array, routing: Routing) -> jax.Array:
    """Expert outputs [G, F, D] back to the tokens [G, S, D], weighted by their gates."""
    return jnp.einsum("gsf,gfd->gsd", routing.combine.astype(expert_out.dtype), expert_out)
