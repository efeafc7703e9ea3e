"""``@pw.program``: trace a Python block that calls compiled functions into one dataflow Program.

The body runs once per input signature with abstract ``TracedValue``s; each
``pw.jit`` call adds a Compute node, and a value used on another slice (or
with another sharding) gets a Transfer node. Reading a traced value's
contents is refused with the offending line, since it does not exist yet.
"""

from __future__ import annotations

import contextvars
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array, ensure_arrays
from pathways.errors import ProgramError
from pathways.graph import Compute, Program, Transfer, Value
from pathways.sharding import spec_to_wire

_trace: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("pathways_trace", default=None)
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
                  for d in ("client", "pathways", "resource_manager"))


_recent: dict[str, Program] = {}  # each program name's latest graph, for `pathways graph` after a script ran


def recent_graph(name: str) -> Program | None:
    """The graph a program called ``name`` traced most recently in this process, if any."""
    return _recent.get(name)


def _events() -> Any:
    from client.session import current

    return current().events


def current_trace() -> Trace | None:
    return _trace.get()


def user_line() -> str:
    """'file:line: code' of the innermost frame outside the runtime (the user's offending line)."""
    import linecache

    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: {code}"


def norm_spec(spec: P) -> tuple:
    entries = spec_to_wire(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


class TracedValue:
    """A value inside a program being traced: shape, dtype, slice and spec are known; contents are not."""

    __slots__ = ("value", "trace")

    def __init__(self, value: Value, trace: Trace) -> None:
        self.value = value
        self.trace = trace

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: np.dtype(self.value.dtype))
    slice = property(lambda self: self.value.slice)
    spec = property(lambda self: self.value.spec)
    ndim = property(lambda self: len(self.value.shape))

    def _refuse(self, what: str) -> Any:
        raise ProgramError(
            f"{what} a traced value inside @pw.program at {user_line()}. Inside a program, values are futures "
            "on the islands; compute with pw.jit functions, and read results after the program returns")

    def __bool__(self) -> bool:
        return self._refuse("reading the truth value of")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse("converting to numpy")

    def __float__(self) -> float:
        return self._refuse("converting to float")

    def __int__(self) -> int:
        return self._refuse("converting to int")

    def __index__(self) -> int:
        return self._refuse("using as an index")

    def __iter__(self) -> Any:
        return self._refuse("iterating over")

    def item(self) -> Any:
        return self._refuse("reading an item of")

    def tolist(self) -> Any:
        return self._refuse("reading")

    def fetch(self, *args: Any) -> Any:
        return self._refuse("fetching")

    def _op(self, *args: Any) -> Any:
        return self._refuse("computing with")

    __gt__ = __lt__ = __ge__ = __le__ = _op
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _op
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _op
    __getitem__ = _op

    def __repr__(self) -> str:
        return f"TracedValue({self.value.describe()} on {self.value.slice.key}, spec={self.value.spec})"


class Trace:
    """The graph under construction while a program body runs."""

    def __init__(self, name: str, op_by_op: bool) -> None:
        self.program = Program(name)
        self.op_by_op = op_by_op
        self.exes: dict[str, bytes] = {}
        self._moved: dict[tuple, Value] = {}
        self._slots = 0

    def new_value(self, shape: tuple[int, ...], dtype: np.dtype, slice: Any, spec: P) -> Value:  # noqa: A002
        self._slots += 1  # slots are positions in program.values: inputs, then each node's outputs in order
        return Value(self._slots - 1, tuple(shape), np.dtype(dtype), slice, spec)

    def call(self, fn: Any, args: tuple) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        for leaf in leaves:
            if isinstance(leaf, TracedValue) and leaf.trace is self:
                continue
            if isinstance(leaf, Array):
                raise ProgramError(f"{fn.name} got a pw.Array that is not an argument of the program, at "
                                   f"{user_line()}; pass every pw.Array into the @pw.program as an argument")
            raise ProgramError(f"{fn.name} takes pw.Array arguments; got {type(leaf).__name__} at {user_line()}")
        if not leaves and fn.slice is None:
            raise ProgramError(f"{fn.name} has no slice and no arguments to take one from; give pw.jit a slice")
        target = fn.slice or leaves[0].slice
        avals = [(leaf.shape, leaf.dtype) for leaf in leaves]
        exported = fn.export(target, args, avals)
        self.exes[exported.exe] = exported.blob
        inputs = []
        for leaf, spec in zip(leaves, exported.in_specs):
            value = leaf.value
            if value.slice is not target or norm_spec(value.spec) != norm_spec(spec):
                if self.op_by_op and value.slice is not target:
                    raise ProgramError(
                        f"{fn.name} runs on {target.key} (island {target.island}) but an argument lives on "
                        f"{value.slice.key} (island {value.slice.island}), at {user_line()}. Call it inside a "
                        "@pw.program, which inserts the transfer, or pw.put the value on the right slice")
                value = self.move(value, target, spec)
            inputs.append(value)
        outputs = [self.new_value(shape, dtype, target, spec)
                   for (shape, dtype), spec in zip(exported.out_avals, exported.out_specs)]
        self.program.nodes.append(Compute(fn.name, exported.exe, target, tuple(inputs), tuple(outputs),
                                          exported.in_specs, exported.out_specs))
        return jax.tree_util.tree_unflatten(exported.out_tree, [TracedValue(v, self) for v in outputs])

    def move(self, value: Value, target: Any, spec: P) -> Value:
        """A Transfer of ``value`` to ``target`` resharded as ``spec`` (one per destination)."""
        key = (value.slot, target.key, norm_spec(spec))
        moved = self._moved.get(key)
        if moved is None:
            moved = self.new_value(value.shape, value.dtype, target, spec)
            self.program.nodes.append(Transfer(value, moved))
            self._moved[key] = moved
        return moved


@dataclass
class Traced:
    program: Program
    exes: dict[str, bytes]
    lowered: Any = None


class ProgramFunction:
    """What ``@pw.program`` returns: traces once per signature, then dispatches on every call."""

    def __init__(self, fn: Callable, name: str | None = None, op_by_op: bool = False) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "program")
        self.op_by_op = op_by_op
        self._cache: dict[Any, Traced] = {}
        self._last: Traced | None = None

    def _signature(self, args: tuple) -> tuple[list, Any, Any]:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        sig = []
        for leaf in leaves:
            if isinstance(leaf, Array):
                sig.append((leaf.shape, leaf.dtype.str, leaf.slice.key, norm_spec(leaf.spec)))
            elif isinstance(leaf, (np.ndarray, jax.Array)):
                ensure_arrays([leaf], f"@pw.program {self.name}")
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise ProgramError(f"{self.name}: argument {leaf!r} is neither a pw.Array nor a hashable "
                                       "static value") from None
                sig.append(("static", leaf))
        return leaves, treedef, (treedef, tuple(sig))

    def _trace(self, leaves: list, treedef: Any) -> Traced:
        trace = Trace(self.name, self.op_by_op)
        traced_args = []
        for leaf in leaves:
            if isinstance(leaf, Array):
                value = trace.new_value(leaf.shape, leaf.dtype, leaf.slice, leaf.spec)
                trace.program.inputs.append(value)
                traced_args.append(TracedValue(value, trace))
            else:
                traced_args.append(leaf)
        token = _trace.set(trace)
        try:
            out = self.fn(*jax.tree_util.tree_unflatten(treedef, traced_args))
        finally:
            _trace.reset(token)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        for leaf in out_leaves:
            if not (isinstance(leaf, TracedValue) and leaf.trace is trace):
                raise ProgramError(f"@pw.program {self.name} returned {type(leaf).__name__}; a program returns "
                                   "values computed by pw.jit functions (or its own arguments)")
        trace.program.outputs = [leaf.value for leaf in out_leaves]
        trace.program.out_tree = out_tree
        return Traced(trace.program, trace.exes)

    def _traced(self, args: tuple) -> tuple[Traced, list]:
        leaves, treedef, key = self._signature(args)
        traced = self._cache.get(key)
        if traced is None:
            start = time.time()
            traced = self._trace(leaves, treedef)
            self._cache[key] = traced
            self._last = traced
            _recent[self.name] = traced.program
            _events().span(f"trace {self.name}", "trace", start, time.time(), nodes=len(traced.program.nodes))
        return traced, leaves

    @property
    def last_graph(self) -> Program | None:
        """The graph this function traced most recently, if it ever ran."""
        return None if self._last is None else self._last.program

    def graph(self, *args: Any) -> Program:
        """The Program this function traces to for these arguments (traced once, then cached).

        With no arguments: the most recently traced graph.
        """
        if not args and self._last is not None:
            return self._last.program
        return self._traced(args)[0].program

    def __call__(self, *args: Any) -> Any:
        if current_trace() is not None:
            return self.fn(*args)  # a program called from a program is inlined into the outer graph
        from client.dispatch import dispatch

        traced, leaves = self._traced(args)
        return dispatch(traced, leaves)


_moves: dict[tuple, ProgramFunction] = {}


def transfer(value: Any, slice: Any, spec: P | None = None) -> Any:  # noqa: A002
    """Move ``value`` (a pw.Array, or a pytree of them) to ``slice``, resharded as ``spec`` (default: its own).

    Inside a program the transfer joins the graph here: the send still leaves
    right after the value is produced (sends never wait), and the receiving
    island takes the value at this point in its order. Outside a program it
    runs as a one-transfer program.
    """
    trace = current_trace()
    if trace is None:
        leaves = jax.tree_util.tree_leaves(value)
        key = (slice.key, None if spec is None else norm_spec(spec), len(leaves))
        fn = _moves.get(key)
        if fn is None:
            fn = _moves[key] = ProgramFunction(lambda v: transfer(v, slice, spec), name="transfer")
        return fn(value)

    def move(leaf: Any) -> TracedValue:
        if not (isinstance(leaf, TracedValue) and leaf.trace is trace):
            raise ProgramError(f"pw.transfer inside a program takes its values, got {type(leaf).__name__} "
                               f"at {user_line()}")
        target_spec = leaf.spec if spec is None else spec
        if leaf.slice is slice and norm_spec(leaf.spec) == norm_spec(target_spec):
            return leaf
        return TracedValue(trace.move(leaf.value, slice, target_spec), trace)

    return jax.tree_util.tree_map(move, value)


def program(fn: Callable) -> ProgramFunction:
    """Decorate a function that calls pw.jit functions: each call runs it as one dataflow program."""
    return ProgramFunction(fn)
