"""pw.nnx.jit and pw.filter_jit against nnx.jit and eqx.filter_jit on the same code. The batch is split over
2 devices in both, the reference on this process's own 2-device mesh, so the same reductions run in the
same order."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.array import Array


@pytest.fixture(scope="module")
def s(cluster):
    with pw.slice((2,), ("data",), island=0) as sl:
        yield sl


def split_batch(*arrays):
    """The arrays split over "data" on this process's own 2-device mesh: the sharded jax.jit reference."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def batches(n, size=8):
    rng = np.random.default_rng(0)
    for _ in range(n):
        x = rng.normal(size=(size, 4)).astype(np.float32)
        yield x, np.tanh(x[:, :2] - x[:, 2:])


# -- Flax NNX ------------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))


def nnx_step(model, optimizer, metrics, x, y):
    def loss_fn(model):
        return ((model(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    metrics.update(loss=loss)
    optimizer.update(model, grads)
    return loss


def nnx_train(jit, steps=4, **options):
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step = jit(nnx_step, **options)
    losses = [float(step(model, optimizer, metrics, *batch)) for batch in batches(steps)]
    return losses, model, optimizer, metrics


def test_nnx_jit_on_a_slice_updates_modules_in_place_as_nnx_jit(s):
    plain, model, optimizer, metrics = nnx_train(lambda f: lambda m, o, me, x, y: nnx.jit(f)(m, o, me,
                                                                                             *split_batch(x, y)))
    ported, pmodel, poptimizer, pmetrics = nnx_train(pw.nnx.jit, slice=s, in_specs={"x": P("data"),
                                                                                    "y": P("data")})
    np.testing.assert_allclose(ported, plain, rtol=1e-6)
    assert isinstance(pmodel.bn.mean.get_value(), Array)  # the state lives on the slice
    assert isinstance(poptimizer.step.get_value(), Array)
    want, got = jax.device_get(nnx.state((model, optimizer))), jax.device_get(nnx.state((pmodel, poptimizer)))
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # the dropout key comes home as a key
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(pmetrics.compute()["loss"], metrics.compute()["loss"], rtol=1e-6)


def test_nnx_jit_returns_the_callers_objects_and_keeps_structural_changes(s):
    @pw.nnx.jit(slice=s)
    def grow(model):
        model.calls = nnx.Variable(jnp.ones(()))  # a new attribute, set inside
        return model, model.lin

    model = Net(nnx.Rngs(0))
    same, lin = grow(model)
    assert same is model and lin is model.lin
    assert float(model.calls.get_value()) == 1.0


def test_nnx_jit_donates_module_state(s):
    model = Net(nnx.Rngs(0))
    step = pw.nnx.jit(lambda m, x: m.lin.kernel.set_value(m.lin.kernel.get_value() + x), slice=s, donate_argnums=0)
    step(model, np.float32(1.0))
    old = model.lin.kernel.get_value()
    step(model, np.float32(1.0))
    assert old.is_deleted() and not model.lin.kernel.get_value().is_deleted()


# -- Equinox -------------------------------------------------------------------------------------------


def eqx_step(model, x, y, opt_state, optim, scale):
    @eqx.filter_value_and_grad
    def loss_fn(model):
        return scale * jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = loss_fn(model)
    updates, opt_state = optim.update(grads, opt_state)
    return loss, eqx.apply_updates(model, updates), opt_state, "stepped"


def eqx_train(jit, shard, steps=4):
    model = eqx.nn.MLP(4, 2, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    step = jit(eqx_step)
    losses = []
    for x, y in batches(steps):
        loss, model, opt_state, note = step(model, *shard(x, y), opt_state, optim, 0.5)
        assert note == "stepped"  # a non-array result comes back as the function returned it
        losses.append(loss.item())
    return losses, model


def test_filter_jit_on_a_slice_matches_eqx_filter_jit(s):
    plain, model = eqx_train(eqx.filter_jit, split_batch)
    ported, pmodel = eqx_train(lambda f: pw.filter_jit(f, slice=s, in_specs={"x": P("data"), "y": P("data")}),
                               lambda x, y: (x, y))
    np.testing.assert_allclose(ported, plain, rtol=1e-6)
    assert pmodel.activation is jax.nn.gelu and pmodel.depth == 2  # static fields as they were
    assert all(isinstance(leaf, Array) for leaf in jax.tree.leaves(eqx.filter(pmodel, eqx.is_array, inverse=False)))
    x = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(jax.vmap(pmodel)(x), jax.vmap(model)(x), rtol=1e-5)  # used in the client


def test_filter_jit_holds_python_numbers_static_and_donates_as_asked(s):
    traces = []

    @pw.filter_jit(slice=s, donate="all")
    def scale(v, factor):
        traces.append(factor)
        return v * factor

    v = pw.put(np.ones(4, np.float32), s)
    w = scale(v, 2.0)
    assert v.is_deleted()
    traced = len(traces)
    np.testing.assert_array_equal(np.asarray(scale(w, 2.0)), np.full(4, 4.0))
    assert len(traces) == traced  # the same static value: no new trace
    scale(pw.put(np.ones(4, np.float32), s), 3.0)
    assert sorted(set(traces)) == [2.0, 3.0]  # a new static value traces anew, as eqx.filter_jit
    with pytest.raises(pw.ProgramError, match="not hashable"):
        scale(np.ones(4, np.float32), {1, 2})
