"""Code in today's JAX sharding style on slices: a slice is the context mesh wherever user code is traced
(``jax.shard_map`` without ``mesh=``, ``get_abstract_mesh``, ``reshard``), ``pw.jit`` takes each pw.Array's
sharding as it is, ``jax.set_mesh``, ``jax.device_put`` and ``NamedSharding`` take slices, and slices can have
Explicit axes. Each is checked against jax.jit on this process's own devices where JAX has a counterpart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways as pw
from client import meshes
from client.array import Array
from client.slices import _axis_types
from pathways.errors import ProgramError, ResourceError
from pathways.graph import Transfer

Explicit, Auto = AxisType.Explicit, AxisType.Auto


# -- without a cluster -----------------------------------------------------------------------------------


def test_axis_types_follow_jax_make_mesh():
    assert _axis_types(None, 2) == (Auto, Auto)
    assert _axis_types(Explicit, 2) == (Explicit, Explicit)
    assert _axis_types((Explicit, Auto), 2) == (Explicit, Auto)
    for bad in [(Explicit,), (AxisType.Manual,), ("explicit",), 3]:
        with pytest.raises(ResourceError, match="axis_types must be one jax.sharding.AxisType per axis"):
            _axis_types(bad, 1 if bad == (AxisType.Manual,) else 2)


def test_jax_device_put_and_set_mesh_stay_jaxs_for_local_meshes():
    assert jax.device_put is meshes.device_put and jax.set_mesh is meshes.set_mesh
    assert jax.sharding.set_mesh is meshes.set_mesh
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = np.arange(8, dtype=np.float32)
    y = jax.device_put(x, NamedSharding(mesh, P("x")))
    assert isinstance(y, jax.Array) and y.sharding == NamedSharding(mesh, P("x"))
    with jax.set_mesh(mesh):
        z = jax.device_put({"a": x, "b": x}, {"a": P("x"), "b": P()})
        assert z["a"].sharding.spec == P("x") and z["b"].sharding.spec == P()
        assert jax.sharding.get_abstract_mesh().axis_names == ("x",)
    assert jax.sharding.get_abstract_mesh().empty  # the context manager restored what was there
    np.testing.assert_array_equal(jax.device_put(x), x)
    with pytest.raises(ValueError, match="set a mesh"):  # JAX's own error for a bare spec without a mesh
        jax.device_put(x, P("x"))


# -- on the session's cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s(cluster):
    with pw.slice((2,), ("x",), island=0) as sl:
        yield sl


@pytest.fixture(scope="module")
def e(cluster):
    with pw.slice((2, 2), ("data", "model"), island=1, axis_types=Explicit) as sl:
        yield sl


def transfers(fn) -> int:
    """How many transfers the last program a pw.jit function (called alone) or a pw.program ran held."""
    program = fn._single if isinstance(fn, pw.CompiledFunction) else fn
    return sum(isinstance(n, Transfer) for n in program.last_graph.nodes)


def test_shard_map_without_a_mesh_takes_the_slices(s):
    x = np.arange(8, dtype=np.float32)
    local = Mesh(np.array(jax.devices()[:2]), ("x",))

    def total(a):
        assert jax.sharding.get_abstract_mesh().axis_names == ("x",)  # the context mesh while traced
        return jax.shard_map(lambda b: jax.lax.psum(b.sum(), "x"), in_specs=P("x"), out_specs=P())(a)

    with jax.set_mesh(local):
        want = jax.jit(total)(x)
    assert float(pw.jit(total, slice=s)(pw.put(x, s, P("x")))) == float(want) == 28.0


def test_pw_jit_without_in_specs_takes_each_arrays_sharding(s):
    x = pw.put(np.arange(8, dtype=np.float32), s, P("x"))
    f = pw.jit(lambda a, b: a * 2.0 + b)
    y = f(x, np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(y), np.arange(8) * 2.0 + 1.0)
    assert transfers(f) == 0  # x is used where and as it lives
    assert f.lower(x, np.float32(1.0)).exported.in_specs == (P("x"), P())  # a host value is replicated
    g = pw.jit(lambda a: a * 2.0, in_specs=P())  # a spec given still reshards
    np.testing.assert_array_equal(np.asarray(g(x)), np.arange(8) * 2.0)
    assert transfers(g) == 1


def test_device_put_and_put_of_an_array_transfer_it(s, e):
    value = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = jax.device_put(value, NamedSharding(s, P("x")))
    assert isinstance(x, Array) and x.slice is s and x.spec == P("x")
    assert jax.device_put(x, NamedSharding(s, P("x"))) is x  # already there, as asked: returned as it is
    assert jax.device_put(x) is x
    y = jax.device_put(x, NamedSharding(e, P("data", "model")))  # another slice (and island), another spec
    assert (y.slice, y.spec) == (e, P("data", "model"))
    z = pw.put({"a": x, "b": value}, s, {"a": P(), "b": P(None, "x")})  # another spec on the same slice
    assert (z["a"].spec, z["b"].spec) == (P(), P(None, "x"))
    w = pw.put(x, NamedSharding(e, P("model")))
    assert (w.slice, w.spec) == (e, P("model"))
    for a in (x, y, z["a"], z["b"], w):
        np.testing.assert_array_equal(np.asarray(a), value)
    local = jax.device_put(x, jax.devices()[0])  # a device of this process: JAX's own (fetched)
    assert isinstance(local, jax.Array)
    np.testing.assert_array_equal(local, value)


def test_set_mesh_makes_a_slice_the_current_mesh(s, e):
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    with jax.set_mesh(e):
        a = jax.device_put(value, P("data"))
        assert (a.slice, a.spec) == (e, P("data"))
        assert jax.sharding.get_abstract_mesh().empty  # the client itself computes without a mesh
        b = jax.device_put(a, P())  # a pw.Array to the current slice, resharded
        assert (b.slice, b.spec) == (e, P())
    assert meshes.current_slice() is None
    c = jax.device_put(a, P("model"))  # no current slice: on the array's own
    assert (c.slice, c.spec) == (e, P("model"))
    for v in (a, b, c):
        np.testing.assert_array_equal(np.asarray(v), value)


def test_device_put_inside_a_program_is_a_transfer(s, e):
    double = pw.jit(lambda a: a * 2.0)

    @pw.program
    def move(a):
        return double(jax.device_put(a, NamedSharding(e, P("data"))))

    x = pw.put(np.ones((4, 2), np.float32), s)
    y = move(x)
    assert (y.slice, y.spec) == (e, P("data", None)) and transfers(move) == 1  # the typed output keeps the spec
    np.testing.assert_array_equal(np.asarray(y), np.full((4, 2), 2.0))


def test_explicit_axes_as_jax_make_mesh(e):
    assert e.axis_types == (Explicit, Explicit)
    local = jax.make_mesh((2, 2), ("data", "model"), axis_types=(Explicit, Explicit))
    value = np.arange(16, dtype=np.float32).reshape(4, 4)

    def step(a, w):
        assert jax.typeof(a).sharding.spec == P("data", None)  # shardings are part of the types
        h = jnp.tanh(a @ w)
        return jax.sharding.reshard(h, P(None, "model")), h.sum()

    with jax.set_mesh(local):
        want = jax.jit(step)(jax.device_put(value, P("data")), jax.device_put(value, P()))
    x, w = pw.put(value, e, P("data")), pw.put(value, e)
    got = pw.jit(step)(x, w)
    assert got[0].spec == want[0].sharding.spec == P(None, "model")  # out specs from the types, as jax.jit
    assert got[1].spec == P()
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-6)

    @jax.shard_map(out_specs=P())  # in_specs from the arguments' types, as on Explicit axes
    def total(a):
        return jax.lax.psum(a.sum(), ("data", "model"))

    assert float(pw.jit(total)(pw.put(value, e, P("data", "model")))) == value.sum()


def test_named_sharding_over_a_slice_as_a_spec(s):
    f = pw.jit(lambda a: a + 1.0, slice=s, in_specs=NamedSharding(s, P("x")), out_specs=NamedSharding(s, P("x")))
    y = f(np.zeros(4, np.float32))
    assert y.spec == P("x")
    with pytest.raises(ProgramError, match="the destination NamedSharding gives the spec"):
        pw.put(np.zeros(4, np.float32), NamedSharding(s, P("x")), P())


def test_nnx_and_filter_jit_trace_with_the_slices_mesh(s):
    nnx = pytest.importorskip("flax.nnx")

    class Sum(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8,)))

        def __call__(self, x):
            return jax.shard_map(lambda a, b: jax.lax.psum((a * b).sum(), "x"), in_specs=(P("x"), P("x")),
                                 out_specs=P())(x, self.w[...])

    model = Sum()
    x = pw.put(np.arange(8, dtype=np.float32), s, P("x"))
    assert float(pw.nnx.jit(lambda m, a: m(a), slice=s)(model, x)) == 28.0
    assert float(pw.filter_jit(lambda a: Sum()(a), slice=s)(x)) == 28.0
