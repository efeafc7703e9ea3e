"""Pipelines from one annotated training step (client/pipeline) on the cluster: every schedule's step equals the
unpipelined step, parameters stay on their stage's slice, the activations held follow each schedule's bound,
and tensor, data and pipeline parallelism compose."""

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

D = 8


def layer(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def make_model(per_stage: int):
    """A residual tanh MLP with a stage mark after every ``per_stage`` layers (the last one included)."""
    def model(params, x):
        for k, p in enumerate(params):
            x = layer(p, x)
            if k % per_stage == per_stage - 1:
                x = pw.pipeline.end_stage(x)
        return x

    return model


def make_step(model, optimizer):
    def loss_fn(params, x, y):
        return jnp.mean((model(params, x) - y) ** 2)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, loss_fn


def make_params(n: int, d: int = D, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32),
             "b": (rng.normal(size=d) * 0.1).astype(np.float32)} for _ in range(n)]


def batch(n: int = 16, d: int = D, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


@pytest.fixture(scope="module")
def four(cluster):
    """Four one-device slices, two per island, alternating: a 4-stage pipeline crosses islands at every hop."""
    made = [pw.slice((1,), ("x",), island=k % 2) for k in range(4)]
    yield made
    for s in made:
        s.release()


def one_step_grads(step, params0, x, y):
    """One step with sgd(1.0): the gradients are params - new params; also the loss and the new params."""
    new, _, loss = step(params0, optax.sgd(1.0).init(params0), x, y)
    return [{k: p0[k] - np.asarray(p1[k]) for k in p0} for p0, p1 in zip(params0, new)], float(np.asarray(loss)), new


def assert_close_trees(got, want, rtol=1e-4, atol=1e-6):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("schedule,layers,per_stage", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 8, 1),
                                                      ("zb-h1", 8, 2)])
def test_every_schedule_gives_the_unpipelined_gradients(four, schedule, layers, per_stage):
    model = make_model(per_stage)
    train_step, loss_fn = make_step(model, optax.sgd(1.0))
    params0, (x, y) = make_params(layers), batch()
    step = pw.pipeline.jit(train_step, four, n_micro=4, schedule=schedule, batch_argnums=(2, 3))
    grads, loss, new = one_step_grads(step, params0, x, y)
    ref_loss, ref = jax.value_and_grad(loss_fn)(params0, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close_trees(grads, ref)
    # each layer's parameters live (and stay) on its stage's slice: stage s on slice s mod 4
    assert [p["w"].slice.key for p in new] == [four[(k // per_stage) % 4].key for k in range(layers)]


def test_adam_over_steps_matches_the_unpipelined_step(four):
    optimizer = optax.adam(0.05)
    train_step, _ = make_step(make_model(1), optimizer)
    params, (x, y) = make_params(4, seed=5), batch(seed=6)
    step = pw.pipeline.jit(train_step, four, n_micro=4, schedule="zb-h1", batch_argnums=(2, 3))
    state = optimizer.init(params)
    ref_params, ref_state = params, state
    losses, ref_losses = [], []
    xa, ya = pw.put(x, four[0]), pw.put(y, four[-1])
    for _ in range(3):
        params, state, loss = step(params, state, xa, ya)
        ref_params, ref_state, ref_loss = jax.jit(train_step)(ref_params, ref_state, x, y)
        losses.append(float(np.asarray(loss)))
        ref_losses.append(float(ref_loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]
    assert_close_trees(params, ref_params, atol=1e-5)
    assert_close_trees(state, ref_state, atol=1e-5)
    mu = state[0].mu  # Adam's moments sit with their parameters
    assert [p["w"].slice.key for p in mu] == [s.key for s in four]


def test_the_step_is_one_program_of_stage_tasks_and_transfers_both_ways(four):
    train_step, _ = make_step(make_model(1), optax.sgd(0.1))
    params0, (x, y) = make_params(4), batch()
    step = pw.pipeline.jit(train_step, four, n_micro=4, batch_argnums=(2, 3))
    graph = step.graph(params0, optax.sgd(0.1).init(params0), x, y)
    assert isinstance(step.step, pw.ProgramFunction) and graph.islands == {0, 1}
    names = [n.name for n in graph.nodes if type(n).__name__ == "Compute"]
    for s in range(4):
        assert names.count(f"stage{s}.F") == 4 and names.count(f"stage{s}.B") == 4, names
        assert names.count(f"stage{s}.update") == 1
    moves = [(n.source.slice.key, n.target.slice.key) for n in graph.nodes if type(n).__name__ == "Transfer"]
    for a, b in zip(four, four[1:]):  # activations forward, their gradients back, once per micro-batch
        assert moves.count((a.key, b.key)) == 4 and moves.count((b.key, a.key)) == 4, moves


@pytest.mark.parametrize("schedule,layers", [("gpipe", 4), ("1f1b", 4), ("interleaved", 8), ("zb-h1", 4)])
def test_activations_held_follow_each_schedules_bound(four, schedule, layers):
    train_step, _ = make_step(make_model(1), optax.sgd(0.1))
    params0, (x, y) = make_params(layers), batch(32)
    step = pw.pipeline.jit(train_step, four, n_micro=8, schedule=schedule, batch_argnums=(2, 3))
    held = step.memory(params0, optax.sgd(0.1).init(params0), x, y)
    plan = step.plan(params0, optax.sgd(0.1).init(params0), x, y)
    peaks = [m.peak_micro_batches for m in held]
    assert peaks == [plan.schedule.in_flight(d) for d in range(4)], peaks
    if schedule in ("1f1b", "zb-h1"):
        assert max(peaks) <= 4  # at most p micro-batches, whatever m is
    if schedule == "gpipe":
        assert peaks[0] == 8  # every micro-batch
    assert all(m.peak_bytes > 0 for m in held)


@pytest.mark.parametrize("inside", ["tensor", "data"])
def test_sharded_stages(cluster, inside):
    """Each stage's slice is a 2-device mesh. "tensor": a Megatron MLP (first matrix split by columns, second by
    rows over "model"); "data": the micro-batch split over "data" (so are the activations between stages)."""
    axis = "model" if inside == "tensor" else "data"
    slices = [pw.slice((2,), (axis,), island=k) for k in range(2)]
    try:
        rng = np.random.default_rng(3)
        params0 = [{"up": (rng.normal(size=(D, 2 * D)) / np.sqrt(D)).astype(np.float32),
                    "down": (rng.normal(size=(2 * D, D)) / np.sqrt(2 * D)).astype(np.float32)} for _ in range(2)]

        def model(params, x):
            for p in params:
                x = pw.pipeline.end_stage(x + jax.nn.gelu(x @ p["up"]) @ p["down"])
            return x

        train_step, loss_fn = make_step(model, optax.sgd(1.0))
        if inside == "tensor":
            specs = (2 * [{"up": P(None, "model"), "down": P("model", None)}], None, None, None)
        else:
            specs = (None, None, P("data"), P("data"))
        step = pw.pipeline.jit(train_step, slices, n_micro=2, schedule="1f1b", batch_argnums=(2, 3), in_specs=specs)
        x, y = batch(8)
        grads, loss, new = one_step_grads(step, params0, x, y)
        ref_loss, ref = jax.value_and_grad(loss_fn)(params0, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert_close_trees(grads, ref)
        graph = step.graph(params0, optax.sgd(1.0).init(params0), x, y)
        hops = [n for n in graph.nodes if type(n).__name__ == "Transfer" and n.source.shape == (4, D)]
        if inside == "tensor":
            assert new[1]["up"].spec == P(None, "model") and new[1]["down"].spec == P("model", None)
        else:
            assert hops and all(n.target.spec == P("data") for n in hops), [n.target.spec for n in hops]
    finally:
        for s in slices:
            s.release()


def test_pipeline_replicas_across_islands(cluster):
    """Two replicas of a 2-stage pipeline, one per island, each on half the batch (data parallel across
    islands, as PaLM's pods): the gradients are the whole batch's, and both replicas hold the same parameters."""
    slices = [[pw.slice((1,), ("x",), island=r) for _ in range(2)] for r in range(2)]
    try:
        train_step, loss_fn = make_step(make_model(1), optax.sgd(1.0))
        params0, (x, y) = make_params(2, seed=8), batch(32, seed=9)
        step = pw.pipeline.jit(train_step, slices, n_micro=2, schedule="1f1b", batch_argnums=(2, 3))
        grads, loss, new = one_step_grads(step, params0, x, y)
        ref_loss, ref = jax.value_and_grad(loss_fn)(params0, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert_close_trees(grads, ref)
        graph = step.step.last_graph
        ran = {(n.name, n.slice.island) for n in graph.nodes if type(n).__name__ == "Compute"}
        assert {("stage1.F", 0), ("stage1.F", 1), ("stage0.update", 0), ("stage0.update", 1)} <= ran
        # the next step reads each replica's own copy of the parameters: none moves between islands; with the
        # batch on island 0, replica 1 receives its micro-batches, not the whole batch
        xa, ya = pw.put(x, slices[0][0]), pw.put(y, slices[0][1])
        step(new, optax.sgd(1.0).init(params0), xa, ya)
        graph = step.step.last_graph
        params_in = {v.slot for v in graph.inputs if v.shape != x.shape}
        moves = [n for n in graph.nodes if type(n).__name__ == "Transfer"]
        moved = [n for n in moves if n.source.slot in params_in]
        assert not moved, [(n.source.describe(), n.source.slice.key, n.target.slice.key) for n in moved]
        assert not [n for n in moves if n.source.shape == x.shape]
        assert sum(n.source.shape == (8, D) and n.target.slice.island == 1 for n in moves) >= 4
    finally:
        for rep in slices:
            for s in rep:
                s.release()


def test_data_tensor_and_pipeline_parallelism_in_one_program(cluster, tmp_path):
    """3D: two replicas (one per island, as pods) of a 2-stage ZB-H1 pipeline whose stages are 2-device slices
    running a Megatron MLP over "model". Two Adam steps equal the unpipelined step's on the whole batch (so
    both replicas apply the same update from the same parameters); only gradients (and the loss) cross
    islands; the second step reads each replica's own copy of the state; a trace shows all four devices."""
    slices = [[pw.slice((2,), ("model",), island=r) for _ in range(2)] for r in range(2)]
    try:
        rng = np.random.default_rng(11)
        params = [{"up": (rng.normal(size=(D, 2 * D)) / np.sqrt(D)).astype(np.float32),
                   "down": (rng.normal(size=(2 * D, D)) / np.sqrt(2 * D)).astype(np.float32)} for _ in range(2)]

        def model(params, x):
            for p in params:
                x = pw.pipeline.end_stage(x + jax.nn.gelu(x @ p["up"]) @ p["down"])
            return x

        optimizer = optax.adam(0.05)
        train_step, _ = make_step(model, optimizer)
        specs = (2 * [{"up": P(None, "model"), "down": P("model", None)}], None, None, None)
        step = pw.pipeline.jit(train_step, slices, n_micro=2, schedule="zb-h1", batch_argnums=(2, 3),
                               in_specs=specs)
        x, y = batch(24, seed=12)  # 2 replicas x 2 micro-batches of 6 rows
        state = optimizer.init(params)
        ref_params, ref_state = params, state
        losses, ref_losses = [], []
        for k in range(2):
            if k == 1:
                with pw.trace(tmp_path / "trace.json"):
                    params, state, loss = step(params, state, x, y)
                    jax.tree_util.tree_map(lambda a: a.block_until_ready(), (params, state, loss))
            else:
                params, state, loss = step(params, state, x, y)
            ref_params, ref_state, ref_loss = jax.jit(train_step)(ref_params, ref_state, x, y)
            losses.append(float(np.asarray(loss)))
            ref_losses.append(float(ref_loss))
            graph = step.step.last_graph
            # each replica's slices received its share of the client's batch, not the whole batch
            assert sorted(v.slice.island for v in graph.inputs if v.shape == (12, D)) == [0, 0, 1, 1]
            assert not [v for v in graph.inputs if v.shape == x.shape]
            if k == 0:
                param_shapes = {a.shape for a in jax.tree_util.tree_leaves(params)}
                crossing = {n.source.shape for n in graph.nodes if type(n).__name__ == "Transfer"
                            and n.source.slice.island != n.target.slice.island}
                assert crossing == param_shapes | {()}, crossing  # gradients and the loss, no activations
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
        assert_close_trees(params, ref_params, atol=1e-5)
        assert_close_trees(state, ref_state, atol=1e-5)
        assert [p["up"].slice.key for p in params] == [s.key for s in slices[0]]
        assert params[1]["up"].spec == P(None, "model") and params[1]["down"].spec == P("model", None)
        ran = {(n.name, n.slice.key) for n in graph.nodes if type(n).__name__ == "Compute"}
        for rep in slices:  # every replica ran its own stages' work on its own slices
            for s, where in enumerate(rep):  # (the first stage has no input gradient, so no separate W)
                kinds = ["F", "B", "update"] + (["W"] if s else [])
                assert {(f"stage{s}.{kind}", where.key) for kind in kinds} <= ran, (s, where.key, ran)
        inputs = {v.slot for v in graph.inputs}
        moved = [n for n in graph.nodes if type(n).__name__ == "Transfer" and n.source.slot in inputs
                 and n.source.slice.island != n.target.slice.island]
        assert not moved, [(n.source.describe(), n.source.slice.key, n.target.slice.key) for n in moved]
        measured = step.measured_bubble(tmp_path / "trace.json")
        assert measured.steps == 1 and len(measured.per_device) == 4
        assert all(0.0 <= b < 1.0 for b in measured.per_device), measured.per_device
    finally:
        for rep in slices:
            for s in rep:
                s.release()


def _peak_buffer_bytes(session, step, args, timeout=60.0) -> int:
    """Poll island 0's buffer-table bytes while one step runs: the peak above what it held before."""
    before = host_stats(session, 0)
    done = before["completed"]
    out = step(*args)
    peak, deadline = before["buffer_bytes"], time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = host_stats(session, 0)
        peak = max(peak, stats["buffer_bytes"])
        if stats["completed"] > done and stats["queue_depth"] == 0:
            break
    jax.tree_util.tree_map(lambda a: a.block_until_ready(), out)
    return peak - before["buffer_bytes"]


def test_hosts_hold_less_under_1f1b_than_gpipe(cluster):
    """The hosts' buffer tables agree with the replay: stage 0's island holds a fraction under 1F1B."""
    slices = [pw.slice((1,), ("x",), island=k) for k in range(2)]
    try:
        d, m, rows = 256, 8, 512
        train_step, _ = make_step(make_model(1), optax.sgd(0.1))
        params0 = make_params(2, d=d)
        x, y = batch(m * rows, d=d)
        xa, ya = pw.put(x, slices[0]), pw.put(y, slices[1])
        measured = {}
        for schedule in ("gpipe", "1f1b"):
            step = pw.pipeline.jit(train_step, slices, n_micro=m, schedule=schedule, batch_argnums=(2, 3))
            params, state, _ = step(params0, optax.sgd(0.1).init(params0), xa, ya)  # placed, compiled
            measured[schedule] = max(_peak_buffer_bytes(cluster, step, (params, state, xa, ya)) for _ in range(3))
        assert measured["1f1b"] < measured["gpipe"] / 2, measured
    finally:
        for s in slices:
            s.release()


def test_bad_input_raises_clear_errors(four):
    train_step, _ = make_step(make_model(1), optax.sgd(0.1))
    params0, (x, y) = make_params(4), batch()
    state = optax.sgd(0.1).init(params0)
    with pytest.raises(pw.ProgramError, match="unknown pipeline schedule 'zigzag'.*gpipe, 1f1b, interleaved, zb-h1"):
        pw.pipeline.jit(train_step, four, n_micro=2, schedule="zigzag", batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="n_micro must be a positive int"):
        pw.pipeline.jit(train_step, four, n_micro=0, batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="slices must come from pw.slice"):
        pw.pipeline.jit(train_step, ["s0"], n_micro=2, batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="batch_argnums must name"):
        pw.pipeline.jit(train_step, four, n_micro=2, batch_argnums=())
    with pytest.raises(pw.ProgramError, match=r"n_micro \(6\) must be a multiple of the number of slices \(4\)"):
        pw.pipeline.jit(train_step, four, n_micro=6, schedule="interleaved", batch_argnums=(2, 3))
    step = pw.pipeline.jit(train_step, four, n_micro=3, batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="batch 16 does not split into 1 x 3 equal micro-batches"):
        step(params0, state, x, y)
    step = pw.pipeline.jit(train_step, four[:3], n_micro=2, batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="marks 4 stage.*runs on 3 slices"):
        step(params0, state, x, y)
    step = pw.pipeline.jit(train_step, four, n_micro=4, schedule="interleaved", batch_argnums=(2, 3))
    with pytest.raises(pw.ProgramError, match="interleaved schedule runs at least 2 stages"):
        step(params0, state, x, y)

    def sized(params, opt_state, x, y):  # Python control flow on the batch size
        return train_step(params, opt_state, x, y) if x.shape[0] > 4 else train_step(params, opt_state, x * 2, y)

    with pytest.raises(pw.ProgramError, match="different computations at micro-batch sizes 4 and 8"):
        pw.pipeline.jit(sized, four, n_micro=4, batch_argnums=(2, 3))(params0, state, x, y)

    def per_example(params, opt_state, x, y):
        return make_model(1)(params, x)

    with pytest.raises(pw.ProgramError, match="returns a per-example value"):
        pw.pipeline.jit(per_example, four, n_micro=2, batch_argnums=(2, 3))(params0, state, x, y)
