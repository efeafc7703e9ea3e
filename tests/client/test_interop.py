"""How a value that lives elsewhere answers JAX code in the client (what ``pw.Array`` builds on), with a
stand-in that counts its fetches: abstract values cost no fetch, concrete ones one, and everything JAX
computes from it is an ordinary local ``jax.Array``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from client.interop import LocalArrayMethods, local_value, register


class Remote(LocalArrayMethods):
    """A value kept elsewhere: shape and dtype known, the data only by fetching."""

    __slots__ = ("data", "fetches", "shape", "dtype", "weak_type")

    def __init__(self, data: np.ndarray, weak_type: bool = False) -> None:
        self.data, self.fetches = data, 0
        self.shape, self.dtype, self.weak_type = data.shape, data.dtype, weak_type

    def __jax_array__(self) -> jax.Array:
        self.fetches += 1
        return local_value(self.data, self.weak_type)

    def __str__(self) -> str:
        return "Remote"


register(Remote)


def test_tracing_reads_shape_and_dtype_without_a_fetch():
    x = Remote(np.ones((2, 3), np.float32))
    out = jax.eval_shape(lambda a: jnp.tanh(a) @ a.T, x)
    assert (out.shape, out.dtype, x.fetches) == ((2, 2), np.float32, 0)


def test_jax_functions_operators_and_methods_compute_on_one_fetched_local_copy():
    x = Remote(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(jnp.sum(x), jax.Array) and float(jnp.sum(x)) == 15.0
    y = x * 2 + 1
    assert isinstance(y, jax.Array) and y.tolist() == [[1, 3, 5], [7, 9, 11]]
    assert x.sum().item() == 15.0 and x.T.shape == (3, 2) and x[1, 2].item() == 5.0
    assert f"{x[0, 1]:.2f}" == "1.00" and format(x) == "Remote"
    assert [row.tolist() for row in x] == [[0, 1, 2], [3, 4, 5]]
    assert jax.jit(lambda a: a - 1)(x).tolist()[0] == [-1, 0, 1]
    assert x.fetches >= 8  # each use fetched: nothing is cached behind the caller's back here


def test_comparisons_with_what_is_not_an_array_do_not_fetch_and_it_hashes_by_identity():
    x = Remote(np.zeros(2, np.float32))
    assert (x == None) is False and (x != "a") is True  # noqa: E711 - Python's identity rule, no fetch
    assert x.fetches == 0 and len({x, x}) == 1 and hash(x) == object.__hash__(x)
    assert (x == np.zeros(2)).tolist() == [True, True] and x.fetches == 1


def test_only_jax_arrays_attributes_are_answered():
    x = Remote(np.zeros(2, np.float32))
    with pytest.raises(AttributeError, match="no attribute 'device_buffer'"):
        _ = x.device_buffer
    assert x.fetches == 0


def test_a_weakly_typed_value_stays_weakly_typed_so_python_scalars_promote_alike():
    assert local_value(np.float32(2.0), weak_type=True).weak_type
    assert not local_value(np.float32(2.0), weak_type=False).weak_type
    assert (Remote(np.array(2.0, np.float32), weak_type=True) * np.float16(1)).dtype == np.float16
