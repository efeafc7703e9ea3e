"""Programs on a live cluster: tracing, lowering, parallel dispatch, transfers between islands, and
gang-scheduled execution."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_graph, settle
from jax.sharding import PartitionSpec as P

import pathways as pw


@pytest.fixture(scope="module")
def slices(cluster):
    s1 = pw.slice((2,), ("x",), island=0)
    s2 = pw.slice((2,), ("x",), island=1)
    yield s1, s2
    s1.release()
    s2.release()


def test_the_readme_example_runs_and_frees_each_intermediate_after_its_last_use(slices):
    s1, s2 = slices
    a = pw.jit(lambda v: v * 2.0, slice=s1)
    b = pw.jit(lambda v: v + 1.0, slice=s2)
    c = pw.jit(lambda v: v / 2.0, slice=s1)

    @pw.program
    def f(v):
        x = a(v)
        y = b(x)
        z = a(c(x))
        return y, z

    v = pw.put(np.array([1.0, 2.0], np.float32), s1)
    y, z = f(v)
    assert isinstance(y, pw.Array) and isinstance(z, pw.Array)
    assert y.slice is s2 and z.slice is s1
    np.testing.assert_allclose(np.asarray(y), [3.0, 5.0])
    np.testing.assert_allclose(np.asarray(z), [2.0, 4.0])

    graph = f.graph(v)
    kinds = [type(n).__name__ for n in graph.nodes]
    assert kinds.count("Compute") == 4 and kinds.count("Transfer") == 1
    assert len(graph.edges) == 5 and graph.islands == {0, 1}
    dot = graph.to_dot()
    assert dot.startswith('digraph "f"') and "island 0 -> 1" in dot and "8 bytes" in dot
    f(v)
    assert f.graph(v) is graph and f.last_graph is graph  # traced once for this signature

    lowered = lower_graph(graph)
    ops0 = [(op.KIND, list(op.frees)) for op in lowered.fragments[0].ops]
    ops1 = [(op.KIND, list(op.frees)) for op in lowered.fragments[1].ops]
    # x (slot 1) is freed after its last use (c), c's output (slot 4) after the final a; outputs are kept
    assert ops0 == [("exec", []), ("send", []), ("exec", [1]), ("exec", [4])]
    assert ops1 == [("recv", []), ("exec", [2])]


def test_chain_of_128_alternating_islands(slices):
    s1, s2 = slices
    fa = pw.jit(lambda v: v * 1.5 + 1.0, slice=s1)
    fb = pw.jit(lambda v: jnp.sin(v) + v, slice=s2)

    @pw.program
    def chain(v):
        for _ in range(64):
            v = fb(fa(v))
        return v

    x0 = np.linspace(-1, 1, 8).astype(np.float32)
    expected = x0
    for _ in range(64):
        expected = np.asarray(jnp.sin(expected * 1.5 + 1.0) + (expected * 1.5 + 1.0))
    out = chain(pw.put(x0, s1))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4)
    assert len(chain.graph(pw.put(x0, s1)).nodes) == 128 + 127  # the input already lives on island 0


def test_a_diamond_over_three_slices_computes_what_numpy_does(slices, cluster):
    s1, s2 = slices
    with pw.slice((2, 2), ("data", "model"), island=1) as s3:
        top = pw.jit(lambda v: v + 1.0, slice=s1, in_specs=(P("x"),), out_specs=P("x"))
        left = pw.jit(lambda v: v * 2.0, slice=s2, in_specs=(P("x"),), out_specs=P())
        right = pw.jit(lambda v: v @ v.T, slice=s3, in_specs=(P("data", "model"),), out_specs=P("data"))
        join = pw.jit(lambda a, b: a.sum() + b.sum(), slice=s1, in_specs=(P(), P("x")))

        @pw.program
        def diamond(v):
            t = top(v)
            return join(left(t), right(t))

        x = np.arange(16, dtype=np.float32).reshape(4, 4)
        t = x + 1.0
        np.testing.assert_allclose(np.asarray(diamond(pw.put(x, s1, P("x")))), (t * 2).sum() + (t @ t.T).sum(),
                                   rtol=1e-5)


def test_transfers_between_specs_and_mesh_shapes(cluster):
    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    layouts = [((2, 2), ("data", "model"), P("data", "model")), ((4,), ("x",), P(None, "x")),
               ((2,), ("x",), P("x")), ((1,), ("x",), P()), ((4, 1), ("a", "b"), P(("a", "b")))]
    for k, (shape_a, axes_a, spec_a) in enumerate(layouts):
        shape_b, axes_b, spec_b = layouts[(k + 1) % len(layouts)]
        with pw.slice(shape_a, axes_a, island=0) as sa, pw.slice(shape_b, axes_b, island=1) as sb:
            ident = pw.jit(lambda v: v + 0.0, slice=sb, in_specs=(spec_b,), out_specs=spec_b)
            moved = pw.program(lambda v, f=ident: f(v))(pw.put(x, sa, spec_a))
            assert moved.spec == spec_b and moved.slice is sb
            np.testing.assert_array_equal(np.asarray(moved), x)


def test_one_function_on_two_slices(slices):
    s1, s2 = slices
    f = pw.jit(lambda v: v * v, slice=s1)
    g = f.on(s2)
    free = pw.jit(lambda v: v - 1.0)  # no slice: runs where its first argument lives

    @pw.program
    def both(a, b):
        return f(a), g(b), free(a), free(b)

    a = pw.put(np.full(4, 3.0, np.float32), s1)
    b = pw.put(np.full(4, 5.0, np.float32), s2)
    fa, gb, fa1, fb1 = both(a, b)
    assert fa.slice is s1 and gb.slice is s2 and fa1.slice is s1 and fb1.slice is s2
    np.testing.assert_allclose(np.asarray(fa), 9.0)
    np.testing.assert_allclose(np.asarray(gb), 25.0)
    np.testing.assert_allclose(np.asarray(fa1), 2.0)
    np.testing.assert_allclose(np.asarray(fb1), 4.0)
    assert len(f._exports) == 1  # both slices have shape (2,): one export, reused


def test_training_loop_feedback_has_no_buffer_growth(slices, cluster):
    s1, s2 = slices
    grad = pw.jit(lambda w, x: 2.0 * (w * x - 1.0) * x, slice=s1)
    step = pw.jit(lambda w, g: w - 0.1 * g, slice=s2)
    back = pw.jit(lambda w: w + 0.0, slice=s1)

    @pw.program
    def train(w, x):
        g = grad(w, x)
        w2 = step(back(w), g)
        return back(w2), w2

    x = pw.put(np.full(4, 0.5, np.float32), s1)
    w = pw.put(np.zeros(4, np.float32), s1)
    ref_w = np.zeros(4, np.float32)
    for i in range(50):
        w, w_on_s2 = train(w, x)
        ref_w = ref_w - 0.1 * 2.0 * (ref_w * 0.5 - 1.0) * 0.5
        if i == 5:
            np.asarray(w)
            early = settle(cluster)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5)
    assert settle(cluster, expect=early) == early


def test_dispatch_returns_futures_before_the_work_is_done(slices):
    s1, _ = slices
    slow = pw.jit(lambda m: jax.lax.fori_loop(0, 40, lambda i, a: jnp.tanh(a @ m), m), slice=s1)
    m = pw.put(np.eye(512, dtype=np.float32) * 0.5, s1)
    slow(m).block_until_ready()  # compile first
    start = time.perf_counter()
    outs = [slow(m) for _ in range(4)]
    dispatched = time.perf_counter() - start
    outs[-1].block_until_ready()
    finished = time.perf_counter() - start
    assert dispatched < finished / 3, (dispatched, finished)


def test_reading_a_traced_value_names_the_line(slices):
    s1, _ = slices
    f = pw.jit(lambda v: v + 1.0, slice=s1)

    @pw.program
    def branchy(v):
        y = f(v)
        if y > 0:  # the offending line
            return f(y)
        return y

    @pw.program
    def to_numpy(v):
        return np.asarray(f(v))

    v = pw.put(np.ones(2, np.float32), s1)
    with pytest.raises(pw.ProgramError, match=r"test_program.py:\d+: if y > 0:"):
        branchy(v)
    with pytest.raises(pw.ProgramError, match="converting to numpy"):
        to_numpy(v)


def test_static_control_flow_and_program_errors(slices):
    s1, _ = slices
    f = pw.jit(lambda v: v * 2.0, slice=s1)

    @pw.program
    def repeat(v, n):
        for _ in range(n):
            v = f(v)
        return v

    v = pw.put(np.ones(2, np.float32), s1)
    np.testing.assert_allclose(np.asarray(repeat(v, 3)), 8.0)
    np.testing.assert_allclose(np.asarray(repeat(v, 1)), 2.0)
    with pytest.raises(pw.ProgramError, match="returned int"):
        pw.program(lambda v: 3)(v)
    with pytest.raises(pw.ProgramError, match="not an argument of the program"):
        pw.program(lambda u: f(v))(v)


def test_explicit_transfer_places_the_send(slices):
    s1, s2 = slices
    f = pw.jit(lambda v: v + 1.0, slice=s1)
    g = pw.jit(lambda v: v * 10.0, slice=s1)
    h = pw.jit(lambda a, b: a - b, slice=s2)

    @pw.program
    def early(v):
        a = f(v)
        a_remote = pw.transfer(a, s2)  # the send is emitted here, before g runs
        b = g(a)
        return h(a_remote, pw.transfer(b, s2))

    v = pw.put(np.ones(2, np.float32), s1)
    np.testing.assert_allclose(np.asarray(early(v)), 2.0 - 20.0)
    ops = [type(n).__name__ for n in early.graph(v).nodes]
    assert ops == ["Compute", "Transfer", "Compute", "Transfer", "Compute"]
    moved = pw.transfer(v, s2, P("x"))
    assert moved.slice is s2 and moved.spec == P("x")
    np.testing.assert_allclose(np.asarray(moved), 1.0)
