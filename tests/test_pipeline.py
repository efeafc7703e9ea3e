"""Pipeline parallelism across islands (client/pipeline.py): gradients match the unpipelined model, schedules
emit valid orders, and 1F1B bounds the live activations."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import host_stats
from jax.sharding import PartitionSpec as P

import pathways as pw
from client import pipeline as pp

D = 8


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def make_params(n: int, d: int = D, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32), "b": rng.normal(size=d).astype(np.float32)
             * 0.1} for _ in range(n)]


def full_loss(params, x, t):
    for p in params:
        x = layer(p, x)
    return mse(x, t)


def batch(n: int = 16, d: int = D, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


@pytest.fixture(scope="module")
def slices(cluster):
    made = [pw.slice((1,), ("x",), island=0), pw.slice((1,), ("x",), island=1),
            pw.slice((1,), ("x",), island=0), pw.slice((2,), ("x",), island=1)]
    yield made
    for s in made:
        s.release()


def grads_of(pipe: pp.Pipeline, params0: list, x: np.ndarray, t: np.ndarray) -> tuple[list, float]:
    """Gradients of one step with optax.sgd(1.0): new params = params - grads."""
    params, opt = pipe.init(params0)
    new, _, loss = pipe.step(params, opt, pw.put(x, pipe.stages[0].slice), pw.put(t, pipe.stages[-1].slice))
    grads = [{k: p0[k] - np.asarray(p1[k]) for k in p0} for p0, p1 in zip(params0, new)]
    return grads, float(np.asarray(loss))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("remat", [False, True])
def test_grads_match_unpipelined(slices, schedule, remat):
    s0, s1 = slices[:2]
    params0, (x, t) = make_params(2), batch()
    pipe = pp.build([pp.Stage(layer, s0), pp.Stage(layer, s1)], mse, optax.sgd(1.0), n_micro=4,
                    schedule=schedule, remat=remat)
    grads, loss = grads_of(pipe, params0, x, t)
    assert_matches_unpipelined(grads, loss, params0, x, t)


def assert_matches_unpipelined(grads, loss, params0, x, t) -> None:
    ref_loss, ref = jax.value_and_grad(full_loss)(params0, x, t)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref):
        for k in g:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-4, atol=1e-6)


def test_three_stages_two_on_one_island_with_a_sharded_stage(slices):
    """Stages 0 and 1 share island 0 on different slices; stage 2 splits its micro-batch over 2 devices."""
    a, _, b, wide = slices
    params0, (x, t) = make_params(3, seed=3), batch(24, seed=4)
    stages = [pp.Stage(layer, a), pp.Stage(layer, b), pp.Stage(layer, wide, in_spec=P("x"), out_spec=P("x"))]
    pipe = pp.build(stages, mse, optax.sgd(1.0), n_micro=3, schedule="1f1b", target_spec=P("x"))
    grads, loss = grads_of(pipe, params0, x, t)
    assert_matches_unpipelined(grads, loss, params0, x, t)


def block(p, x):
    """A pre-norm Transformer block (one head, causal), to pipeline something with attention and layer norm."""
    h = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(x.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], bool)), scores, -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), v) @ p["o"]
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def test_transformer_blocks_and_a_single_stage(slices):
    rng = np.random.default_rng(7)
    shapes = {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "up": (D, 2 * D), "down": (2 * D, D)}
    params0 = [{k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
               for _ in range(2)]
    x, t = (rng.normal(size=(4, 6, D)).astype(np.float32) for _ in range(2))

    def ref_loss(ps, x, t):
        for p in ps:
            x = block(p, x)
        return mse(x, t)

    ref = jax.grad(ref_loss)(params0, x, t)
    pipe = pp.build([pp.Stage(block, slices[0]), pp.Stage(block, slices[1])], mse, optax.sgd(1.0), n_micro=2)
    for g, r in zip(grads_of(pipe, params0, x, t)[0], ref):
        for k in g:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-4, atol=1e-5)
    single = pp.build([pp.Stage(block, slices[0])], mse, optax.sgd(1.0), n_micro=2)
    g1 = jax.grad(ref_loss)(params0[:1], x, t)[0]
    grads, loss = grads_of(single, params0[:1], x, t)
    np.testing.assert_allclose(loss, ref_loss(params0[:1], x, t), rtol=1e-5)
    for k in g1:
        np.testing.assert_allclose(grads[0][k], g1[k], rtol=1e-4, atol=1e-5)


def test_schedules_agree_with_unpipelined_adam_over_steps(slices):
    s0, s1 = slices[:2]
    params0, (x, t) = make_params(2, seed=5), batch(seed=6)
    opt = optax.adam(0.05)
    results = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = pp.build([pp.Stage(layer, s0), pp.Stage(layer, s1)], mse, opt, n_micro=4, schedule=schedule)
        params, states = pipe.init(params0)
        xa, ta = pw.put(x, s0), pw.put(t, s1)
        losses = []
        for _ in range(3):
            params, states, loss = pipe.step(params, states, xa, ta)
            losses.append(float(np.asarray(loss)))
        results[schedule] = (losses, [{k: np.asarray(v) for k, v in p.items()} for p in params])
    ref_params, ref_state, ref_losses = params0, opt.init(params0), []
    for _ in range(3):
        loss, g = jax.value_and_grad(full_loss)(ref_params, x, t)
        updates, ref_state = opt.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        ref_losses.append(float(loss))
    for losses, params in results.values():
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
        assert losses[-1] < losses[0]
        for p, r in zip(params, ref_params):
            for k in p:
                np.testing.assert_allclose(p[k], r[k], rtol=1e-4, atol=1e-5)
    for p, q in zip(results["gpipe"][1], results["1f1b"][1]):
        for k in p:
            np.testing.assert_allclose(p[k], q[k], rtol=1e-6, atol=1e-7)


def test_the_step_is_one_program_with_transfers_both_ways(slices):
    s0, s1 = slices[:2]
    pipe = pp.build([pp.Stage(layer, s0), pp.Stage(layer, s1)], mse, optax.sgd(0.1), n_micro=4)
    params, opt = pipe.init(make_params(2))
    x, t = batch()
    graph = pipe.step.graph(params, opt, pw.put(x, s0), pw.put(t, s1))
    assert isinstance(pipe.step, pw.ProgramFunction) and graph.islands == {0, 1}
    moves = [(n.source.slice.island, n.target.slice.island) for n in graph.nodes if type(n).__name__ == "Transfer"]
    assert moves.count((0, 1)) == 4 and moves.count((1, 0)) == 4  # activations forward, gradients back
    names = [n.name for n in graph.nodes if type(n).__name__ == "Compute"]
    assert names.count("stage0.update") == 1 and names.count("stage1.update") == 1


@pytest.mark.parametrize("n_stages,n_micro", [(2, 8), (3, 6), (4, 8)])
def test_emission_order_is_valid_and_receives_precede_consumers(n_stages, n_micro):
    for schedule in pp.SCHEDULES:
        per_stage = pp.stage_order(n_stages, n_micro, schedule)
        order = pp.emission_order(per_stage)
        done = set()
        for item in order:
            if item[0] == "T":
                _, what, src, dst, i = item
                assert (src, "F" if what == "x" else ("FB" if src == n_stages - 1 else "B"), i) in done
                done.add(("T", what, src, dst, i))
            else:
                _, s, kind, i = item
                if kind in ("F", "FB") and s > 0:
                    assert ("T", "x", s - 1, s, i) in done
                if kind == "B":
                    assert ("T", "dx", s + 1, s, i) in done
                done.add((s, kind, i))
        for s in range(n_stages):  # each stage keeps its schedule's order
            assert [(k, i) for c, st, k, i in (it for it in order if it[0] == "C") if st == s] == per_stage[s]
        assert sum(it[0] == "T" for it in order) == 2 * (n_stages - 1) * n_micro
        for k, item in enumerate(order):  # a receive comes right before its consumer on the destination
            if item[0] == "T":
                _, what, src, dst, i = item
                consumer = next(it for it in order[k + 1:] if it[0] == "C" and it[1] == dst)
                assert consumer[3] == i and (consumer[2] == "B") == (what == "dx")


def test_1f1b_bounds_live_activations_by_stages_gpipe_by_micro_batches(slices):
    s0, s1 = slices[:2]
    params0, (x, t) = make_params(2), batch(32)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            pipe = pp.build([pp.Stage(layer, s0), pp.Stage(layer, s1)], mse, optax.sgd(0.1), n_micro=m,
                            schedule=schedule)
            params, opt = pipe.init(params0)
            peaks[schedule, m] = pipe.memory(params, opt, pw.put(x, s0), pw.put(t, s1))
    for m in (4, 8):
        assert max(st.peak_micro_batches for st in peaks["1f1b", m]) <= 2  # <= S, whatever M is
        assert peaks["gpipe", m][0].peak_micro_batches == m  # stage 0 holds every micro-batch
    # The batch is fixed: GPipe holds the whole batch's activations at any M (give or take the one incoming
    # gradient its first backward reads), 1F1B only S micro-batches.
    assert abs(peaks["gpipe", 8][0].peak_bytes - peaks["gpipe", 4][0].peak_bytes) <= x.nbytes // 4
    assert peaks["1f1b", 8][0].peak_bytes == peaks["1f1b", 4][0].peak_bytes // 2


def test_1f1b_bound_holds_for_more_stages_than_islands(slices):
    a, last, b = slices[:3]
    pipe = pp.build([pp.Stage(layer, a), pp.Stage(layer, b), pp.Stage(layer, last)], mse, optax.sgd(0.1),
                    n_micro=8, schedule="1f1b")
    params, opt = pipe.init(make_params(3))
    x, t = batch(32)
    peaks = [st.peak_micro_batches for st in pipe.memory(params, opt, pw.put(x, a), pw.put(t, last))]
    assert max(peaks) <= 3 and peaks[0] == 3, peaks


def _peak_buffer_bytes(session, pipe, params, opt, xa, ta, timeout=60.0) -> tuple[int, float]:
    """Dynamic check: poll island 0's buffer-table bytes while one step runs; (peak - before, loss)."""
    before = host_stats(session, 0)
    base = before["buffer_bytes"]
    done = before["completed"]
    _, _, loss = pipe.step(params, opt, xa, ta)
    peak, deadline = base, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = host_stats(session, 0)
        peak = max(peak, stats["buffer_bytes"])
        if stats["completed"] > done and stats["queue_depth"] == 0:
            break
    return peak - base, float(np.asarray(loss))


def test_buffer_bytes_during_a_step_1f1b_below_gpipe(cluster, slices):
    """The hosts' buffer tables agree: 1F1B's peak on the first stage is a fraction of GPipe's."""
    s0, s1 = slices[:2]
    d, m, rows = 256, 8, 512
    params0 = make_params(2, d=d)
    x, t = batch(m * rows, d=d)
    xa, ta = pw.put(x, s0), pw.put(t, s1)
    measured, static = {}, {}
    for schedule in ("gpipe", "1f1b"):
        pipe = pp.build([pp.Stage(layer, s0), pp.Stage(layer, s1)], mse, optax.sgd(0.1), n_micro=m,
                        schedule=schedule)
        params, opt = pipe.init(params0)
        _peak_buffer_bytes(cluster, pipe, params, opt, xa, ta)  # compile
        measured[schedule] = max(_peak_buffer_bytes(cluster, pipe, params, opt, xa, ta)[0] for _ in range(3))
        static[schedule] = pipe.memory(params, opt, xa, ta)[0].peak_bytes
    print("island 0 peak bytes above the step's inputs, measured:", measured, "static activations:", static)
    assert measured["1f1b"] < measured["gpipe"] / 2, measured
    assert measured["gpipe"] > static["gpipe"] / 2, (measured, static)


def test_bad_input_raises_clear_errors(slices):
    s0, s1 = slices[:2]
    stages = [pp.Stage(layer, s0), pp.Stage(layer, s1)]
    with pytest.raises(pw.ProgramError, match="unknown pipeline schedule 'zigzag'.*gpipe, 1f1b"):
        pp.build(stages, mse, optax.sgd(0.1), n_micro=2, schedule="zigzag")
    with pytest.raises(pw.ProgramError, match="at least one stage"):
        pp.build([], mse, optax.sgd(0.1), n_micro=2)
    with pytest.raises(pw.ProgramError, match="n_micro must be a positive int"):
        pp.build(stages, mse, optax.sgd(0.1), n_micro=0)
    with pytest.raises(pw.ProgramError, match="wrap it as pw.pipeline.Stage"):
        pp.build([layer], mse, optax.sgd(0.1), n_micro=2)
    with pytest.raises(pw.ProgramError, match="optax GradientTransformation"):
        pp.build(stages, mse, "adam", n_micro=2)

    pipe = pp.build(stages, mse, optax.sgd(0.1), n_micro=3)
    params, opt = pipe.init(make_params(2))
    x, t = batch()
    with pytest.raises(pw.ProgramError, match="batch 16 does not split into 3 equal micro-batches"):
        pipe.step(params, opt, pw.put(x, s0), pw.put(t, s1))
    with pytest.raises(pw.ProgramError, match="init got params for 1 stages"):
        pipe.init(make_params(1))

    wide = make_params(2)
    wide[1] = {"w": np.zeros((D + 1, D), np.float32), "b": np.zeros(D, np.float32)}
    pipe = pp.build(stages, mse, optax.sgd(0.1), n_micro=2)
    params, opt = pipe.init(wide)
    with pytest.raises(pw.ProgramError, match=r"stage 1 cannot take the output of stage 0 \(float32\[8, 8\]\)"):
        pipe.step(params, opt, pw.put(x, s0), pw.put(t, s1))
    params, opt = pipe.init(make_params(2))
    with pytest.raises(pw.ProgramError, match="params of stage 1 live on slice .* place them with Pipeline.init"):
        pipe.step([params[0], params[0]], opt, pw.put(x, s0), pw.put(t, s1))
    with pytest.raises(pw.ProgramError, match="loss_fn cannot take"):
        pp.build(stages, mse, optax.sgd(0.1), n_micro=2).step(params, opt, pw.put(x, s0),
                                                             pw.put(t[:, :3].copy(), s1))
