"""pw.jit, pw.put and pw.Array follow jax.jit's conventions: each feature is compared with jax.jit on the same
inputs."""

from __future__ import annotations

import functools
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settle
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.dispatch import placements


@pytest.fixture(scope="module")
def s(cluster):
    with pw.slice((2, 2), ("data", "model"), island=0) as sl:
        yield sl


@pytest.fixture(scope="module")
def t(cluster):
    with pw.slice((2,), ("x",), island=1) as sl:
        yield sl


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# -- static arguments, keyword arguments, decorators ---------------------------------------------


def scale_add(x, n, *, scale, mode="add"):
    y = x * scale
    for _ in range(n):
        y = y + 1.0 if mode == "add" else y * 2.0
    return y


def test_keyword_and_static_arguments_match_jax_jit(s):
    f = pw.jit(scale_add, slice=s, in_specs=(P("data"),), static_argnums=1, static_argnames="mode")
    j = jax.jit(scale_add, static_argnums=1, static_argnames="mode")
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    xp = pw.put(x, s, P("data"))
    close(f(xp, 2, scale=3.0), j(x, 2, scale=3.0))
    close(f(xp, 3, scale=np.float32(0.5), mode="mul"), j(x, 3, scale=np.float32(0.5), mode="mul"))
    exports = len(f._exports)
    close(f(xp, 2, scale=4.0), j(x, 2, scale=4.0))  # same statics and avals: the export is reused
    assert len(f._exports) == exports
    by_name = pw.jit(scale_add, slice=s, static_argnames=("n", "mode"))  # names imply the numbers, as in jax
    j = jax.jit(scale_add, static_argnames=("n", "mode"))
    close(by_name(x=xp, n=1, scale=1.0), j(x=x, n=1, scale=1.0))  # every argument by keyword
    close(by_name(xp, 2, scale=1.0), j(x, 2, scale=1.0))
    assert len(by_name._exports) == 2


def test_decorator_forms(s):
    @pw.jit
    def double(x):
        return x * 2

    @pw.jit(slice=s, static_argnames="power")
    def raise_to(x, power):
        return x ** power

    @functools.partial(pw.jit, slice=s, in_specs={"x": P("data")}, static_argnums=(1,))
    def tile(x, reps):
        return jnp.tile(x, reps)

    x = np.arange(4, dtype=np.float32)
    xp = pw.put(x, s, P("data"))
    close(double(xp), x * 2)
    close(raise_to(xp, power=3), jax.jit(lambda x: x ** 3)(x))
    close(tile(xp, 2), jax.jit(jnp.tile, static_argnums=1)(x, 2))
    assert double(xp).slice is s


def test_in_specs_name_keyword_arguments(s):
    def f(x, w, *, b):
        return x @ w + b

    x, w, b = (np.arange(8, dtype=np.float32).reshape(4, 2), np.ones((2, 4), np.float32), np.float32(0.5))
    by_name = pw.jit(f, slice=s, in_specs={"x": P("data"), "w": P(None, "model")}, out_specs=P("data"))
    by_position = pw.jit(f, slice=s, in_specs=(P("data"), P(None, "model")), out_specs=P("data"))
    xp, wp = pw.put(x, s, P("data")), pw.put(w, s, P(None, "model"))
    expected = jax.jit(f)(x, w, b=b)
    for fn in (by_name, by_position):
        close(fn(xp, wp, b=b), expected)
        close(fn(xp, w=wp, b=b), expected)  # a positional parameter passed by keyword keeps its spec
    for exported in by_position._exports.values():  # leaves in jax's order: positional, then keywords by name
        assert sorted(map(str, exported.in_specs)) == sorted(map(str, (P("data"), P(None, "model"), P())))
    with pytest.raises(pw.ProgramError, match="not parameters of the function"):
        pw.jit(f, slice=s, in_specs={"z": P()})
    with pytest.raises(pw.ProgramError, match="not divisible"):
        pw.jit(f, slice=s, in_specs={"b": P("data")})(xp, wp, b=np.ones(3, np.float32))


def test_unhashable_static_argument_raises_jax_error(s):
    f = pw.jit(scale_add, slice=s, static_argnums=1, static_argnames="mode")
    xp = pw.put(np.ones(4, np.float32), s)
    with pytest.raises(ValueError) as jax_error:
        jax.jit(scale_add, static_argnums=1, static_argnames="mode")(np.ones(4, np.float32), [1], scale=1.0)
    with pytest.raises(pw.ProgramError) as pw_error:
        f(xp, [1], scale=1.0)
    assert str(jax_error.value) in str(pw_error.value)


def test_bad_argnums_raise_jax_error(s):
    with pytest.raises(pw.ProgramError, match="static_argnums=.*only accepts 2 positional"):
        pw.jit(lambda a, b: a, slice=s, static_argnums=5)
    with pytest.raises(pw.ProgramError, match="cannot intersect"):
        pw.jit(lambda a, b: a, slice=s, static_argnames="a", donate_argnames="a")


# -- donation ------------------------------------------------------------------------------------


def test_donated_argument_is_gone_and_its_buffer_left_the_host(cluster, s):
    f = pw.jit(lambda x, y: x + y, slice=s, donate_argnums=0)
    x, y = np.full(16, 2.0, np.float32), np.arange(16, dtype=np.float32)
    xp, yp = pw.put(x, s), pw.put(y, s)
    gc.collect()
    before = settle(cluster, islands=(0,))[0]
    out = f(xp, yp)
    close(out, jax.jit(lambda x, y: x + y, donate_argnums=0)(x, y))
    assert xp.is_deleted() and not yp.is_deleted()
    with pytest.raises(pw.ProgramError, match="donated to <lambda>"):
        xp.fetch()
    with pytest.raises(pw.ProgramError, match="donated"):
        f(xp, yp)
    assert "donated" in repr(xp)
    gc.collect()
    assert settle(cluster, islands=(0,))[0] == before  # x's buffer went, out's came
    g = pw.jit(lambda x, *, acc: acc + x, slice=s, donate_argnames="acc")
    acc = pw.put(np.zeros(16, np.float32), s)
    new = g(yp, acc=acc)
    assert acc.is_deleted()
    close(new, y)


def test_donation_lowers_peak_buffer_bytes_by_one_copy(cluster, s):
    n = 1 << 20  # 4 MiB of float32
    step = {d: pw.jit(lambda p, g: p - 0.1 * g, slice=s, donate_argnums=d) for d in ((), (0,))}
    peaks = {}
    for d, fn in step.items():
        p, g = pw.put(np.ones(n, np.float32), s), pw.put(np.ones(n, np.float32), s)
        p.block_until_ready()
        g.block_until_ready()
        gc.collect()
        settle(cluster, islands=(0,))  # earlier tests' frees land before the peak starts
        base = cluster.usage(0, reset_peak=True)["buffer_bytes"]
        out = fn(p, g)
        close(out.fetch()[:4], np.full(4, 0.9, np.float32))
        peaks[d] = cluster.usage(0)["peak_buffer_bytes"] - base
        del p, g, out
    assert peaks[()] > 0.99 * 4 * n  # a new buffer beside both inputs
    assert peaks[(0,)] < 0.01 * 4 * n  # the output took the donated buffer's place


def test_program_donates_only_a_last_use(s):
    update = pw.jit(lambda p, g: p - g, slice=s, donate_argnums=0)
    norm = pw.jit(lambda p: jnp.sum(p * p), slice=s)

    @pw.program
    def reuses(p, g):
        q = update(p, g)  # p is read again below: it must not be donated here
        return q, norm(p)

    @pw.program
    def last_use(p, g):
        n = norm(p)
        return update(p, g), n

    p, g = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    pp, gp = pw.put(p, s), pw.put(g, s)
    q, n = reuses(pp, gp)
    close(q, p - g)
    close(n, np.sum(p * p))
    assert not pp.is_deleted()
    assert all(not node.donate for node in reuses.last_graph.nodes)
    q, n = last_use(pp, gp)
    close(q, p - g)
    close(n, np.sum(p * p))
    assert pp.is_deleted() and not gp.is_deleted()
    assert [node.donate for node in last_use.last_graph.nodes] == [(), (0,)]


def test_host_keeps_a_donated_buffer_another_pending_op_reads(s, t):
    """A program waiting on island 1 will read x on island 0 after a donating call has run there."""
    def slow(v):  # about a second of work on island 1, so the program's read of x waits for it
        m = jnp.ones((256, 256), jnp.float32) / 256
        return jax.lax.fori_loop(0, 4000, lambda i, a: a @ m, v)

    slow_fn = pw.jit(slow, slice=t)
    add = pw.jit(lambda a, b: a[0, :4] + b, slice=s)
    donate = pw.jit(lambda b: b * 10.0, slice=s, donate_argnums=0)

    @pw.program
    def waits_then_reads(v, x):
        return add(pw.transfer(slow_fn(v), s), x)

    x = np.arange(4, dtype=np.float32)
    xp = pw.put(x, s)
    vp = pw.put(np.ones((256, 256), np.float32), t)
    pending = waits_then_reads(vp, xp)  # its read of x is admitted on island 0 before the donation
    donated = donate(xp)
    close(donated, x * 10.0)
    close(pending, 1.0 + x)
    assert xp.is_deleted()


# -- host values as arguments ------------------------------------------------------------------------------


def test_numpy_python_and_jax_values_as_arguments_match_jax_jit(s):
    def f(x, a, k, w):
        return x * k + a @ w

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    a, w = np.ones((4, 3), np.float32), jnp.full((3, 2), 0.5, jnp.float32)
    fn = pw.jit(f, slice=s, in_specs=(P("data"), P("data"), None, None), out_specs=P("data"))
    close(fn(pw.put(x, s, P("data")), a, 3.0, w), jax.jit(f)(x, a, 3.0, w))
    close(fn(x, a, 2, w), jax.jit(f)(x, a, 2, w))  # all host values: placed on fn's slice per in_specs
    bf = pw.jit(lambda v, k: v * k, slice=s)
    half = np.ones(4, jnp.bfloat16)
    for k in (2.0, 3):  # Python scalars are weakly typed: bfloat16 stays bfloat16
        assert bf(pw.put(half, s), k).dtype == jax.jit(lambda v, k: v * k)(half, k).dtype == jnp.bfloat16
    assert bf(pw.put(np.ones(2, np.int32), s), 2.5).dtype == jax.jit(lambda v, k: v * k)(np.ones(2, np.int32),
                                                                                             2.5).dtype
    with pytest.raises(pw.ProgramError, match="has no slice"):
        pw.jit(lambda v: v)(np.ones(2))
    with pytest.raises(pw.ProgramError, match="is a str"):
        bf(pw.put(half, s), "2")


def test_values_passed_again_are_not_sent_again(cluster, s):
    fn = pw.jit(lambda v, k, w: v * k + w, slice=s)
    v = pw.put(np.ones(4, np.float32), s)
    w = jnp.arange(4, dtype=jnp.float32)
    big = np.ones(32 * 1024, np.float32)  # 128 KiB: over the content cache's limit
    cache = placements(cluster)
    fn(v, 2.0, w).block_until_ready()
    sent = cache.sent
    for _ in range(3):
        close(fn(v, 2.0, w), 2.0 + np.arange(4))
    assert cache.sent == sent  # the scalar by content, the jax.Array by identity
    close(fn(v, 7.25, w), 7.25 + np.arange(4))
    assert cache.sent == sent + 1
    g = pw.jit(lambda a: a.sum(), slice=s)
    g(big).block_until_ready()
    g(big).block_until_ready()
    assert cache.sent == sent + 3  # a large numpy array may change in place: sent every time


def test_program_places_host_values_on_each_functions_slice(s, t):
    on_s = pw.jit(lambda a, b: a * b, slice=s, in_specs=(P("data"), P("data")), out_specs=P("data"))
    on_t = pw.jit(lambda a, b: a + b, slice=t, in_specs=(P("x"), P()), out_specs=P("x"))

    @pw.program
    def both(a, b, n):
        for _ in range(n):  # a Python scalar argument of a program is static: control flow may use it
            a = on_s(a, b)
        return a, on_t(b, 1.5)

    a, b = np.arange(4, dtype=np.float32), np.full(4, 2.0, np.float32)
    x, y = both(pw.put(a, s, P("data")), b, 2)
    close(x, a * 4)
    close(y, b + 1.5)
    assert x.slice is s and y.slice is t and y.spec == P("x")
    x, y = both(pw.put(a, s, P("data")), jnp.asarray(b * 2), 1)
    close(x, a * 4)
    close(y, b * 2 + 1.5)


# -- pw.put of pytrees and typed PRNG keys -------------------------------------------------------------------


def test_put_takes_a_pytree_and_a_prefix_of_specs(s):
    params = {"w": np.arange(8, dtype=np.float32).reshape(4, 2), "layers": [np.ones(4, np.float32), 3.0],
              "step": np.int32(7)}
    placed = pw.put(params, s, {"w": P("data", "model"), "layers": P(), "step": None})
    assert jax.tree.structure(placed) == jax.tree.structure(params)
    assert placed["w"].spec == P("data", "model") and placed["layers"][0].spec == P()
    assert placed["layers"][1].weak_type and placed["layers"][1].dtype == np.float32
    jax.tree.map(close, placed, params)
    everywhere = pw.put(params, s, P())
    assert all(leaf.spec == P() for leaf in jax.tree.leaves(everywhere))
    with pytest.raises(pw.ProgramError, match="does not match the structure"):
        pw.put(params, s, {"w": P()})


def test_typed_prng_keys_go_through_put_jit_and_fetch(s):
    key = jax.random.key(42)
    kp = pw.put(key, s)
    assert kp.dtype == key.dtype and kp.shape == () and kp.nbytes == 8
    back = kp.fetch()
    assert back.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))
    split = pw.jit(lambda k: jax.random.split(k, 4), slice=s, out_specs=P("data"))
    normal = pw.jit(lambda k, shape: jax.random.normal(k, shape), slice=s, static_argnums=1)
    keys = split(kp)
    assert keys.shape == (4,) and keys.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(keys.fetch()), jax.random.key_data(jax.random.split(key, 4)))
    close(normal(kp, (3,)), jax.random.normal(key, (3,)))
    close(normal(key, (3,)), jax.random.normal(key, (3,)))  # a key from the client, placed like any array
    rbg = jax.random.key(1, impl="rbg")
    np.testing.assert_array_equal(jax.random.key_data(pw.put(rbg, s).fetch()), jax.random.key_data(rbg))


# -- pw.Array as a read-only jax.Array -----------------------------------------------------------------------


def test_array_reads_like_a_jax_array(s):
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = pw.put(value, s, P("data", "model"))
    j = jax.device_put(value)
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes, len(x)) == (j.shape, j.dtype, j.ndim, j.size, j.nbytes, len(j))
    assert x.sharding.spec == P("data", "model") and dict(x.sharding.mesh.shape) == {"data": 2, "model": 2}
    assert x.block_until_ready() is x
    assert "float32[4, 6]" in repr(x)
    np.testing.assert_array_equal(jax.device_get({"x": x})["x"], value)
    np.testing.assert_array_equal(np.asarray(x), value)
    assert "[[ 0.,  1.," in repr(x)  # once fetched, the value shows
    assert not np.asarray(x).flags.writeable
    total = pw.jit(lambda v: v.sum(), slice=s)(x)
    assert float(total) == float(j.sum()) and int(total) == int(j.sum()) and bool(total) is True
    assert total.item() == 276.0
    index = pw.put(np.int32(2), s)
    assert [10, 20, 30][index] == 30
    with pytest.raises(TypeError, match="only 0-d"):
        float(x)
    with pytest.raises(TypeError, match="len"):
        len(total)


def test_fetch_with_zero_timeout_returns_a_value_that_is_there(s):
    x = pw.put(np.arange(3, dtype=np.float32), s)
    x.block_until_ready()
    fresh = pw.jit(lambda v: v + 1, slice=s)(x)
    fresh.block_until_ready()
    close(fresh.fetch(timeout=0), np.arange(3) + 1)


# -- errors a user can cause -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, words", [
    (2 ** 40, ["1099511627776", "int32"]),
    (np.uint64(2 ** 63), ["9223372036854775808", "uint32"]),
    (1e40, ["1e+40", "float32"]),
    (np.array([1.0, 1e40]), ["1e+40", "index (1,)", "float32"]),
])
def test_values_that_do_not_fit_their_dtype_raise(s, value, words):
    with pytest.raises(pw.ProgramError) as info:
        pw.put(value, s)
    assert all(w in str(info.value) for w in words), info.value
    with pytest.raises(pw.ProgramError, match="does not fit|overflows"):
        pw.jit(lambda v: v, slice=s)(value)


def test_transfer_with_a_bad_spec_raises_program_error(s, t):
    x = pw.put(np.ones((4, 3), np.float32), s)
    with pytest.raises(pw.ProgramError, match="names mesh axis 'data'"):
        pw.transfer(x, t, P("data"))
    with pytest.raises(pw.ProgramError, match="not divisible"):
        pw.transfer(x, t, P(None, "x"))
    with pytest.raises(pw.ProgramError, match="PartitionSpec"):
        pw.transfer(x, t, "x")
    with pytest.raises(pw.ProgramError, match="VirtualSlice"):
        pw.transfer(x, "island 1")

    @pw.program
    def inside(v):
        return pw.transfer(v, t, P("y"))

    with pytest.raises(pw.ProgramError, match="names mesh axis 'y'"):
        inside(x)
    close(pw.transfer(x, t, P("x")), np.ones((4, 3)))


def test_donation_from_several_threads_keeps_each_callers_result(s):
    """Calls that donate their own buffers, from several client threads, never see each other's."""
    step = pw.jit(lambda p: p + 1.0, slice=s, donate_argnums=0)
    results = {}

    def run(k):
        p = pw.put(np.full(8, float(k), np.float32), s)
        for _ in range(5):
            p = step(p)
        results[k] = p.fetch()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(3):
        close(results[k], np.full(8, k + 5.0))


def test_calls_do_not_keep_their_arguments_alive(s):
    import weakref

    f = pw.jit(scale_add, slice=s, static_argnums=1)
    x = pw.put(np.ones(4, np.float32), s)
    out = f(x, 1, scale=2.0)
    close(out, np.full(4, 3.0))
    held = weakref.ref(x)
    del x, out
    gc.collect()
    assert held() is None


def test_transfer_sends_host_values_like_put(cluster, s, t):
    a = np.arange(4, dtype=np.float32)
    moved = pw.transfer(a, t, P("x"))
    assert moved.slice is t and moved.spec == P("x")
    close(moved, a)

    @pw.program
    def place_and_return(v):
        return pw.transfer(v, s, P("data"))

    first, second = place_and_return(a), place_and_return(a)
    assert first.id != second.id  # a placed value the program returns is the caller's own, never a cached one
    close(second, a)
    donate = pw.jit(lambda v: v * 2.0, slice=s, in_specs=(P("data"),), donate_argnums=0)
    close(donate(first), a * 2)
    assert first.is_deleted()
    close(second, a)
