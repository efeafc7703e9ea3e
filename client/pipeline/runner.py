"""``pw.pipeline.jit``: one annotated training step run as a pipeline, one ``@pw.program`` per step.

On the first call for an argument signature, the step is traced and cut into per-stage tasks
(``client.pipeline.split``), each task becomes a ``pw.jit`` function on its stage's slice, and the schedule
(``client.pipeline.schedules``) fixes the order the program body calls them in (``client.pipeline.order``).
Every call then dispatches the whole step at once: every micro-batch's forward, backward and weight-gradient
tasks, the transfers between stages, and each stage's update, one message per island. Parameters and
optimizer state are read and written on their stage's slice, so they stay there from step to step.

Several pipeline replicas (``slices`` as a list of lists) split the batch between them and add their
gradients before the update, as PaLM's pods did: data parallelism across replicas, pipeline parallelism
across each replica's slices, and whatever sharding each slice's PartitionSpecs ask for inside a stage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array
from client.host_values import broadcast_specs
from client.jit import CompiledFunction
from client.jit import jit as pw_jit
from client.meshes import tracing_on
from client.pipeline import order, schedules, timeline
from client.pipeline.marker import END_STAGE, END_STAGE_BWD
from client.pipeline.split import PER_MICRO, Split, Task, split_step
from client.pipeline.trace import Const, trace_step
from client.program import ProgramFunction
from client.slices import VirtualSlice
from client.tracer import HostValue, InTrace, TracedValue, current_trace
from pathways.errors import ProgramError
from pathways.sharding import check_spec

COST = {"F": 1.0, "B": 1.0, "W": 1.0}  # the emission's cost model; B without W counts twice


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


class Recorder:
    """Which graph nodes belong to which (stage, micro-batch): ``memory`` tags their values with it."""

    def __init__(self) -> None:
        self.nodes: list[tuple[int, tuple[int, int], list[int], int]] = []  # node, tag, per-micro inputs, outputs

    def note(self, tag: tuple[int, int], inputs: list[int], n_outputs: int) -> None:
        trace = current_trace()
        if trace is not None:
            self.nodes.append((len(trace.program.nodes) - 1, tag, inputs, n_outputs))


class Pipeline:
    """A pipelined training step: call it like the step; it returns the step's outputs as ``pw.Array``
    futures (per-step values on the stage that computes them; a value of the batch, such as the loss, is
    the mean over micro-batches). ``memory`` reports the activations each slice holds, ``plan`` the split
    and schedule of an argument signature, ``graph`` the program."""

    def __init__(self, fn: Callable, replicas: list[list[VirtualSlice]], n_micro: int, schedule: str,
                 batch_argnums: tuple[int, ...], in_specs: Any, name: str) -> None:
        self.fn = fn
        self.replicas = replicas
        self.n_micro = n_micro
        self.schedule_name = schedule
        self.batch_argnums = batch_argnums
        self.in_specs = in_specs
        self.name = name
        self._plans: dict[Any, Plan] = {}
        self._last: Plan | None = None
        self._copies: dict[int, list[Array]] = {}  # a first-replica array's id -> the other replicas' copies
        self.step = ProgramFunction(self._body, name=f"pipeline_{name}")

    @property
    def slices(self) -> list[VirtualSlice]:
        """The first replica's slices, one per device of the schedule."""
        return self.replicas[0]

    def __call__(self, *args: Any) -> Any:
        if len(self.replicas) == 1:
            return self.step(*args)
        # Every replica keeps its own copy of the state: the outputs are the first replica's arrays, and the
        # other replicas' copies of each are remembered here and passed back in when it is.
        leaves = jax.tree_util.tree_leaves(args)
        others = tuple({k: self._copies[id(x)][r] for k, x in enumerate(leaves)
                        if isinstance(x, Array) and id(x) in self._copies} for r in range(len(self.replicas) - 1))
        outputs, copies = self.step(*args, copies=others, shares=self._shares(args))
        for k, out in enumerate(jax.tree_util.tree_leaves(outputs)):
            if isinstance(out, Array) and id(out) not in self._copies:
                self._copies[id(out)] = [rep[k] for rep in copies]
                weakref.finalize(out, self._copies.pop, id(out), None)
        return outputs

    def _shares(self, args: tuple) -> tuple[dict[int, Any], ...]:
        """Each replica's share of the batch arguments that are client arrays (numpy or ``jax.Array``), by leaf
        index: split here, so that each replica's slices receive only the rows that replica computes on."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
        n_rep = len(self.replicas)
        shares: tuple[dict[int, Any], ...] = tuple({} for _ in range(n_rep))
        for i in self.batch_argnums:
            for k in jax.tree_util.tree_leaves(index[i]) if i < len(args) else ():
                x = leaves[k]
                if isinstance(x, (np.ndarray, jax.Array)) and x.ndim and x.shape[0] % n_rep == 0:
                    n = x.shape[0] // n_rep
                    for r in range(n_rep):
                        shares[r][k] = x[r * n:(r + 1) * n]
        return shares

    def graph(self, *args: Any) -> Any:
        """The ``pw.Program`` one step traces to for these arguments."""
        return self.step.graph(*args, shares=self._shares(args)) if len(self.replicas) > 1 else self.step.graph(*args)

    def plan(self, *args: Any) -> Plan:
        """The split, schedule and order for these arguments (host values or ``pw.Array``s)."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        return self._plan([_abstract(x) for x in leaves], treedef)

    def memory(self, *args: Any) -> list[order.SliceMemory]:
        """Per device of the first replica: the most (stage, micro-batch) pairs and bytes of per-micro-batch
        state (micro-batches, activations, residuals, gradients of activations) its slice holds at once
        during one step, replayed from the lowered program (values are freed after their last use)."""
        from client.lowering import lower

        recorder = Recorder()
        graph = ProgramFunction(partial(self._body, recorder=recorder), name=self.step.name).graph(*args)
        tags: dict[int, tuple[int, int]] = {}
        for node_index, tag, inputs, n_outputs in recorder.nodes:
            node = graph.nodes[node_index]
            for v in [node.inputs[k] for k in inputs] + list(node.outputs[:n_outputs]):
                tags.setdefault(v.slot, tag)
        for node in graph.nodes:  # a value moved to another slice belongs where it goes
            if type(node).__name__ == "Transfer" and node.source.slot in tags:
                tags.setdefault(node.target.slot, tags[node.source.slot])
        device_of = {s.key: d for d, s in enumerate(self.slices)}
        return order.replay(graph, lower(graph, defaultdict(bytes)), tags, device_of)

    def measured_bubble(self, trace: Any) -> timeline.MeasuredBubble:
        """The bubble of the steps recorded in ``trace`` (a ``pw.trace`` file, or its loaded JSON), read off the
        hosts' timelines: per step, each device's idle fraction between the step's first and last stage span,
        averaged over the devices (``client.pipeline.timeline``). Trace whole, finished steps."""
        if self._last is None:
            raise ProgramError(f"pw.pipeline.jit({self.name}): run a step before measuring its bubble")
        return timeline.measure(trace, timeline.lanes_of(self.replicas, self._last.split.n_stages))

    # -- planning ---------------------------------------------------------------------------------
    def _plan(self, leaves: list, treedef: Any) -> Plan:
        key = (treedef, tuple(x if not isinstance(x, jax.ShapeDtypeStruct) else (x.shape, np.dtype(x.dtype).str)
                              for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(leaves, treedef)
        self._last = plan
        return plan

    def _make_plan(self, leaves: list, treedef: Any) -> Plan:
        args = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
        if len(args) <= max(self.batch_argnums):
            raise ProgramError(f"pw.pipeline.jit({self.name}): batch_argnums {self.batch_argnums} but the step was "
                               f"called with {len(args)} arguments")
        batch_pos = {k for i in self.batch_argnums for k in jax.tree_util.tree_leaves(args[i])}
        arrays = [k for k, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
        batch = {j: k for j, k in enumerate(arrays) if k in batch_pos}
        sizes = {leaves[k].shape[0] if leaves[k].shape else None for k in batch.values()}
        n_rep, m = len(self.replicas), self.n_micro
        if not batch or len(sizes) != 1 or None in sizes:
            raise ProgramError(f"pw.pipeline.jit({self.name}): the batch arguments (batch_argnums "
                               f"{self.batch_argnums}) must be arrays sharing their leading (batch) dimension")
        size = sizes.pop()
        if size % (m * n_rep):
            raise ProgramError(f"pw.pipeline.jit({self.name}): batch {size} does not split into {n_rep} x {m} equal "
                               "micro-batches (replicas x n_micro)")
        micro = size // (m * n_rep)

        def flat(*xs: Any) -> Any:
            full = list(leaves)
            for k, x in zip(arrays, xs):
                full[k] = x
            return self.fn(*jax.tree_util.tree_unflatten(treedef, full))

        meshes = {where.mesh_key for replica in self.replicas for where in replica}
        # one mesh for every slice: the step is traced with it as JAX's context mesh, as each stage is exported
        with tracing_on(self.slices[0]) if len(meshes) == 1 else contextlib.nullcontext():
            graph = trace_step(flat, [leaves[k] for k in arrays], set(batch), micro, self.name)
        split = split_step(graph, set(batch), self.schedule_name == "zb-h1", self.name)
        p = len(self.slices)
        if split.n_stages % p:
            raise ProgramError(f"pw.pipeline.jit({self.name}): the step marks {split.n_stages} stage(s) "
                               f"(pw.pipeline.end_stage calls in sequence, the last stage's included) but runs on "
                               f"{p} slices; mark one stage per slice (or, interleaved, the same number per slice)")
        schedule = schedules.make(self.schedule_name, p, m, split.n_stages // p)
        for v in split.per_micro:
            if v not in split.batch_inputs and any(v in t.sums for t in split.tasks.values()):
                if not jnp.issubdtype(graph.avals[v].dtype, jnp.inexact):
                    raise ProgramError(f"pw.pipeline.jit({self.name}): the update reads a {graph.avals[v].dtype} value "
                                       "computed from the batch; pipelining averages such values over micro-batches, "
                                       "which needs floating-point values (a loss, gradients)")
        plan = Plan(split, schedule, arrays, batch, micro)
        self._specs(plan, leaves, treedef)
        self._functions(plan)
        self._order(plan)
        return plan

    def _specs(self, plan: Plan, leaves: list, treedef: Any) -> None:
        """The PartitionSpec of every value a task reads or writes, per slice (see ``spec_of``)."""
        split, graph = plan.split, plan.split.graph
        args = jax.tree_util.tree_unflatten(treedef, leaves)
        prefix = self.in_specs
        if prefix is None or isinstance(prefix, P):
            prefix = (prefix,) * len(args)
        if not isinstance(prefix, (tuple, list)) or len(prefix) != len(args):
            raise ProgramError(f"pw.pipeline.jit({self.name}): in_specs must be None, one PartitionSpec or a tuple "
                               f"with one entry per argument of the step ({len(args)})")
        per_leaf = broadcast_specs(tuple(prefix), tuple(args), f"pw.pipeline.jit({self.name}): in_specs")
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
            where = self.slices[plan.schedule.device_of(task.stage)]
            for v in (*task.ins, *task.outs, *task.sums):
                plan.specs.setdefault((v, where.key), spec_of(v, where, task.stage))
        plan.specs.update({(v, "given"): s for v, s in given.items()})

    def _functions(self, plan: Plan) -> None:
        """A ``pw.jit`` function per task (per-micro-batch tasks: one without and one with accumulators)."""
        split = plan.split
        scale = 1.0 / (self.n_micro * len(self.replicas))
        n_rep = len(self.replicas)
        for task in split.tasks.values():
            where = self.slices[plan.schedule.device_of(task.stage)]
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

    def _order(self, plan: Plan) -> None:
        """The emission order of every replica's per-micro-batch work (``order.emission``)."""
        split, schedule = plan.split, plan.schedule
        p = schedule.n_devices
        lanes = [[w for w in seq if (w.stage, w.kind, 0) in split.tasks]
                 for _ in self.replicas for seq in schedule.order]
        islands = [s.island for rep in self.replicas for s in rep]
        split_w = schedule.split_weights

        def deps(lane: int, w: order.Work) -> list[tuple[int, order.Work]]:
            base = lane - lane % p
            task = split.tasks[(w.stage, w.kind, 0)]
            return [(base + schedule.device_of(s), order.Work(k, s, w.micro)) for s, k, _ in split.deps(task)]

        def cost(w: order.Work) -> float:
            has_w = split_w and (w.stage, "W", 0) in split.tasks
            return COST[w.kind] * (2.0 if w.kind == "B" and not has_w else 1.0)

        plan.emitted = order.emission(schedule.name, lanes, deps, islands, cost)

    def _fn(self, plan: Plan, key: tuple, acc: bool, replica: int) -> CompiledFunction:
        """A task's function on replica ``replica``'s slice (the same exports as the first replica's)."""
        fn = plan.fns.get((key, acc, replica))
        if fn is None:
            where = self.replicas[replica][plan.schedule.device_of(key[0])]
            fn = plan.fns[(key, acc, replica)] = plan.fns[(key, acc)].on(where)
        return fn if replica else plan.fns[(key, acc)]

    # -- the traced step --------------------------------------------------------------------------
    def _body(self, *args: Any, copies: tuple = (), shares: tuple = (), recorder: Recorder | None = None) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        plan = self._plan([_abstract(x) for x in leaves], treedef)
        split, graph, schedule = plan.split, plan.split.graph, plan.schedule
        n_rep, p = len(self.replicas), schedule.n_devices
        inputs = {graph.inputs[j]: leaves[k] for j, k in enumerate(plan.arrays)}
        copies = copies or ({},) * (n_rep - 1)  # each replica's own copy of an input, where it has one
        own = [{graph.inputs[j]: rep[k] for j, k in enumerate(plan.arrays) if k in rep} for rep in ({}, *copies)]
        batch_of = {graph.inputs[j]: leaves[k] for j, k in plan.batch.items()}
        leaf_of = {graph.inputs[j]: k for j, k in plan.batch.items()}
        values: dict[tuple[int, int | None, int], Any] = {}
        sums: dict[tuple[tuple, int], list] = {}
        takes: dict[tuple, CompiledFunction] = {}

        def read(v: int, micro: int | None, r: int, where: VirtualSlice, tag: tuple[int, int]) -> Any:
            if v in batch_of:
                # a client array: this replica's share, sent to its slices only; a pw.Array on another island:
                # the micro-batch is taken where the batch lives, so only the micro-batch crosses
                share = shares[r].get(leaf_of[v]) if shares else None
                source, index = (share, micro) if share is not None else (batch_of[v], r * self.n_micro + micro)
                at, spec = where, plan.specs.get((v, "given"), P())
                if isinstance(source, TracedValue) and source.slice.island != where.island:
                    at, spec = source.slice, source.spec
                key = (v, r if share is not None else None, index, at.key)
                if key not in values:
                    fn = takes.get(key)
                    if fn is None:
                        fn = takes[key] = _take(index, plan.micro, at, spec)
                    values[key] = fn(source)
                    if recorder is not None:
                        recorder.note(tag, [], 1)
                return values[key]
            if v in inputs:
                return own[r].get(v, inputs[v])
            return values[(v, micro if v in split.per_micro else None, r)]

        for timed in plan.emitted:
            w, r = timed.work, timed.lane // p
            task = split.tasks[(w.stage, w.kind, 0)]
            where = self.replicas[r][schedule.device_of(w.stage)]
            tag = (w.stage, w.micro)
            ins = [read(v, w.micro, r, where, tag) for v in task.ins]
            acc = sums.get((task.key, r))
            outs = self._fn(plan, task.key, acc is not None, r)(*ins, *(acc or ()))
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if recorder is not None:
                micro_inputs = [k for k, v in enumerate(task.ins) if v in split.per_micro]
                recorder.note(tag, micro_inputs, len(task.outs))
            for v, value in zip(task.outs, outs):
                values[(v, w.micro, r)] = value
            if task.sums:
                sums[(task.key, r)] = outs[len(task.outs):]
        summed = {v: [sums[(split.producer[v], r)][split.tasks[split.producer[v]].sums.index(v)] for r in range(n_rep)]
                  for task in split.tasks.values() if task.kind in PER_MICRO for v in task.sums}
        for task in split.updates():
            for r in range(n_rep):
                where = self.replicas[r][schedule.device_of(task.stage)]
                ins = []
                for v in task.ins:
                    ins.extend(summed[v] if v in split.per_micro else [read(v, None, r, where, (task.stage, -1))])
                outs = self._fn(plan, task.key, False, r)(*ins)
                outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                for v, value in zip(task.outs, outs):
                    values[(v, None, r)] = value
        results = []
        for r in range(n_rep):
            result = []
            for out in graph.outputs:
                if isinstance(out, Const):  # split_step refuses these; kept for the type checker
                    raise ProgramError(f"pw.pipeline.jit({self.name}): the step returns a constant")
                result.append(own[r].get(out, inputs[out]) if out in inputs else values[(out, None, r)])
            results.append(result)
        outputs = jax.tree_util.tree_unflatten(graph.out_tree, results[0])
        return outputs if n_rep == 1 else (outputs, results[1:])


def _abstract(x: Any) -> Any:
    """A call's leaf as the plan sees it: arrays as ShapeDtypeStructs, static values as they are."""
    if isinstance(x, (TracedValue, HostValue)):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    if isinstance(x, InTrace):
        raise ProgramError(f"pw.pipeline.jit: unexpected argument {x!r}")
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
    return x


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


def _take(index: int, size: int, where: VirtualSlice, spec: P) -> CompiledFunction:
    """Micro-batch ``index`` (rows of ``size``) of a batch on ``where``, sharded as the batch where it can be."""
    def take(batch: Any) -> Any:
        return jax.lax.slice_in_dim(batch, index * size, (index + 1) * size, axis=0)

    out = spec
    if len(spec) and spec[0] is not None:
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        shards = int(np.prod([where.shape[where.axis_names.index(a)] for a in axes]))
        out = spec if size % shards == 0 else P(None, *spec[1:])
    return pw_jit(take, slice=where, in_specs=(spec,), out_specs=out, name=f"micro_batch{index}")


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


def jit(fn: Callable, slices: Sequence[Any], n_micro: int, schedule: str = "1f1b", *,
        batch_argnums: int | Sequence[int], in_specs: Any = None, name: str | None = None) -> Pipeline:
    """Pipeline a training step written as for ``jax.jit``, with its stages marked by ``pw.pipeline.end_stage``.

        def train_step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)   # loss_fn's model calls end_stage
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = pw.pipeline.jit(train_step, slices=[s0, s1, s2, s3], n_micro=8, batch_argnums=(2, 3))
        params, opt_state, loss = step(params, opt_state, x, y)    # one @pw.program per step

    The step is traced per micro-batch and cut at the marks into each stage's forward, backward and (for
    ``zb-h1``) weight-gradient computations, placed on the stage's slice. What the step computes from the
    batch and the update reads (the gradients, the loss) is averaged over micro-batches (and replicas)
    first: for a loss that is a mean over the batch, the step's gradients and outputs equal the
    unpipelined step's.

    Args:
        fn: the training step, ``fn(*args) -> outputs``; a pure JAX function whose loss is a mean over the
            batch and which does not assume the batch size (it is traced at the micro-batch size).
        slices: one ``pw.VirtualSlice`` per device of the pipeline, or a list of such lists, one per pipeline
            replica (data parallel: each replica takes an equal share of the batch, gradients are added
            across replicas before the update, and every replica applies the same update).
        n_micro: micro-batches per step (per replica).
        schedule: "1f1b", "gpipe", "interleaved" (v = stages / slices chunks per slice, stage s on slice
            s mod p) or "zb-h1" (backward split into input and weight gradients).
        batch_argnums: the positional arguments that carry the batch (split along their leading axis).
        in_specs: PartitionSpecs of the arguments, as ``pw.jit``'s: None, one spec, or one pytree prefix per
            argument. A parameter's spec applies on its stage's slice; a batch argument's on each
            micro-batch (its leading entry, e.g. "data", also shards the activations' batch axis).
        name: the name in graphs and traces (default: ``fn.__name__``).

    Returns:
        A ``Pipeline``; calling it runs one step and returns the step's outputs as ``pw.Array`` futures.

    Raises:
        ProgramError: an argument above is malformed; on the first call, when the step cannot be split
            (see ``pw.pipeline.end_stage``) or does not fit the schedule.
    """
    name = name or getattr(fn, "__name__", "step")
    if not callable(fn):
        raise ProgramError(f"pw.pipeline.jit needs the training step function, got {type(fn).__name__}")
    if isinstance(slices, VirtualSlice) or not isinstance(slices, (list, tuple)) or not slices:
        raise ProgramError(f"pw.pipeline.jit({name}): slices must be a list of pw.slice(...) (one per stage), or a "
                           "list of such lists (one per pipeline replica)")
    replicas = [list(r) for r in slices] if isinstance(slices[0], (list, tuple)) else [list(slices)]
    flat = [s for r in replicas for s in r]
    if any(not isinstance(s, VirtualSlice) for s in flat):
        bad = next(s for s in flat if not isinstance(s, VirtualSlice))
        raise ProgramError(f"pw.pipeline.jit({name}): slices must come from pw.slice(...), got {type(bad).__name__}")
    if len({len(r) for r in replicas}) != 1:
        raise ProgramError(f"pw.pipeline.jit({name}): every replica needs the same number of slices, got "
                           f"{[len(r) for r in replicas]}")
    for r in replicas[1:]:
        for k, (a, b) in enumerate(zip(replicas[0], r)):
            if (a.shape, a.axis_names) != (b.shape, b.axis_names):
                raise ProgramError(f"pw.pipeline.jit({name}): replicas must have the same slices; device {k} is "
                                   f"{a.shape} over {a.axis_names} in the first, {b.shape} over {b.axis_names} in "
                                   "another")
    if len({id(s) for s in flat}) != len(flat):
        raise ProgramError(f"pw.pipeline.jit({name}): a slice appears twice; give every device its own slice")
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if not nums or any(not isinstance(i, int) or i < 0 for i in nums):
        raise ProgramError(f"pw.pipeline.jit({name}): batch_argnums must name the step's batch arguments by "
                           f"position, e.g. (2, 3), got {batch_argnums!r}")
    schedules.check(schedule, len(replicas[0]), n_micro, 2 if schedule == "interleaved" else 1)
    return Pipeline(fn, replicas, n_micro, schedule, nums, in_specs, name)
