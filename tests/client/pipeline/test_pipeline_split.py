"""The cut of one annotated training step into stage tasks (client/pipeline/trace.py, split.py), checked
without a cluster: running the tasks locally in each schedule's order gives the unpipelined step, for models
with attention, tied embeddings, skip connections across stages and gradient clipping across stages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pathways as pw
from client.pipeline import order, schedules
from client.pipeline.planning import _task_fn
from client.pipeline.split import split_step
from client.pipeline.trace import trace_step

D = 8


def plan(fn, args, batch_argnums, n_micro, schedule, n_devices):
    leaves, tree = jax.tree_util.tree_flatten(args)
    batch_ids = {id(x) for i in batch_argnums for x in jax.tree_util.tree_leaves(args[i])}
    batch = {k for k, x in enumerate(leaves) if id(x) in batch_ids}
    size = next(np.shape(leaves[k])[0] for k in batch)
    structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype) for x in leaves]

    def flat(*xs):
        return fn(*jax.tree_util.tree_unflatten(tree, xs))

    graph = trace_step(flat, structs, batch, size // n_micro, "step")
    split = split_step(graph, batch, schedule == "zb-h1", "step")
    return split, schedules.make(schedule, n_devices, n_micro, split.n_stages // n_devices), leaves


def run_locally(fn, args, batch_argnums, n_micro, schedule, n_devices):
    """The pipelined step, its tasks run here with JAX in the order the runtime emits them."""
    split, sched, leaves = plan(fn, args, batch_argnums, n_micro, schedule, n_devices)
    graph = split.graph
    size = next(np.shape(leaves[graph.inputs.index(v)])[0] for v in split.batch_inputs) // n_micro
    lanes = [[w for w in seq if (w.stage, w.kind, 0) in split.tasks] for seq in sched.order]

    def deps(lane, w):
        task = split.tasks[(w.stage, w.kind, 0)]
        return [(sched.device_of(s), schedules.Work(k, s, w.micro)) for s, k, _ in split.deps(task)]

    timed = order.emission(schedule, lanes, deps, list(range(n_devices)), lambda w: 1.0)
    inputs = dict(zip(graph.inputs, leaves))
    values, sums = {}, {}

    def read(v, i):
        if v in split.batch_inputs:
            return inputs[v][i * size:(i + 1) * size]
        return inputs[v] if v in inputs else values[(v, i if v in split.per_micro else None)]

    for t in timed:
        task = split.tasks[(t.work.stage, t.work.kind, 0)]
        acc = sums.get(task.key)
        outs = _task_fn(task, [False] * len(task.ins), 1, 1.0, acc is not None)(
            *[read(v, t.work.micro) for v in task.ins], *(acc or ()))
        values.update({(v, t.work.micro): o for v, o in zip(task.outs, outs)})
        if task.sums:
            sums[task.key] = list(outs[len(task.outs):])
    for task in split.updates():
        means = [v in split.per_micro for v in task.ins]
        ins = [sums[split.producer[v]][split.tasks[split.producer[v]].sums.index(v)] if mean else read(v, None)
               for v, mean in zip(task.ins, means)]
        outs = _task_fn(task, means, 1, 1.0 / n_micro, False)(*ins)
        values.update({(v, None): o for v, o in zip(task.outs, outs)})
    result = [inputs[o] if o in inputs else values[(o, None)] for o in graph.outputs]
    return jax.tree_util.tree_unflatten(graph.out_tree, result), split


def train(model, optimizer):
    def loss_fn(params, x, y):
        return jnp.mean((model(params, x) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def mlp(per_stage):
    def model(params, x):
        for k, p in enumerate(params):
            x = x + jnp.tanh(x @ p["w"] + p["b"])
            if k % per_stage == per_stage - 1:
                x = pw.pipeline.end_stage(x)
        return x

    return model


def mlp_params(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32),
             "b": (rng.normal(size=D) * 0.1).astype(np.float32)} for _ in range(n)]


def data(n=16, seed=1, shape=(D,)):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *shape)).astype(np.float32), rng.normal(size=(n, *shape)).astype(np.float32)


def assert_same_step(got, want, rtol=1e-4, atol=1e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("schedule,layers,per_stage", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 8, 1),
                                                      ("zb-h1", 8, 2)])
def test_tasks_run_in_schedule_order_give_the_unpipelined_step(schedule, layers, per_stage):
    optimizer = optax.adam(0.01)
    step = train(mlp(per_stage), optimizer)
    params = mlp_params(layers)
    args = (params, optimizer.init(params), *data())
    got, _ = run_locally(step, args, (2, 3), 4, schedule, 4)
    assert_same_step(got, jax.jit(step)(*args))


def test_split_puts_each_stage_where_its_marks_say():
    optimizer = optax.adam(0.01)
    params = mlp_params(4)
    args = (params, optimizer.init(params), *data())
    split, _, _ = plan(train(mlp(1), optimizer), args, (2, 3), 4, "zb-h1", 4)
    graph = split.graph
    assert split.n_stages == 4
    homes = [split.home[graph.inputs[k]] for k in range(8)]  # params leaves: b, w per layer
    assert homes == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {(s, k) for s, k, _ in split.tasks} == {(s, k) for s in range(4) for k in "FBU"} | {(1, "W"), (2, "W"),
                                                                                                (3, "W")}
    # the loss is the last stage's: its forward sums the squared errors over micro-batches, its update scales them
    loss = graph.outputs[-1]
    assert split.producer[loss] == (3, "U", 0) and split.tasks[(3, "F", 0)].sums
    for s in range(1, 4):  # B computes the gradient the previous stage reads; W only sums weight gradients
        w, b = split.tasks[(s, "W", 0)], split.tasks[(s, "B", 0)]
        assert not w.outs and w.sums and {e.prim.name for e in w.eqns} <= {"dot_general", "reduce_sum", "transpose",
                                                                             "reshape"}
        assert any(split.producer.get(v) == b.key for v in split.tasks[(s - 1, "B", 0)].ins)
    assert not any(k == (0, "W", 0) for k in split.tasks)  # the first stage sends no gradient: one B


def test_transformer_with_tied_embeddings_skip_across_stages_and_global_clipping():
    """Attention and layer norm, an embedding matrix used by the first and the last stage, the embedded input
    added again on the last stage, and gradient clipping by the global norm across every stage's gradients."""
    rng = np.random.default_rng(7)
    vocab, seq = 11, 6
    shapes = {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "up": (D, 2 * D), "down": (2 * D, D)}
    params = {"embed": (rng.normal(size=(vocab, D)) * 0.3).astype(np.float32),
              "blocks": [{k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
                         for _ in range(3)]}

    def block(p, x):
        h = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
        scores = jnp.einsum("btd,bsd->bts", h @ p["q"], h @ p["k"]) / np.sqrt(D)
        scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], bool)), scores, -1e9)
        x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), h @ p["v"]) @ p["o"]
        return x + jax.nn.gelu(x @ p["up"]) @ p["down"]

    def loss_fn(params, tokens, targets):
        x0 = params["embed"][tokens]
        x = x0
        for p in params["blocks"]:
            x = pw.pipeline.end_stage(block(p, x))
        logits = (x + x0) @ params["embed"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(0.01))

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "norm": norm}

    tokens, targets = (rng.integers(0, vocab, size=(8, seq)).astype(np.int32) for _ in range(2))
    args = (params, optimizer.init(params), tokens, targets)
    want = jax.jit(step)(*args)
    got, split = run_locally(step, args, (2, 3), 2, "zb-h1", 3)
    assert_same_step(got, want)
    embed = split.graph.inputs[0]
    assert split.home[embed] == 0  # read first by stage 0, moved to the last stage
    assert any(t.kind == "U" and t.level > 0 for t in split.tasks.values())  # the global norm crosses stages


def test_a_step_that_cannot_be_cut_is_refused_clearly():
    params = mlp_params(2)
    x, y = data()

    def scanned(params, opt_state, x, y):
        def body(c, p):
            return pw.pipeline.end_stage(c + jnp.tanh(c @ p["w"])), None
        stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params)
        return jnp.mean((jax.lax.scan(body, x, stacked)[0] - y) ** 2)

    with pytest.raises(pw.ProgramError, match="stage mark inside scan .* cannot be cut"):
        plan(scanned, (params, (), x, y), (2, 3), 4, "1f1b", 1)
