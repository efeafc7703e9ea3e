"""A pw.Array is taken wherever JAX takes a jax.Array in the client: each use is compared with the same code on
the jax.Array it holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import pathways as pw


@pytest.fixture(scope="module")
def s(cluster):
    with pw.slice((2,), ("data",), island=0) as sl:
        yield sl


def pair(s, value, spec=None):
    """The same value as a local jax.Array and as a pw.Array on ``s``."""
    local = jnp.asarray(value)
    return local, pw.put(local, s, spec)


def same(got, want):
    assert type(got) is type(want), (type(got), type(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_format_specs_format_the_value_as_jax_array_does(s):
    loss, pw_loss = pair(s, np.float32(0.000123456))
    for spec in (".2e", ".4f", "10.3g", "<12"):
        assert f"{pw_loss:{spec}}" == f"{loss:{spec}}"
    v, pw_v = pair(s, np.arange(3, dtype=np.float32))
    with pytest.raises(TypeError):  # a non-empty spec on a 1-d array: as jax.Array (numpy's rule)
        f"{v:.2f}"
    with pytest.raises(TypeError):
        f"{pw_v:.2f}"
    assert f"{pw_v}" == str(pw_v)  # no spec: str(), as Python defines


def test_jnp_functions_operators_and_methods_take_a_pw_array(s):
    x, px = pair(s, np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2), P("data"))
    w, pw_w = pair(s, np.arange(6, dtype=np.float32).reshape(2, 3))
    same(jnp.tanh(px), jnp.tanh(x))
    same(jnp.dot(px, pw_w), jnp.dot(x, w))
    same(px @ pw_w, x @ w)
    same(x @ pw_w, x @ w)  # a jax.Array on the left
    same(2.0 * px - 1, 2.0 * x - 1)
    same(px > 0, x > 0)
    same(px == x, x == x)
    same(px[1:, 0], x[1:, 0])
    same(px.reshape(-1).sum(), x.reshape(-1).sum())
    same(px.T, x.T)
    same(jnp.stack([px, px]), jnp.stack([x, x]))
    same(jax.lax.add(px, px), jax.lax.add(x, x))
    assert [float(r[0]) for r in px] == [float(r[0]) for r in x]
    assert (px == None) is False  # noqa: E711 (no fetch, no elementwise comparison with a non-array)
    assert len({px, px}) == 1  # hashable by identity, as the runtime needs


def test_jax_jit_vmap_and_grad_in_the_client_take_a_pw_array(s):
    x, px = pair(s, np.linspace(0, 1, 6, dtype=np.float32))

    def f(v):
        return jnp.sum(jnp.sin(v) ** 2)

    same(jax.jit(f)(px), jax.jit(f)(x))
    same(jax.vmap(jnp.cos)(px), jax.vmap(jnp.cos)(x))
    same(jax.grad(f)(px), jax.grad(f)(x))
    same(jax.jit(lambda a: a * px)(2.0), jax.jit(lambda a: a * x)(2.0))  # closed over


def test_the_value_is_fetched_once_and_kept(s):
    _, px = pair(s, np.ones(4, np.float32))
    first = px.__jax_array__()
    jnp.sum(px), px + 1, jax.jit(jnp.negative)(px)
    assert px.__jax_array__() is first


def test_weak_types_survive_local_use_as_under_jax(s):
    weak = pw.jit(lambda: jnp.asarray(2.0) * 1.5, slice=s)()  # computed from Python scalars: weakly typed
    assert weak.weak_type
    b = jnp.ones(3, jnp.bfloat16)
    assert (b * weak).dtype == (b * (jnp.asarray(2.0) * 1.5)).dtype == jnp.bfloat16


def test_device_get_brings_typed_keys_home_as_keys(s):
    key = jax.random.key(3)
    keys = jax.random.split(key, 4)
    tree = {"key": key, "keys": keys, "count": np.uint32(7)}
    got = jax.device_get(pw.put(tree, s))
    want = jax.device_get(tree)
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["keys"]), jax.random.key_data(want["keys"]))
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(want["key"]))
    assert got["count"] == want["count"]
    with pytest.raises(TypeError, match="PRNGKey"):  # np.asarray still refuses keys, as for jax.random.key(0)
        np.asarray(pw.put(key, s))


def test_tree_util_over_trees_of_pw_arrays(s):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    local = jax.tree.map(jnp.asarray, params)
    remote = pw.put(params, s)
    assert jax.tree.structure(remote) == jax.tree.structure(local)
    doubled = jax.tree.map(lambda a, b: a * 2 - b, remote, local)
    for got, want in zip(jax.tree.leaves(doubled), jax.tree.leaves(jax.tree.map(lambda a: a, local))):
        same(got, want)
    same(optax.tree.norm(remote), optax.tree.norm(local))
    assert jax.tree_util.tree_reduce(lambda a, b: a + b.size, remote, 0) == 9


def test_item_assignment_replaces_the_value_on_the_island(s):
    x = pw.put(np.arange(4, dtype=np.float32), s, P("data"))
    seen = pw.jit(lambda v: v * 1.0, slice=s)(x)  # a program that read the old value
    x[...] = 0.0
    np.testing.assert_array_equal(np.asarray(x), np.zeros(4))
    x[1] = 5.0
    np.testing.assert_array_equal(np.asarray(pw.jit(lambda v: v + 1, slice=s, in_specs=P("data"))(x)), [1, 6, 1, 1])
    np.testing.assert_array_equal(np.asarray(seen), np.arange(4))  # what was computed before is kept
    assert x.spec == P("data") and x.slice is s
