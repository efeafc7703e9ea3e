"""pw.zero: shares balanced by bytes, an optimizer state cut into shares and joined back bit for bit, and a
share's update (clipped by the global norm from every pod's partial sums) equal to the whole tree's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathways as pw


def _tree() -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    return {"a": jax.random.normal(keys[0], (64, 32)), "b": jax.random.normal(keys[1], (32,)),
            "c": [jax.random.normal(keys[2], (16, 16)), jax.random.normal(keys[3], (64, 16)),
                  jax.random.normal(keys[4], (8,))]}


def test_a_partition_deals_whole_leaves_evenly_and_takes_and_joins_them():
    tree = _tree()
    part = pw.zero.partition(tree, 2)
    assert sorted(set(part.owners)) == [0, 1]
    assert abs(part.share_bytes(0) - part.share_bytes(1)) <= max(part.nbytes)  # greedy, largest first
    assert part.owners == pw.zero.partition(tree, 2).owners  # every process computes the same
    leaves = jax.tree.leaves(tree)
    shares = [part.take(leaves, p) for p in range(2)]
    assert sum(map(len, shares)) == len(leaves)
    assert all(a is b for a, b in zip(part.join(shares), leaves))
    by_piece = pw.zero.partition(tree, 2, pieces=[[0, 1], [2, 3, 4]])
    assert {by_piece.owners[0], by_piece.owners[1]} == {0, 1}  # each piece split, not piece by piece


def test_a_partition_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="cannot give each of 3 pods a share"):
        pw.zero.partition({"a": jnp.zeros(3), "b": jnp.zeros(2)}, 3)
    with pytest.raises(ValueError, match="exactly once"):
        pw.zero.partition(_tree(), 2, pieces=[[0, 1], [1, 2, 3, 4]])
    part = pw.zero.partition(_tree(), 2)
    with pytest.raises(ValueError, match="one share per pod"):
        part.join([[]])
    with pytest.raises(ValueError, match="cannot take a share of 2"):
        part.take([1, 2], 0)


def _chain() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adafactor(1e-2, momentum=0.9, factored=False, multiply_by_parameter_scale=True))


def _inner() -> optax.GradientTransformation:
    return optax.adafactor(1e-2, momentum=0.9, factored=False, multiply_by_parameter_scale=True)


@jax.jit
def _whole_update(params: dict, state: tuple, grads: dict) -> tuple:
    updates, state = _chain().update(grads, state, params)
    return optax.apply_updates(params, updates), state


@jax.jit
def _share_update(share: list, state: tuple, grads: list, norm: jax.Array) -> tuple:
    updates, inner_state = _inner().update(pw.zero.clip(grads, norm, 1.0), state[1], share)
    return optax.apply_updates(share, updates), (state[0], inner_state)


def test_shares_of_an_optimizer_update_as_the_whole_tree_does():
    params = _tree()
    grads = jax.tree.map(lambda x: 3.0 * jnp.sin(x), params)  # a norm well over the clip
    state = _chain().init(params)
    want, want_state = _whole_update(params, state, grads)

    part = pw.zero.partition(params, 2)
    leaves, grad_leaves = jax.tree.leaves(params), jax.tree.leaves(grads)
    shares = [pw.zero.shard_state(state, params, part.owned(p)) for p in range(2)]
    back = pw.zero.join_state(shares, params, part)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))

    partials = [pw.zero.sq_norm(part.take(grad_leaves, p)) for p in range(2)]
    norm = pw.zero.global_norm(partials)
    np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=1e-6)
    new_shares, new_states = [], []
    for p in range(2):
        share, share_state = _share_update(part.take(leaves, p), shares[p], part.take(grad_leaves, p), norm)
        new_shares.append(share)
        new_states.append(share_state)
    got = jax.tree.unflatten(jax.tree.structure(params), part.join(new_shares))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    joined = pw.zero.join_state(new_states, params, part)
    for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_clip_is_optax_clip_by_global_norm():
    grads = _tree()
    norm = optax.tree.norm(grads)
    for max_norm in (1.0, 1e6):  # clipped, and left alone
        want, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        got = pw.zero.clip(jax.tree.leaves(grads), norm, max_norm)
        assert all(np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(want)))
