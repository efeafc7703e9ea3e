"""A training step traced into one flat list of equations, with what depends on the batch and how.

The step is traced twice with ``jax.make_jaxpr``, at the micro-batch size b and at 2b. The two jaxprs
have the same equations; a value whose shape differs between them carries the batch (its *batch axis* is
the one that doubled), and an equation that reads or writes such a value runs once per micro-batch.
Calls inside the step (``jax.jit``) are inlined, and so is ``jax.checkpoint`` where it holds stage marks, so
every mark, and every equation an update does for one layer, is an equation of the one flat list.
``client.pipeline.split`` cuts that list into stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, jaxprs_in_params

from client.pipeline.marker import END_STAGE, END_STAGE_BWD
from pathways.errors import ProgramError

MARKS = (END_STAGE, END_STAGE_BWD)
PLAIN_CALLS = ("jit", "pjit", "closed_call", "core_call")  # calls whose bodies are always inlined
CALLS = (*PLAIN_CALLS, "checkpoint", "remat")  # calls whose bodies are inlined when they hold a stage mark


@dataclass(frozen=True)
class Const:
    """A literal or a captured constant read by an equation (or returned by the step)."""

    value: Any


Atom = int | Const  # a value of the flat graph by its id, or a constant


@dataclass(frozen=True)
class Eqn:
    """One primitive application: ``outs = prim.bind(*ins, **params)``; values are ids of ``StepGraph.avals``."""

    prim: Primitive
    params: dict
    ins: tuple[Atom, ...]
    outs: tuple[int, ...]

    def run(self, read: Callable[[Atom], Any]) -> list:
        """Apply the primitive to the values ``read`` gives for its inputs (as ``jax.core.eval_jaxpr`` does)."""
        bind = self.prim.get_bind_params(self.params)
        subfuns, params = bind if isinstance(bind, tuple) else ((), bind)  # JAX before 0.7 returns a pair
        out = self.prim.bind(*subfuns, *[read(a) for a in self.ins], **params)
        return list(out) if self.prim.multiple_results else [out]


@dataclass
class StepGraph:
    """The step at the micro-batch size: its equations in order, and for every value its shape, dtype and batch
    axis (None: the value does not carry the batch; -1: it does, along no single axis)."""

    eqns: list[Eqn]
    avals: list[jax.ShapeDtypeStruct]
    batch_axis: list[int | None]
    inputs: list[int]  # one value per flat input leaf
    outputs: list[Atom]  # one per flat output leaf
    out_tree: Any


def _has_mark(jaxpr: Jaxpr) -> bool:
    return any(e.primitive in MARKS or any(_has_mark(j) for j in jaxprs_in_params(e.params)) for e in jaxpr.eqns)


class _Flattener:
    """Renames a jaxpr's variables to ids in one flat list, inlining the calls whose bodies hold marks."""

    def __init__(self) -> None:
        self.eqns: list[Eqn] = []
        self.avals: list[Any] = []

    def new(self, aval: Any) -> int:
        self.avals.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
        return len(self.avals) - 1

    def inline(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Atom]) -> list[Atom]:
        env: dict[Any, Atom] = {}

        def read(v: Any) -> Atom:
            return Const(v.val) if isinstance(v, Literal) else env[v]

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = Const(c)
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for e in jaxpr.eqns:
            ins = [read(v) for v in e.invars]
            body = self._callee(e)
            if body is not None:
                outs = self.inline(body[0], body[1], ins)
            else:
                if any(_has_mark(j) for j in jaxprs_in_params(e.params)):
                    raise ProgramError(f"pw.pipeline: a stage mark inside {e.primitive.name} (a loop, a branch or a "
                                       "custom derivative) cannot be cut; call pw.pipeline.end_stage outside it")
                outs = [self.new(v.aval) for v in e.outvars]
                self.eqns.append(Eqn(e.primitive, dict(e.params), tuple(ins), tuple(outs)))
            for var, a in zip(e.outvars, outs):
                env[var] = a
        return [read(v) for v in jaxpr.outvars]

    @staticmethod
    def _callee(e: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
        """The body of a call to inline: a plain call (jax.jit, closed_call) always, so that work it does for
        several stages at once (an optimizer's update of every layer, as optax does under jax.jit) is cut per
        stage too; jax.checkpoint only when it holds a mark. None for any other equation."""
        name = e.primitive.name
        if name not in CALLS:
            return None
        for key in ("jaxpr", "call_jaxpr"):
            body = e.params.get(key)
            jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
            if isinstance(jaxpr, Jaxpr) and (name in PLAIN_CALLS or _has_mark(jaxpr)):
                return jaxpr, consts
        return None


def _flatten(fn: Callable, structs: list[jax.ShapeDtypeStruct]) -> tuple[_Flattener, list[int], list[Atom], Any]:
    out_tree: list = []

    def flat(*leaves: Any) -> list:
        outs, tree = jax.tree_util.tree_flatten(fn(*leaves))
        out_tree.append(tree)
        return outs

    closed = jax.make_jaxpr(flat)(*structs)
    f = _Flattener()
    inputs = [f.new(v.aval) for v in closed.jaxpr.invars]
    outputs = f.inline(closed.jaxpr, closed.consts, inputs)
    return f, inputs, outputs, out_tree[0]


def trace_step(fn: Callable, structs: list[jax.ShapeDtypeStruct], batch_leaves: set[int], micro: int,
               name: str) -> StepGraph:
    """``fn(*leaves)`` traced at micro-batch size ``micro`` (axis 0 of the ``batch_leaves``), with each value's
    batch axis found by tracing again at twice that size."""
    def at(size: int) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct((size,) + tuple(s.shape[1:]), s.dtype) if k in batch_leaves else s
                for k, s in enumerate(structs)]

    try:
        small, inputs, outputs, out_tree = _flatten(fn, at(micro))
        large = _flatten(fn, at(2 * micro))[0]
    except ProgramError:
        raise
    except Exception as exc:  # the user's step failing for these shapes
        raise ProgramError(f"pw.pipeline.jit({name}): the step cannot be traced at the micro-batch size {micro} "
                           f"(and {2 * micro}): {type(exc).__name__}: {exc}. The step is traced per micro-batch, so "
                           "it must not assume the whole batch's size") from None
    same = len(small.eqns) == len(large.eqns) and len(small.avals) == len(large.avals) and all(
        a.prim is b.prim for a, b in zip(small.eqns, large.eqns))
    if not same:
        raise ProgramError(f"pw.pipeline.jit({name}): the step traces to different computations at micro-batch "
                           f"sizes {micro} and {2 * micro}; its Python control flow must not depend on the batch size")
    axes: list[int | None] = []
    for a, b in zip(small.avals, large.avals):
        if a.shape == b.shape:
            axes.append(None)
            continue
        diff = [k for k, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        axes.append(diff[0] if len(a.shape) == len(b.shape) and len(diff) == 1 else -1)
    return StepGraph(small.eqns, small.avals, axes, inputs, outputs, out_tree)


def nbytes(aval: jax.ShapeDtypeStruct) -> int:
    """Bytes of one value of this shape and dtype."""
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
