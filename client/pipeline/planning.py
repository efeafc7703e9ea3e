"""Planning a pipelined step: for one argument signature, trace the step, cut it into per-stage tasks, and fix
the schedule, each value's PartitionSpec on its slice, a ``pw.jit`` function per task and the order the
program body calls them in. ``client.pipeline.runner`` keeps one ``Plan`` per signature and runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from client.host_values import broadcast_specs
from client.jit import CompiledFunction
from client.jit import jit as pw_jit
from client.meshes import tracing_on
from client.pipeline import order, schedules
from client.pipeline.marker import END_STAGE, END_STAGE_BWD
from client.pipeline.split import Split, Task, split_step
from client.pipeline.trace import Const, trace_step
from client.slices import VirtualSlice
from pathways.errors import ProgramError
from pathways.sharding import check_spec

COST = {"F": 1.0, "B": 1.0, "W": 1.0}  # the emission's cost model; B without W counts twice


@dataclass(frozen=True)
class Step:
    """What ``pw.pipeline.jit`` was given: the step function, its replicas' slices, the micro-batches, the
    schedule's name, the batch arguments, the arguments' specs and the name."""

    fn: Callable
    replicas: list[list[VirtualSlice]]
    n_micro: int
    schedule: str
    batch_argnums: tuple[int, ...]
    in_specs: Any
    name: str

    @property
    def slices(self) -> list[VirtualSlice]:
        """The first replica's slices, one per device of the schedule."""
        return self.replicas[0]


@dataclass
class Plan:
    """Everything one argument signature needs: the split, the schedule, the functions and the order."""

    split: Split
    schedule: schedules.Schedule
    arrays: list[int]  # positions of the array leaves among the call's leaves
    batch: dict[int, int]  # array-leaf index -> its batch leaf position (as in ``arrays``)
    micro: int  # rows per micro-batch
    fns: dict[tuple, CompiledFunction] = field(default_factory=dict)
    emitted: list[order.Timed] = field(default_factory=list)
    specs: dict[tuple[int, str], P] = field(default_factory=dict)


def make_plan(step: Step, leaves: list, treedef: Any) -> Plan:
    """Trace the step for one argument signature (abstract ``leaves``), split it, and fix its schedule, specs,
    functions and emission order."""
    args = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    if len(args) <= max(step.batch_argnums):
        raise ProgramError(f"pw.pipeline.jit({step.name}): batch_argnums {step.batch_argnums} but the step was "
                           f"called with {len(args)} arguments")
    batch_pos = {k for i in step.batch_argnums for k in jax.tree_util.tree_leaves(args[i])}
    arrays = [k for k, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    batch = {j: k for j, k in enumerate(arrays) if k in batch_pos}
    sizes = {leaves[k].shape[0] if leaves[k].shape else None for k in batch.values()}
    n_rep, m = len(step.replicas), step.n_micro
    if not batch or len(sizes) != 1 or None in sizes:
        raise ProgramError(f"pw.pipeline.jit({step.name}): the batch arguments (batch_argnums "
                           f"{step.batch_argnums}) must be arrays sharing their leading (batch) dimension")
    size = sizes.pop()
    if size % (m * n_rep):
        raise ProgramError(f"pw.pipeline.jit({step.name}): batch {size} does not split into {n_rep} x {m} equal "
                           "micro-batches (replicas x n_micro)")
    micro = size // (m * n_rep)

    def flat(*xs: Any) -> Any:
        full = list(leaves)
        for k, x in zip(arrays, xs):
            full[k] = x
        return step.fn(*jax.tree_util.tree_unflatten(treedef, full))

    meshes = {where.mesh_key for replica in step.replicas for where in replica}
    # one mesh for every slice: the step is traced with it as JAX's context mesh, as each stage is exported
    with tracing_on(step.slices[0]) if len(meshes) == 1 else contextlib.nullcontext():
        graph = trace_step(flat, [leaves[k] for k in arrays], set(batch), micro, step.name)
    split = split_step(graph, set(batch), step.schedule == "zb-h1", step.name)
    p = len(step.slices)
    if split.n_stages % p:
        raise ProgramError(f"pw.pipeline.jit({step.name}): the step marks {split.n_stages} stage(s) "
                           f"(pw.pipeline.end_stage calls in sequence, the last stage's included) but runs on "
                           f"{p} slices; mark one stage per slice (or, interleaved, the same number per slice)")
    schedule = schedules.make(step.schedule, p, m, split.n_stages // p)
    for v in split.per_micro:
        if v not in split.batch_inputs and any(v in t.sums for t in split.tasks.values()):
            if not jnp.issubdtype(graph.avals[v].dtype, jnp.inexact):
                raise ProgramError(f"pw.pipeline.jit({step.name}): the update reads a {graph.avals[v].dtype} value "
                                   "computed from the batch; pipelining averages such values over micro-batches, "
                                   "which needs floating-point values (a loss, gradients)")
    plan = Plan(split, schedule, arrays, batch, micro)
    _specs(step, plan, leaves, treedef)
    _functions(step, plan)
    _order(step, plan)
    return plan

def _specs(step: Step, plan: Plan, leaves: list, treedef: Any) -> None:
    """The PartitionSpec of every value a task reads or writes, per slice (see ``spec_of``)."""
    split, graph = plan.split, plan.split.graph
    args = jax.tree_util.tree_unflatten(treedef, leaves)
    prefix = step.in_specs
    if prefix is None or isinstance(prefix, P):
        prefix = (prefix,) * len(args)
    if not isinstance(prefix, (tuple, list)) or len(prefix) != len(args):
        raise ProgramError(f"pw.pipeline.jit({step.name}): in_specs must be None, one PartitionSpec or a tuple "
                           f"with one entry per argument of the step ({len(args)})")
    per_leaf = broadcast_specs(tuple(prefix), tuple(args), f"pw.pipeline.jit({step.name}): in_specs")
    given = {graph.inputs[j]: per_leaf[k] for j, k in enumerate(plan.arrays)}
    marked = {out: e.params["spec"] for e in graph.eqns if e.prim in (END_STAGE, END_STAGE_BWD)
              and e.params.get("spec") is not None for out in e.outs}
    returned = {v: per_leaf[k] for v, k in _returned_state(graph, leaves, treedef).items()}
    batch_entry = next((s[0] for v, s in given.items() if v in split.batch_inputs and len(s)), None)
    like: dict[tuple, set] = {}
    for v, stage in split.home.items():
        if given[v] != P():  # a replicated input says nothing about how a value of its shape is sharded
            like.setdefault((stage, graph.avals[v].shape, np.dtype(graph.avals[v].dtype)), set()).add(given[v])

    def spec_of(v: int, where: VirtualSlice, stage: int) -> P:
        aval = graph.avals[v]
        candidates = []
        if v in given:
            candidates.append(given[v])
        if v in returned:
            candidates.append(returned[v])
        if v in marked:
            candidates.append(marked[v])
        axis = graph.batch_axis[v]
        if batch_entry is not None and axis is not None and axis >= 0:
            candidates.append(P(*([None] * axis + [batch_entry])))
        same = like.get((stage, aval.shape, np.dtype(aval.dtype)), set())
        if len(same) == 1:
            candidates.append(next(iter(same)))
        for spec in candidates:
            try:
                check_spec(spec, aval.shape, where.shape, where.axis_names)
                return spec
            except ProgramError:
                continue
        return P()

    for task in split.tasks.values():
        where = step.slices[plan.schedule.device_of(task.stage)]
        for v in (*task.ins, *task.outs, *task.sums):
            plan.specs.setdefault((v, where.key), spec_of(v, where, task.stage))
    plan.specs.update({(v, "given"): s for v, s in given.items()})

def _functions(step: Step, plan: Plan) -> None:
    """A ``pw.jit`` function per task (per-micro-batch tasks: one without and one with accumulators)."""
    split = plan.split
    scale = 1.0 / (step.n_micro * len(step.replicas))
    n_rep = len(step.replicas)
    for task in split.tasks.values():
        where = step.slices[plan.schedule.device_of(task.stage)]
        spec = partial(lambda key, v: plan.specs[(v, key)], where.key)

        if task.kind == "U":
            means = [v in split.per_micro for v in task.ins]
            in_specs = tuple(s for v, mean in zip(task.ins, means) for s in [spec(v)] * (n_rep if mean else 1))
            fn = _task_fn(task, means, n_rep, scale, accumulate=False)
            plan.fns[(task.key, False)] = pw_jit(fn, slice=where, in_specs=in_specs,
                                              out_specs=tuple(spec(v) for v in task.outs), name=task.name)
            continue
        ins = tuple(spec(v) for v in task.ins)
        outs = tuple(spec(v) for v in (*task.outs, *task.sums))
        sums = tuple(spec(v) for v in task.sums)
        for acc in (False, True):
            fn = _task_fn(task, [False] * len(task.ins), 1, 1.0, accumulate=acc)
            donate = tuple(range(len(ins), len(ins) + len(sums))) if acc else None
            plan.fns[(task.key, acc)] = pw_jit(fn, slice=where, in_specs=ins + (sums if acc else ()),
                                               out_specs=outs, name=task.name, donate_argnums=donate)

def _order(step: Step, plan: Plan) -> None:
    """The emission order of every replica's per-micro-batch work (``order.emission``)."""
    split, schedule = plan.split, plan.schedule
    p = schedule.n_devices
    lanes = [[w for w in seq if (w.stage, w.kind, 0) in split.tasks]
             for _ in step.replicas for seq in schedule.order]
    islands = [s.island for rep in step.replicas for s in rep]
    split_w = schedule.split_weights

    def deps(lane: int, w: order.Work) -> list[tuple[int, order.Work]]:
        base = lane - lane % p
        task = split.tasks[(w.stage, w.kind, 0)]
        return [(base + schedule.device_of(s), order.Work(k, s, w.micro)) for s, k, _ in split.deps(task)]

    def cost(w: order.Work) -> float:
        has_w = split_w and (w.stage, "W", 0) in split.tasks
        return COST[w.kind] * (2.0 if w.kind == "B" and not has_w else 1.0)

    plan.emitted = order.emission(schedule.name, lanes, deps, islands, cost)


def _returned_state(graph: Any, leaves: list, treedef: Any) -> dict[int, int]:
    """The step's outputs that return the new value of an argument (the state in, state out of a training
    step): output value id -> the flat leaf index of the argument it replaces. An output (each element of a
    returned tuple, or the whole output) replaces the argument of the same structure, shapes and dtypes,
    that at its own position where several match."""
    args = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    outs = jax.tree_util.tree_unflatten(graph.out_tree, list(range(len(graph.outputs))))
    parts = list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def signature(tree: Any, aval: Callable[[int], Any]) -> tuple:
        return (jax.tree_util.tree_structure(tree), tuple(aval(k) for k in jax.tree_util.tree_leaves(tree)))

    def arg_aval(k: int) -> Any:
        x = leaves[k]
        return (x.shape, np.dtype(x.dtype)) if isinstance(x, jax.ShapeDtypeStruct) else None

    def out_aval(k: int) -> Any:
        v = graph.outputs[k]
        return None if isinstance(v, Const) else (graph.avals[v].shape, np.dtype(graph.avals[v].dtype))

    found: dict[int, int] = {}
    for i, part in enumerate(parts):
        if not jax.tree_util.tree_leaves(part):
            continue
        want = signature(part, out_aval)
        matches = [j for j, arg in enumerate(args) if signature(arg, arg_aval) == want]
        j = i if i in matches else (matches[0] if len(matches) == 1 else None)
        if j is not None:
            for k, a in zip(jax.tree_util.tree_leaves(part), jax.tree_util.tree_leaves(args[j])):
                if not isinstance(graph.outputs[k], Const):
                    found[graph.outputs[k]] = a
    return found


def _task_fn(task: Task, means: Sequence[bool], n_rep: int, scale: float, accumulate: bool) -> Callable:
    """The function a task's ``pw.jit`` runs: its equations over its inputs (for an update, the mean over
    micro-batches and replicas of the sums it reads), returning its outputs and, for a per-micro-batch
    task, its sums (plus the accumulators it was given)."""
    eqns, ins, outs, sums = task.eqns, task.ins, task.outs, task.sums

    def run(*args: Any) -> tuple:
        env: dict[int, Any] = {}
        k = 0
        for v, mean in zip(ins, means):
            if mean:
                parts = args[k:k + n_rep]
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                env[v] = (total * scale).astype(total.dtype)
                k += n_rep
            else:
                env[v] = args[k]
                k += 1
        accs = args[k:]

        def value(a: Any) -> Any:
            return a.value if isinstance(a, Const) else env[a]

        for e in eqns:
            env.update(zip(e.outs, e.run(value)))
        made = [env[v] for v in sums]
        if accumulate:
            made = [a + s for a, s in zip(accs, made)]
        return tuple([env[v] for v in outs] + made)

    run.__name__ = task.name
    return run
