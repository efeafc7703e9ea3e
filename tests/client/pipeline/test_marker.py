"""``pw.pipeline.end_stage``: an identity that ordinary JAX runs unchanged, and that stays visible, forward and
backward, in the jaxpr of a training step (what the splitter cuts at)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from client.pipeline.marker import END_STAGE, END_STAGE_BWD, end_stage
from pathways.errors import ProgramError


def model(w, x):
    h = end_stage(jnp.tanh(x @ w[0]))
    return end_stage(jnp.sum(jnp.tanh(h @ w[1]) ** 2), P())


def plain(w, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) ** 2)


W = (np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), np.linspace(1, -1, 8, dtype=np.float32).reshape(4, 2))
X = np.arange(6, dtype=np.float32).reshape(2, 3) / 6


def primitives(jaxpr) -> list[str]:
    return [eqn.primitive.name for eqn in jaxpr.eqns]


def test_a_marked_model_computes_what_it_computes_unmarked_under_jit_grad_and_vmap():
    np.testing.assert_allclose(jax.jit(model)(W, X), plain(W, X), rtol=1e-6)
    for got, want in zip(jax.grad(model)(W, X), jax.grad(plain)(W, X)):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    batched = jax.vmap(model, in_axes=(None, 0))(W, np.stack([X, 2 * X]))
    np.testing.assert_allclose(batched, [plain(W, X), plain(W, 2 * X)], rtol=1e-6)


def test_the_gradient_shows_where_each_stage_ends_forward_and_where_its_backward_begins():
    names = primitives(jax.make_jaxpr(jax.grad(model))(W, X).jaxpr)
    assert names.count(END_STAGE.name) == 2 and names.count(END_STAGE_BWD.name) == 2
    assert names.index(END_STAGE.name) < names.index(END_STAGE_BWD.name)
    forward = primitives(jax.make_jaxpr(model)(W, X).jaxpr)
    assert forward.count(END_STAGE.name) == 2 and END_STAGE_BWD.name not in forward


def test_a_pytree_is_marked_leaf_by_leaf_and_keeps_its_structure():
    tree = {"h": jnp.ones(3), "c": (jnp.zeros(2),)}
    out = end_stage(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert primitives(jax.make_jaxpr(end_stage)(tree).jaxpr) == [END_STAGE.name]


@pytest.mark.parametrize("args, words", [((jnp.ones(2), "x"), "spec must be a PartitionSpec"),
                                         (({},), "empty pytree")])
def test_bad_marks_are_refused_with_what_to_do(args, words):
    with pytest.raises(ProgramError, match=words):
        end_stage(*args)
