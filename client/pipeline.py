"""Pipeline parallelism across islands, built only on the public API (pw.jit, pw.program, pw.put, pw.transfer).

A model is a stack of stages, each a function ``fn(params, x) -> y`` bound to
its own virtual slice (usually one per island). ``build`` turns the stack, a
loss and an optax optimizer into one ``@pw.program``: every micro-batch's
forward and backward on every stage, the transfers of activations and
gradients between stages, and each stage's optimizer update, sent as one
dispatch (one message per island).

The schedule is the order in which the program body calls the stage
functions: lowering keeps that order in each island's fragment and frees every
intermediate right after its last use there, so GPipe (all forwards, then all
backwards) holds M micro-batches of activations per stage, while 1F1B holds at
most S. ``Pipeline.memory`` replays the lowered fragments to report that peak.

    stages = [pw.pipeline.Stage(layer_fn, pw.slice((1,), ("x",), island=k)) for k in range(2)]
    pipe = pw.pipeline.build(stages, loss_fn=mse, optimizer=optax.adam(1e-3), n_micro=8, schedule="1f1b")
    params, opt_states = pipe.init([p0, p1])              # numpy/jax pytrees -> arrays on each stage's slice
    for x, y in batches:
        params, opt_states, loss = pipe.step(params, opt_states, pw.put(x, stages[0].slice),
                                             pw.put(y, stages[-1].slice))
    print(float(np.asarray(loss)))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array, put
from client.jit import CompiledFunction, broadcast_specs, jit
from client.program import ProgramFunction, program, transfer
from client.slices import VirtualSlice
from client.tracer import TracedValue
from pathways.errors import ProgramError
from pathways.graph import Program

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``fn(params, x) -> y`` run on ``slice``.

    ``param_specs`` is a PartitionSpec prefix of the params pytree, ``in_spec``
    and ``out_spec`` shard the activation the stage takes and returns; None
    means replicated on the slice.
    """

    fn: Callable[[Any, Any], Any]
    slice: VirtualSlice
    param_specs: Any = None
    in_spec: P | None = None
    out_spec: P | None = None


# -- schedules ---------------------------------------------------------------------------------


def stage_order(n_stages: int, n_micro: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Each stage's sequence of work. The last stage runs forward, loss and backward of a micro-batch
    as one call ("FB") in both schedules; the others run "F" and "B" calls.

    GPipe: every forward, then every backward. 1F1B: stage s runs S - s - 1 forwards to fill the
    pipe, then alternates one forward and one backward, then drains the backwards.
    """
    check_counts(n_stages, n_micro, schedule)
    out = []
    for s in range(n_stages):
        if s == n_stages - 1:
            out.append([("FB", i) for i in range(n_micro)])
        elif schedule == "gpipe":
            out.append([("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)])
        else:
            warm = min(n_stages - s - 1, n_micro)
            seq = [("F", i) for i in range(warm)]
            for k in range(n_micro - warm):
                seq += [("F", warm + k), ("B", k)]
            seq += [("B", i) for i in range(n_micro - warm, n_micro)]
            out.append(seq)
    return out


def _producer(n_stages: int, s: int, kind: str, i: int) -> tuple[int, str, int] | None:
    """The work on another stage whose result this work consumes (None for the first stage's forward)."""
    if kind in ("F", "FB"):
        return (s - 1, "F", i) if s > 0 else None
    return (s + 1, "FB" if s + 1 == n_stages - 1 else "B", i)


def emission_order(per_stage: list[list[tuple[str, int]]], islands: Sequence[int] | None = None,
                   remat: bool = False) -> list[tuple]:
    """The order in which the program body calls stage functions and transfers.

    Lowering gives each island its projection of this order, and an island runs one step's ops
    strictly in that order. Lowering puts a transfer's send right after its producer wherever the
    transfer appears; its receive goes where the transfer appears. So each transfer is placed right
    before its consumer: a receive placed earlier would hold up unrelated work on the destination
    until its data arrived (GPipe's last stage would wait for every forward activation before its
    second micro-batch). The stages' sequences are list-scheduled on a cost model (forward 1,
    backward 2, or 3 with ``remat``) so stages sharing an island take turns. Items are
    ("C", stage, kind, micro) and ("T", "x" | "dx", source stage, destination stage, micro).
    """
    n = len(per_stage)
    island = list(range(n)) if islands is None else list(islands)
    cost = {"F": 1.0, "B": 3.0 if remat else 2.0, "FB": 3.0}
    start: dict[tuple, float] = {}
    finish: dict[tuple, float] = {}
    clock: dict[int, float] = defaultdict(float)
    pc = [0] * n
    total = sum(map(len, per_stage))
    while len(start) < total:
        best = None
        for s in range(n):
            if pc[s] == len(per_stage[s]):
                continue
            kind, i = per_stage[s][pc[s]]
            dep = _producer(n, s, kind, i)
            if dep is not None and dep not in finish:
                continue
            t = max(clock[island[s]], finish.get(dep, 0.0))
            if best is None or (t, s) < best[:2]:
                best = (t, s, kind, i)
        if best is None:
            raise ProgramError(f"pipeline schedule deadlocks: {per_stage}")
        t, s, kind, i = best
        start[(s, kind, i)], finish[(s, kind, i)] = t, t + cost[kind]
        clock[island[s]] = t + cost[kind]
        pc[s] += 1
    events = [(t, 1, work[0], ("C",) + work) for work, t in start.items()]
    for (s, kind, i), t in start.items():
        dep = _producer(n, s, kind, i)
        if dep is not None:  # at its consumer's start, sorted just before it
            events.append((t, 0, s, ("T", "x" if kind in ("F", "FB") else "dx", dep[0], s, i)))
    events.sort(key=lambda e: e[:3])
    return [e[3] for e in events]


def predicted_bubble(n_stages: int, n_micro: int) -> float:
    """The idle fraction of a synchronous pipeline (GPipe and 1F1B alike): (S - 1) / (M + S - 1)."""
    return (n_stages - 1) / (n_micro + n_stages - 1)


def check_counts(n_stages: int, n_micro: int, schedule: str) -> None:
    """ProgramError unless there is at least one stage, ``n_micro`` is a positive int and ``schedule`` is known."""
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ProgramError(f"a pipeline needs at least one stage, got {n_stages!r}")
    if not isinstance(n_micro, int) or isinstance(n_micro, bool) or n_micro < 1:
        raise ProgramError(f"n_micro must be a positive int (the number of micro-batches), got {n_micro!r}")
    if schedule not in SCHEDULES:
        raise ProgramError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


# -- the functions each stage runs --------------------------------------------------------------


def _leaf_avals(tree: Any) -> tuple:
    return tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in jax.tree_util.tree_leaves(tree))


class _VjpStore:
    """How a stage's forward split its ``jax.vjp`` closure into stored residuals and its own params.

    The pullback is a pytree whose leaves are the residuals; leaves that are the params themselves
    are dropped from the stored residuals (no copy per micro-batch) and put back in the backward.
    """

    def __init__(self) -> None:
        self._meta: dict[tuple, tuple[Any, list[int | None]]] = {}

    def split(self, params: Any, vjp: Any) -> list:
        p_ids = {id(leaf): k for k, leaf in enumerate(jax.tree_util.tree_leaves(params))}
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        mark = [p_ids.get(id(leaf)) for leaf in leaves]
        residuals = [leaf for leaf, m in zip(leaves, mark) if m is None]
        self._meta[(_leaf_avals(params), _leaf_avals(residuals))] = (tree, mark)
        return residuals

    def join(self, params: Any, residuals: list) -> Any:
        hit = self._meta.get((_leaf_avals(params), _leaf_avals(residuals)))
        if hit is None:
            raise ProgramError("pipeline backward called with residuals no forward produced")
        tree, mark = hit
        p_leaves = jax.tree_util.tree_leaves(params)
        it = iter(residuals)
        return jax.tree_util.tree_unflatten(tree, [next(it) if m is None else p_leaves[m] for m in mark])


def _add(acc: Any, g: Any) -> Any:
    return g if acc is None else jax.tree_util.tree_map(jnp.add, acc, g)


@dataclass
class _StageFns:
    """The pw.jit functions of one stage; exports are cached inside them across traces."""

    fwd: CompiledFunction | None = None
    bwd: dict[bool, CompiledFunction] = field(default_factory=dict)  # keyed by "has an accumulator"
    update: CompiledFunction | None = None


def _stage_fns(stage: Stage, index: int, last: bool, first: bool, loss_fn: Callable, optimizer: Any,
               n_micro: int, target_spec: P | None, remat: bool) -> _StageFns:
    fn, ps, xs, ys = stage.fn, stage.param_specs, stage.in_spec, stage.out_spec
    name = f"stage{index}"
    out = _StageFns()
    if last:
        def fwd_bwd(params, x, t, acc=None, loss_acc=None):
            loss, (dp, dx) = jax.value_and_grad(lambda p, v: loss_fn(fn(p, v), t), argnums=(0, 1))(params, x)
            loss = loss if loss_acc is None else loss_acc + loss
            return (_add(acc, dp), loss) if first else (_add(acc, dp), loss, dx)

        for has_acc in (False, True):
            in_specs = (ps, xs, target_spec) + ((ps, None) if has_acc else ())
            out_specs = (ps, None) if first else (ps, None, xs)
            out.bwd[has_acc] = jit(fwd_bwd, slice=stage.slice, in_specs=in_specs, out_specs=out_specs,
                                   name=f"{name}.fwd_loss_bwd")
    elif remat:
        out.fwd = jit(fn, slice=stage.slice, in_specs=(ps, xs), out_specs=ys, name=f"{name}.fwd")

        def bwd(params, x, dy, acc=None):
            _, pull = jax.vjp(fn, params, x)
            dp, dx = pull(dy)
            return _add(acc, dp) if first else (_add(acc, dp), dx)

        for has_acc in (False, True):
            out.bwd[has_acc] = jit(bwd, slice=stage.slice, in_specs=(ps, xs, ys) + ((ps,) if has_acc else ()),
                                   out_specs=ps if first else (ps, xs), name=f"{name}.bwd")
    else:
        store = _VjpStore()

        def fwd(params, x):
            y, pull = jax.vjp(fn, params, x)
            return y, store.split(params, pull)

        def bwd(params, residuals, dy, acc=None):
            dp, dx = store.join(params, residuals)(dy)
            return _add(acc, dp) if first else (_add(acc, dp), dx)

        out.fwd = jit(fwd, slice=stage.slice, in_specs=(ps, xs), out_specs=(ys, None), name=f"{name}.fwd")
        for has_acc in (False, True):
            out.bwd[has_acc] = jit(bwd, slice=stage.slice, in_specs=(ps, None, ys) + ((ps,) if has_acc else ()),
                                   out_specs=ps if first else (ps, xs), name=f"{name}.bwd")

    def update(params, opt_state, grad_sum, loss_sum=None):
        grads = jax.tree_util.tree_map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = (_apply(params, updates), opt_state)
        return new if loss_sum is None else new + (loss_sum / n_micro,)

    in_specs = (ps, None, ps) + ((None,) if last else ())
    out_specs = (ps, None) + ((None,) if last else ())
    out.update = jit(update, slice=stage.slice, in_specs=in_specs, out_specs=out_specs, name=f"{name}.update")
    return out


def _apply(params: Any, updates: Any) -> Any:
    return jax.tree_util.tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)


def _take(i: int, size: int) -> Callable:
    def take(batch):
        return jax.lax.slice_in_dim(batch, i * size, (i + 1) * size, axis=0)

    return take


# -- the pipeline -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """Peak activation state one stage's slice holds during a step, from its lowered fragment."""

    stage: int
    island: int
    slice: str
    peak_micro_batches: int  # most micro-batches with a live buffer at once
    peak_buffers: int
    peak_bytes: int


class Pipeline:
    """A pipelined training step. ``step`` is a ``ProgramFunction``:
    ``step(params, opt_states, inputs, targets) -> (params, opt_states, loss)``, where ``params`` and
    ``opt_states`` are lists with one pytree of ``pw.Array`` per stage, ``inputs`` is the whole batch
    (split into ``n_micro`` micro-batches on the first stage's slice), ``targets`` the matching labels
    (split on the last stage's slice) and ``loss`` the mean over the batch, on the last stage's slice.
    """

    def __init__(self, stages: Sequence[Stage], loss_fn: Callable, optimizer: Any, n_micro: int,
                 schedule: str, target_spec: P | None, remat: bool) -> None:
        self.stages = list(stages)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.n_micro = n_micro
        self.schedule = schedule
        self.target_spec = target_spec
        self.remat = remat
        n = len(self.stages)
        self.order = emission_order(stage_order(n, n_micro, schedule), [st.slice.island for st in self.stages],
                                    remat)
        self._fns = [_stage_fns(st, k, k == n - 1, k == 0, loss_fn, optimizer, n_micro, target_spec, remat)
                     for k, st in enumerate(self.stages)]
        self._takes: dict[tuple, CompiledFunction] = {}
        inits = [jit(optimizer.init, slice=st.slice, in_specs=(st.param_specs,), name=f"stage{k}.opt_init")
                 for k, st in enumerate(self.stages)]
        self._init_states = program(lambda ps: [f(p) for f, p in zip(inits, ps)])
        self.step: ProgramFunction = ProgramFunction(self._body, name=f"pipeline_{schedule}_s{n}_m{n_micro}")

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    def __call__(self, params: list, opt_states: list, inputs: Array, targets: Array) -> tuple:
        return self.step(params, opt_states, inputs, targets)

    def init(self, params: Sequence[Any]) -> tuple[list, list]:
        """Place each stage's params (numpy or jax pytrees) on its slice and initialize its optimizer
        state there (one program for all stages). Returns ``(params, opt_states)``, lists of pytrees of
        ``pw.Array``."""
        if len(params) != self.n_stages:
            raise ProgramError(f"init got params for {len(params)} stages; the pipeline has {self.n_stages}")
        placed = []
        for k, (stage, tree) in enumerate(zip(self.stages, params)):
            specs = broadcast_specs(stage.param_specs, tree, f"stage {k} param_specs")
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            placed.append(jax.tree_util.tree_unflatten(
                treedef, [put(np.asarray(v), stage.slice, sp) for v, sp in zip(leaves, specs)]))
        return placed, self._init_states(placed)

    def memory(self, params: list, opt_states: list, inputs: Array, targets: Array) -> list[StageMemory]:
        """Peak live activations per stage, simulated on the lowered fragments of this step.

        Each island runs its fragment's ops in order and frees a value right after its last use
        there, so replaying the ops (writes add a buffer, ``free`` ops drop it) gives the exact peak
        of per-micro-batch buffers (inputs, activations, residuals, gradients) on each stage's slice.
        """
        from client.lowering import lower

        tags: dict[int, int] = {}
        graph = ProgramFunction(partial(self._body, tags=tags), name=self.step.name).graph(
            params, opt_states, inputs, targets)
        return _replay(graph, lower(graph, defaultdict(bytes)), tags, self.stages)

    # -- the traced step ----------------------------------------------------------------------
    def _take(self, index: int, size: int, where: VirtualSlice, spec: P | None) -> CompiledFunction:
        key = (index, size, where.key, spec)
        fn = self._takes.get(key)
        if fn is None:
            fn = self._takes[key] = jit(_take(index, size), slice=where, in_specs=(spec,), out_specs=spec,
                                        name=f"micro_batch{index}")
        return fn

    def _body(self, params: list, opt_states: list, inputs: Any, targets: Any,
              tags: dict[int, int] | None = None) -> tuple:
        n, m = self.n_stages, self.n_micro
        self._check_args(params, opt_states, inputs, targets)
        size = inputs.shape[0] // m
        self._check_shapes(params, inputs, targets, size)

        def tag(tree: Any, i: int) -> Any:
            if tags is not None:
                for leaf in jax.tree_util.tree_leaves(tree):
                    tags[leaf.value.slot] = i
            return tree

        first, last = self.stages[0], self.stages[-1]
        produced: dict[tuple, Any] = {}  # (stage, micro, "y" | "dx") -> a value still to be sent
        received: dict[tuple, Any] = {}  # (stage, micro, "x" | "dy") -> a value moved to its consumer
        saved: dict[tuple[int, int], Any] = {}  # (stage, micro) -> what its backward needs
        acc: list[Any] = [None] * n
        loss_acc = None
        for item in self.order:
            if item[0] == "T":
                _, what, src, dst, i = item
                stage = self.stages[dst]
                spec = stage.in_spec if what == "x" else stage.out_spec
                value = produced.pop((src, i, "y" if what == "x" else "dx"))
                received[(dst, i, "x" if what == "x" else "dy")] = tag(
                    transfer(value, stage.slice, P() if spec is None else spec), i)
                continue
            _, s, kind, i = item
            fns, p = self._fns[s], params[s]
            if kind in ("F", "FB"):
                x = (tag(self._take(i, size, first.slice, first.in_spec)(inputs), i) if s == 0
                     else received.pop((s, i, "x")))
            if kind == "F":
                y, keep = (fns.fwd(p, x), x) if self.remat else fns.fwd(p, x)
                produced[(s, i, "y")], saved[(s, i)] = tag(y, i), tag(keep, i)
                continue
            if kind == "FB":
                t = tag(self._take(i, size, last.slice, self.target_spec)(targets), i)
                extra = () if acc[s] is None else (acc[s], loss_acc)
                outs = fns.bwd[acc[s] is not None](p, x, t, *extra)
                acc[s], loss_acc = outs[0], outs[1]
            else:
                extra = () if acc[s] is None else (acc[s],)
                outs = fns.bwd[acc[s] is not None](p, saved.pop((s, i)), received.pop((s, i, "dy")), *extra)
                acc[s] = outs if s == 0 else outs[0]
            if s > 0:
                produced[(s, i, "dx")] = tag(outs[-1], i)
        new_params, new_states = [], []
        for s in range(n - 1):
            p, o = self._fns[s].update(params[s], opt_states[s], acc[s])
            new_params.append(p)
            new_states.append(o)
        p, o, loss = self._fns[-1].update(params[-1], opt_states[-1], acc[-1], loss_acc)
        return new_params + [p], new_states + [o], loss

    def _check_args(self, params: Any, opt_states: Any, inputs: Any, targets: Any) -> None:
        n = self.n_stages
        for what, value in (("params", params), ("opt_states", opt_states)):
            if not isinstance(value, (list, tuple)) or len(value) != n:
                got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
                raise ProgramError(f"pipeline step: {what} must be a list with one pytree per stage "
                                   f"({n}), got {got}")
            for s, (stage, tree) in enumerate(zip(self.stages, value)):
                for leaf in jax.tree_util.tree_leaves(tree):
                    if isinstance(leaf, TracedValue) and leaf.slice is not stage.slice:
                        raise ProgramError(
                            f"pipeline step: {what} of stage {s} live on slice {leaf.slice.key} (island "
                            f"{leaf.slice.island}) but the stage runs on {stage.slice.key} (island "
                            f"{stage.slice.island}); place them with Pipeline.init")
        for what, value in (("inputs", inputs), ("targets", targets)):
            if not isinstance(value, TracedValue) or value.ndim < 1:
                raise ProgramError(f"pipeline step: {what} must be one pw.Array with a batch dimension, "
                                   f"got {value!r}")
        if inputs.shape[0] != targets.shape[0]:
            raise ProgramError(f"pipeline step: inputs have batch {inputs.shape[0]} but targets "
                               f"{targets.shape[0]}")
        if inputs.shape[0] % self.n_micro:
            raise ProgramError(f"pipeline step: batch {inputs.shape[0]} does not split into "
                               f"{self.n_micro} equal micro-batches")

    def _check_shapes(self, params: list, inputs: Any, targets: Any, size: int) -> None:
        """Run the stack abstractly, so a shape mismatch between stages names both stages."""
        def struct(shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

        x = struct((size,) + tuple(inputs.shape[1:]), inputs.dtype)
        for s, (stage, p) in enumerate(zip(self.stages, params)):
            p_abs = jax.tree_util.tree_map(lambda v: struct(v.shape, v.dtype), p)
            try:
                x = jax.eval_shape(stage.fn, p_abs, x)
            except Exception as exc:  # the stage's own code failing for these shapes
                source = "the micro-batch" if s == 0 else f"the output of stage {s - 1}"
                raise ProgramError(f"pipeline: stage {s} cannot take {source} ({_describe(x)}): "
                                   f"{type(exc).__name__}: {exc}") from None
            if not isinstance(x, jax.ShapeDtypeStruct):
                raise ProgramError(f"pipeline: stage {s} must return one array, got {_describe(x)}")
        t = struct((size,) + tuple(targets.shape[1:]), targets.dtype)
        try:
            loss = jax.eval_shape(self.loss_fn, x, t)
        except Exception as exc:
            raise ProgramError(f"pipeline: loss_fn cannot take the last stage's output ({_describe(x)}) and "
                               f"the targets ({_describe(t)}): {type(exc).__name__}: {exc}") from None
        if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
            raise ProgramError(f"pipeline: loss_fn must return a scalar, got {_describe(loss)}")


def _describe(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and hasattr(leaves[0], "shape"):
        return f"{np.dtype(leaves[0].dtype).name}{list(leaves[0].shape)}"
    return repr(jax.tree_util.tree_map(lambda v: f"{np.dtype(v.dtype).name}{list(v.shape)}", tree))


def _replay(graph: Program, lowered: Any, tags: dict[int, int], stages: list[Stage]) -> list[StageMemory]:
    """Replay each island's ops, tracking the tagged (per-micro-batch) buffers on each stage's slice."""
    value = {v.slot: v for v in graph.values}
    stage_of = {st.slice.key: k for k, st in enumerate(stages)}
    peaks = {k: [0, 0, 0] for k in range(len(stages))}
    for fragment in lowered.fragments.values():
        live: dict[int, Any] = {}
        for op in fragment.ops:
            for slot in op.writes():
                if slot in tags and value[slot].slice.key in stage_of:
                    live[slot] = value[slot]
            for k in peaks:
                mine = [s for s, v in live.items() if stage_of[v.slice.key] == k]
                micro = len({tags[s] for s in mine})
                nbytes = sum(live[s].nbytes for s in mine)
                peaks[k] = [max(peaks[k][0], micro), max(peaks[k][1], len(mine)), max(peaks[k][2], nbytes)]
            for slot in op.frees:
                live.pop(slot, None)
    return [StageMemory(k, st.slice.island, st.slice.key, *peaks[k]) for k, st in enumerate(stages)]


def build(stages: Sequence[Stage], loss_fn: Callable[[Any, Any], Any], optimizer: Any, n_micro: int,
          schedule: str = "1f1b", *, target_spec: P | None = None, remat: bool = False) -> Pipeline:
    """A pipelined training step over ``stages`` with ``n_micro`` micro-batches per step.

    The step's gradients are the mean over micro-batches, so they equal ``jax.grad`` of the unpipelined
    model on the whole batch. Every micro-batch's forward and backward, the transfers between stages and
    each stage's optimizer update form one ``@pw.program``: one dispatch per step.

        pipe = build([Stage(mlp, s0), Stage(mlp, s1)], mse, optax.sgd(0.1), n_micro=4)
        params, opt_states = pipe.init([p0, p1])
        params, opt_states, loss = pipe.step(params, opt_states, x, y)

    Args:
        stages: the ``pw.pipeline.Stage`` s in model order, each a function on its own slice (usually
            one per island; stages sharing an island take turns).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of one micro-batch, computed on
            the last stage's slice.
        optimizer: an optax ``GradientTransformation``, applied to each stage's params on its own slice.
        n_micro: micro-batches per step; the batch size must be a multiple of it.
        schedule: "1f1b" (at most S micro-batches of activations held per stage, for S stages) or
            "gpipe" (all forwards, then all backwards: all M held).
        target_spec: the sharding of the targets on the last stage's slice (default: replicated).
        remat: False: the forward keeps its ``jax.vjp`` residuals for the backward. True: it keeps
            only the stage's input and the backward recomputes the forward (less memory, one more
            forward of compute).

    Returns:
        A ``Pipeline``: ``init(params)`` places each stage's params and optimizer state, ``step`` runs one
        training step, ``memory`` reports each stage's peak activations.

    Raises:
        ProgramError: a stage, ``loss_fn``, ``optimizer``, ``n_micro`` or ``schedule`` is not what is
            described above.
    """
    stages = list(stages) if isinstance(stages, (list, tuple)) else stages
    if not isinstance(stages, list):
        raise ProgramError(f"stages must be a list of pw.pipeline.Stage, got {type(stages).__name__}")
    check_counts(len(stages), n_micro, schedule)
    for k, st in enumerate(stages):
        if not isinstance(st, Stage):
            raise ProgramError(f"stage {k} is a {type(st).__name__}; wrap it as pw.pipeline.Stage(fn, slice)")
        if not callable(st.fn):
            raise ProgramError(f"stage {k}: fn must be callable as fn(params, x), got {st.fn!r}")
        if not isinstance(st.slice, VirtualSlice):
            raise ProgramError(f"stage {k}: slice must come from pw.slice(...), got {type(st.slice).__name__}")
    if not callable(loss_fn):
        raise ProgramError(f"loss_fn must be callable as loss_fn(outputs, targets), got {loss_fn!r}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ProgramError(f"optimizer must be an optax GradientTransformation, got {type(optimizer).__name__}")
    return Pipeline(stages, loss_fn, optimizer, n_micro, schedule, target_spec, remat)
