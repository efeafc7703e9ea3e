"""``pw.pipeline.jit``: one annotated training step run as a pipeline, one ``@pw.program`` per step.

On the first call for an argument signature, the step is planned (``client.pipeline.planning``): traced and
cut into per-stage tasks (``client.pipeline.split``), each task a ``pw.jit`` function on its stage's slice, in
the order the schedule (``client.pipeline.schedules``) fixes for the program body (``client.pipeline.order``).
Every call then dispatches the whole step at once: every micro-batch's forward, backward and weight-gradient
tasks, the transfers between stages, and each stage's update, one message per island. Parameters and
optimizer state are read and written on their stage's slice, so they stay there from step to step.

Several pipeline replicas (``slices`` as a list of lists) split the batch between them and add their
gradients before the update, as PaLM's pods did: data parallelism across replicas, pipeline parallelism
across each replica's slices, and whatever sharding each slice's PartitionSpecs ask for inside a stage.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array
from client.jit import CompiledFunction
from client.jit import jit as pw_jit
from client.pipeline import order, schedules, timeline
from client.pipeline.planning import Plan, Step, make_plan
from client.pipeline.split import PER_MICRO
from client.pipeline.trace import Const
from client.program import ProgramFunction
from client.slices import VirtualSlice
from client.tracer import HostValue, InTrace, TracedValue, current_trace
from pathways.errors import ProgramError


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
        self.config = Step(fn, replicas, n_micro, schedule, batch_argnums, in_specs, name)
        self._plans: dict[Any, Plan] = {}
        self._last: Plan | None = None
        self._copies: dict[int, list[Array]] = {}  # a first-replica array's id -> the other replicas' copies
        self.step = ProgramFunction(self._body, name=f"pipeline_{name}")

    @property
    def slices(self) -> list[VirtualSlice]:
        """The first replica's slices, one per device of the schedule."""
        return self.config.slices

    def __call__(self, *args: Any) -> Any:
        if len(self.config.replicas) == 1:
            return self.step(*args)
        # Every replica keeps its own copy of the state: the outputs are the first replica's arrays, and the
        # other replicas' copies of each are remembered here and passed back in when it is.
        leaves = jax.tree_util.tree_leaves(args)
        others = tuple({k: self._copies[id(x)][r] for k, x in enumerate(leaves)
                        if isinstance(x, Array) and id(x) in self._copies}
                       for r in range(len(self.config.replicas) - 1))
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
        n_rep = len(self.config.replicas)
        shares: tuple[dict[int, Any], ...] = tuple({} for _ in range(n_rep))
        for i in self.config.batch_argnums:
            for k in jax.tree_util.tree_leaves(index[i]) if i < len(args) else ():
                x = leaves[k]
                if isinstance(x, (np.ndarray, jax.Array)) and x.ndim and x.shape[0] % n_rep == 0:
                    n = x.shape[0] // n_rep
                    for r in range(n_rep):
                        shares[r][k] = x[r * n:(r + 1) * n]
        return shares

    def graph(self, *args: Any) -> Any:
        """The ``pw.Program`` one step traces to for these arguments."""
        if len(self.config.replicas) > 1:
            return self.step.graph(*args, shares=self._shares(args))
        return self.step.graph(*args)

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
            raise ProgramError(f"pw.pipeline.jit({self.config.name}): run a step before measuring its bubble")
        return timeline.measure(trace, timeline.lanes_of(self.config.replicas, self._last.split.n_stages))

    # -- planning ---------------------------------------------------------------------------------
    def _plan(self, leaves: list, treedef: Any) -> Plan:
        key = (treedef, tuple(x if not isinstance(x, jax.ShapeDtypeStruct) else (x.shape, np.dtype(x.dtype).str)
                              for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make_plan(self.config, leaves, treedef)
        self._last = plan
        return plan

    def _fn(self, plan: Plan, key: tuple, acc: bool, replica: int) -> CompiledFunction:
        """A task's function on replica ``replica``'s slice (the same exports as the first replica's)."""
        fn = plan.fns.get((key, acc, replica))
        if fn is None:
            where = self.config.replicas[replica][plan.schedule.device_of(key[0])]
            fn = plan.fns[(key, acc, replica)] = plan.fns[(key, acc)].on(where)
        return fn if replica else plan.fns[(key, acc)]

    # -- the traced step --------------------------------------------------------------------------
    def _body(self, *args: Any, copies: tuple = (), shares: tuple = (), recorder: Recorder | None = None) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        plan = self._plan([_abstract(x) for x in leaves], treedef)
        split, graph, schedule = plan.split, plan.split.graph, plan.schedule
        n_rep, p = len(self.config.replicas), schedule.n_devices
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
                source, index = (share, micro) if share is not None else (batch_of[v], r * self.config.n_micro + micro)
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
            where = self.config.replicas[r][schedule.device_of(w.stage)]
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
                where = self.config.replicas[r][schedule.device_of(task.stage)]
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
                    raise ProgramError(f"pw.pipeline.jit({self.config.name}): the step returns a constant")
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
