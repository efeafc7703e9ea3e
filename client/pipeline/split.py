"""A traced training step cut into per-stage tasks: forward (F), backward (B), weight gradient (W), update (U).

The cut follows the data, not the user's code:

- **Per micro-batch or per step.** An equation that reads or writes a value carrying the batch runs once
  per micro-batch, and so does every batch-dependent equation that feeds one. What is left of the
  batch-dependent equations (the optimizer, gradient clipping, metrics of the loss) runs once per step, on
  the mean over micro-batches of the per-micro-batch values it reads (the gradients, the loss): for a loss
  that is a mean over the batch, exactly the unpipelined step's values.
- **Stages.** The S marks (``end_stage``) split the forward pass into S stages; what follows the last mark
  (the loss) runs with the last stage. A forward equation runs on the latest stage among its inputs; a
  backward equation (one reading a mark's transpose, directly or not) on the earliest stage among its
  gradient inputs, so each stage's backward holds exactly the transposes of its forward.
- **Forward and backward.** On each stage, the equations that read a backward mark are its backward pass B;
  the rest are its forward pass F (including what JAX saves for the backward). With ``split_weights``, B
  keeps only what the gradient sent to the previous stage needs (the input gradient), and the rest (the
  weight gradients) becomes W, which a zero-bubble schedule runs later.
- **Update.** Per-step equations run on the stage of their largest input, so each stage's optimizer update
  runs where its parameters and gradients are; a value combining stages (a global gradient norm) moves.

Per-micro-batch equations that read no staged value (the first layer, a one-hot of the targets) run on the
earliest stage that reads them. Equations that depend on no batch value (a parameter's transpose, the
optimizer's step count) are recomputed inside every task that needs them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client.pipeline.marker import END_STAGE, END_STAGE_BWD
from client.pipeline.trace import Const, Eqn, StepGraph
from pathways.errors import ProgramError

PER_MICRO = ("F", "B", "W")


@dataclass
class Task:
    """The equations of one stage's F, B or W (run once per micro-batch) or of one level of its update U.

    ``ins`` are the values it reads from elsewhere (step inputs, other tasks' outputs; for U tasks, a
    per-micro-batch value means its mean over micro-batches), ``outs`` what it hands to other tasks or
    returns, ``sums`` the per-micro-batch values the update reads, summed over micro-batches.
    """

    stage: int
    kind: str  # "F", "B", "W" or "U"
    level: int = 0  # U only: a U task reads U values of other stages only from lower levels
    eqns: list[Eqn] = field(default_factory=list)
    ins: list[int] = field(default_factory=list)
    outs: list[int] = field(default_factory=list)
    sums: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, str, int]:
        """(stage, kind, level): how other tasks and the schedule name it."""
        return (self.stage, self.kind, self.level)

    @property
    def name(self) -> str:
        """The computation's name in graphs and traces: ``stage2.F``, ``stage0.update``."""
        return f"stage{self.stage}." + ("update" + (f"{self.level}" if self.level else "") if self.kind == "U"
                                         else self.kind)


@dataclass
class Split:
    """A step cut into tasks. Values are ids of ``graph.avals``; ``stage_of`` gives the stage a value is
    computed on, ``home`` the stage each step input is read on first (where it should live)."""

    graph: StepGraph
    n_stages: int
    tasks: dict[tuple[int, str, int], Task]
    producer: dict[int, tuple[int, str, int]]  # value -> the task that computes it
    stage_of: dict[int, int]
    home: dict[int, int]  # step input value -> stage
    batch_inputs: set[int]  # step input values split into micro-batches
    per_micro: set[int]  # values computed once per micro-batch

    def per_micro_tasks(self, stage: int) -> list[Task]:
        """Stage ``stage``'s F, B and W tasks that have equations."""
        return [t for t in (self.tasks.get((stage, k, 0)) for k in PER_MICRO) if t is not None]

    def updates(self) -> list[Task]:
        """The U tasks, lowest level first."""
        return sorted((t for t in self.tasks.values() if t.kind == "U"), key=lambda t: (t.level, t.stage))

    def deps(self, task: Task) -> set[tuple[int, str, int]]:
        """The tasks whose outputs ``task`` reads (for a per-micro-batch task: of the same micro-batch)."""
        return {self.producer[v] for v in task.ins if v in self.producer} - {task.key}


def split_step(graph: StepGraph, batch_leaves: set[int], split_weights: bool, name: str) -> Split:
    """Cut ``graph`` into tasks (see the module docstring); ``batch_leaves`` index ``graph.inputs``."""
    eqns = graph.eqns
    batch_inputs = {graph.inputs[k] for k in batch_leaves}
    consumers: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(eqns):
        for a in e.ins:
            if not isinstance(a, Const):
                consumers[a].append(i)
    made_by = {v: i for i, e in enumerate(eqns) for v in e.outs}

    # batch-dependent values, and the equations that run once per micro-batch
    dep = set(batch_inputs)
    for e in eqns:
        if any(a in dep for a in _vars(e.ins)):
            dep.update(e.outs)
    carries = {v for v, axis in enumerate(graph.batch_axis) if axis is not None}
    micro_eq = [False] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if not any(v in dep for v in e.outs):
            continue
        touches = any(v in carries for v in (*_vars(e.ins), *e.outs))
        micro_eq[i] = touches or any(micro_eq[c] for v in e.outs for c in consumers[v])
    per_micro = {v for i, e in enumerate(eqns) if micro_eq[i] for v in e.outs} | batch_inputs

    # stages and directions of the per-micro-batch equations
    stage: dict[int, int] = {}
    cot: set[int] = set()
    floating: list[int] = []  # equations reading no staged value (the first layer, the targets' one-hot)
    for i, e in enumerate(eqns):
        if not micro_eq[i]:
            continue
        if e.prim is END_STAGE or e.prim is END_STAGE_BWD:
            step = 1 if e.prim is END_STAGE else -1
            for a, out in zip(e.ins, e.outs):
                stage[out] = max(0, (stage.get(a, 0) if not isinstance(a, Const) else 0) + step)
                if e.prim is END_STAGE_BWD or a in cot:
                    cot.add(out)
            continue
        ins = _vars(e.ins)
        grads = [stage[a] for a in ins if a in cot]
        staged = [stage[a] for a in ins if a in stage]
        if grads:
            s = min(grads)
            cot.update(e.outs)
        elif staged:
            s = max(staged)
        else:
            floating.append(i)
            continue
        for out in e.outs:
            stage[out] = s
    for i in reversed(floating):  # on the earliest stage that reads them (a mark reads on the stage it ends)
        reads = []
        for v in eqns[i].outs:
            for c in consumers[v]:
                ce = eqns[c]
                if micro_eq[c] and ce.outs and ce.outs[0] in stage:
                    reads.append(stage[ce.outs[0]] - (ce.prim is END_STAGE) + (ce.prim is END_STAGE_BWD))
        for out in eqns[i].outs:
            stage[out] = max(min(reads, default=0), 0)
    marks = max((stage[e.outs[0]] for e in eqns if e.prim is END_STAGE and e.outs[0] in stage), default=0)
    n_stages = max(marks, 1)
    for v, s in stage.items():
        stage[v] = min(s, n_stages - 1)  # the loss, after the last mark, runs with the last stage

    # what each per-micro-batch equation's task is
    kind_of = {i: (stage[e.outs[0]], "B" if e.outs[0] in cot else "F") for i, e in enumerate(eqns)
               if micro_eq[i] and e.outs}
    if split_weights:
        _split_weights(eqns, kind_of, consumers, n_stages)

    tasks: dict[tuple[int, str, int], Task] = {}
    for i in sorted(kind_of):
        s, kind = kind_of[i]
        tasks.setdefault((s, kind, 0), Task(s, kind)).eqns.append(eqns[i])

    # the update: per-step equations on the stage of their largest batch-dependent input
    level: dict[int, int] = {}
    for i, e in enumerate(eqns):
        if micro_eq[i] or not any(v in dep for v in e.outs):
            continue
        s = min(((-_size(graph, a), stage[a]) for a in _vars(e.ins) if a in stage), default=(0, 0))[1]
        lv = max((level[a] + (stage[a] != s) for a in _vars(e.ins) if a in level), default=0)
        for out in e.outs:
            stage[out], level[out] = s, lv
        tasks.setdefault((s, "U", lv), Task(s, "U", lv)).eqns.append(e)
    returns: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    for out in graph.outputs:  # what the step returns that no task's own equations compute
        if isinstance(out, Const):
            raise ProgramError(f"pw.pipeline.jit({name}): the step returns a constant ({out.value!r}); return "
                               "only values computed from its arguments")
        if out in graph.inputs or out in level:
            continue
        if out in per_micro:  # its mean over micro-batches, on the stage that computes it
            if graph.batch_axis[out] is not None:
                raise ProgramError(f"pw.pipeline.jit({name}): the step returns a per-example value (shape "
                                   f"{tuple(graph.avals[out].shape)} at the micro-batch size); a pipelined step "
                                   "returns what it reduces over the batch (a mean, such as the loss)")
            s = stage[out]
        else:  # computed from no batch value (a step counter's next value): on the first stage
            s = 0
        tasks.setdefault((s, "U", 0), Task(s, "U", 0))
        returns[(s, "U", 0)].append(out)
        stage.setdefault(out, s)
    producer = _wire(graph, tasks, made_by, kind_of, per_micro, returns)
    home: dict[int, int] = {}
    for task in tasks.values():
        for a in task.ins:
            if a in graph.inputs and a not in batch_inputs:
                home[a] = min(home.get(a, task.stage), task.stage)
    return Split(graph, n_stages, tasks, producer, stage, home, batch_inputs, per_micro)


def _vars(atoms: Any) -> list[int]:
    return [a for a in atoms if not isinstance(a, Const)]


def _size(graph: StepGraph, v: int) -> int:
    return int(np.prod(graph.avals[v].shape, dtype=np.int64))


def _split_weights(eqns: list[Eqn], kind_of: dict[int, tuple[int, str]], consumers: dict[int, list[int]],
                   n_stages: int) -> None:
    """Move out of each stage's B what its input gradient does not need: the weight gradients (W)."""
    for s in range(n_stages):
        mine = [i for i, k in kind_of.items() if k == (s, "B")]
        if not mine:
            continue
        inside = set(mine)
        needed: set[int] = set()
        for i in mine:  # values another per-micro-batch task reads
            if any(c in kind_of and c not in inside for v in eqns[i].outs for c in consumers[v]):
                needed.add(i)
        if not needed:
            continue  # the first stage sends no gradient back: its whole backward stays one task
        made = {v: i for i in mine for v in eqns[i].outs}
        stack = list(needed)
        while stack:
            for a in _vars(eqns[stack.pop()].ins):
                j = made.get(a)
                if j is not None and j not in needed:
                    needed.add(j)
                    stack.append(j)
        for i in inside - needed:
            kind_of[i] = (s, "W")


def _wire(graph: StepGraph, tasks: dict[tuple[int, str, int], Task], made_by: dict[int, int],
          kind_of: dict[int, tuple[int, str]], per_micro: set[int], returns: dict) -> dict:
    """Each task's recomputed equations, inputs, outputs and sums; returns value -> producing task."""
    eqns = graph.eqns
    producer = {v: task.key for task in tasks.values() for e in task.eqns for v in e.outs}
    index = {id(e): i for i, e in enumerate(eqns)}
    for task in tasks.values():
        own = {index[id(e)] for e in task.eqns}
        extra: set[int] = set()
        stack = [a for e in task.eqns for a in _vars(e.ins)] + list(returns.get(task.key, ()))
        while stack:  # recompute what no task computes: values of no batch, and what reads only the batch
            a = stack.pop()
            i = made_by.get(a)
            if i is None or i in own or i in extra or a in producer or i in kind_of:
                continue
            if task.kind == "U" and a in per_micro:
                continue  # the update reads the mean of a per-micro-batch value
            extra.add(i)
            stack.extend(_vars(eqns[i].ins))
        task.eqns = [eqns[i] for i in sorted(own | extra)]
    readers: dict[int, set[tuple[int, str, int]]] = defaultdict(set)
    for task in tasks.values():
        made = {v for e in task.eqns for v in e.outs}
        extra_reads = {v for v in returns.get(task.key, ()) if v not in made}
        task.ins = sorted({a for e in task.eqns for a in _vars(e.ins)} - made | extra_reads)
        for a in task.ins:
            readers[a].add(task.key)
    returned = set(_vars(graph.outputs))
    for task in tasks.values():
        made = [v for e in task.eqns for v in e.outs]
        others = {v: readers[v] - {task.key} for v in made}
        if task.kind == "U":
            mine = set(returns.get(task.key, ()))
            task.outs = [v for v in made if v not in mine and (v in returned or others[v])]
            task.outs += returns.get(task.key, [])
        else:
            task.outs = [v for v in made if any(tasks[r].kind != "U" for r in others[v])]
            task.sums = [v for v in made if v in returned or any(tasks[r].kind == "U" for r in others[v])]
    return producer
