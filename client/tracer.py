"""Tracing: a Python block that calls compiled functions, run once with abstract values, becomes a Program.

The body runs once per input signature with abstract ``TracedValue``s; each
``pw.jit`` call adds a Compute node, and a value used on another slice (or
with another sharding) gets a Transfer node. Reading a traced value's
contents is refused with the offending line, since it does not exist yet.
``client.program`` (``@pw.program``) drives a trace and dispatches its result.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array
from client.host_values import (
    HostData,
    KeyInfo,
    as_host_data,
    dtype_name,
    is_host_value,
    physical,
)
from pathways.errors import ProgramError
from pathways.graph import Compute, Program, Transfer, Value
from pathways.sharding import norm_spec

_trace: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("pathways_trace", default=None)
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
                  for d in ("client", "pathways", "resource_manager"))


def current_trace() -> Trace | None:
    """The trace being built in this context, if a program body is running."""
    return _trace.get()


@contextlib.contextmanager
def enter(trace: Trace) -> Iterator[None]:
    """Make ``trace`` the current one while a program body runs."""
    token = _trace.set(trace)
    try:
        yield
    finally:
        _trace.reset(token)


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


def user_stacklevel() -> int:
    """The ``stacklevel`` at which a ``warnings.warn`` in the caller points at the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class InTrace:
    """What a program body holds instead of contents: reading them is refused with the offending line."""

    __slots__ = ()

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

    def __len__(self) -> int:
        return self._refuse("taking the length of")

    def item(self) -> Any:
        """Refused: a traced value has no contents."""
        return self._refuse("reading an item of")

    def tolist(self) -> Any:
        """Refused: a traced value has no contents."""
        return self._refuse("reading")

    def fetch(self, *args: Any) -> Any:
        """Refused: a traced value has no contents."""
        return self._refuse("fetching")

    def _op(self, *args: Any) -> Any:
        return self._refuse("computing with")

    __gt__ = __lt__ = __ge__ = __le__ = _op
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _op
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _op
    __getitem__ = _op

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

    @property
    def aval(self) -> tuple[tuple[int, ...], Any, bool]:
        """(shape, dtype, weak_type) as a ``jax.jit`` argument."""
        return self.shape, self.dtype, self.weak_type


class TracedValue(InTrace):
    """A value inside a program being traced: shape, dtype, slice and spec are known; contents are not.

    ``value`` is the graph's view (the buffer on the island: a key array's uint32 data); ``shape`` and
    ``dtype`` are the user's (a key array's key shape and key dtype).
    """

    __slots__ = ("value", "trace", "key", "weak_type")

    def __init__(self, value: Value, trace: Trace, key: KeyInfo | None = None, weak_type: bool = False) -> None:
        self.value = value
        self.trace = trace
        self.key = key
        self.weak_type = weak_type

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's shape as the user sees it (a key array's, without its key data's trailing dims)."""
        shape = self.value.shape
        return shape[:len(shape) - len(self.key.data_shape)] if self.key is not None else shape

    @property
    def dtype(self) -> Any:
        """The value's dtype as the user sees it (a key array's key dtype)."""
        return self.key.dtype if self.key is not None else np.dtype(self.value.dtype)

    slice = property(lambda self: self.value.slice)
    spec = property(lambda self: self.value.spec)

    def __repr__(self) -> str:
        return f"TracedValue({dtype_name(self.dtype)}{list(self.shape)} on {self.value.slice.key}, spec={self.spec})"


class HostValue(InTrace):
    """A value from the client inside a program being traced: a numpy array or jax.Array argument of the
    program (its contents arrive with each call), or a constant the body passed to a pw.jit function. It
    has no slice yet: each pw.jit function that takes it places it on its own slice, per its in_specs."""

    __slots__ = ("source", "shape", "dtype", "weak_type", "trace")

    slice = None
    spec = None

    def __init__(self, source: tuple, aval: tuple, trace: Trace) -> None:
        self.source = source  # ("arg", leaf index) or ("const", index into Trace.constants)
        self.shape, self.dtype, self.weak_type = aval
        self.trace = trace

    def __repr__(self) -> str:
        return f"HostValue({dtype_name(self.dtype)}{list(self.shape)}, not yet on a slice)"


@dataclass(frozen=True)
class Placement:
    """A program input that is a host value sent to ``slice`` as ``spec`` on each call."""

    source: tuple  # as HostValue.source
    slice: Any
    spec: P
    aval: tuple  # shape, dtype, weak_type of the value


class Trace:
    """The graph under construction while a program body runs."""

    def __init__(self, name: str, op_by_op: bool) -> None:
        self.program = Program(name)
        self.op_by_op = op_by_op
        self.exes: dict[str, bytes] = {}
        self.sources: list = []  # per program input: ("array", leaf index) or a Placement
        self.constants: list[HostData] = []
        self._consts: dict[Any, HostValue] = {}
        self._placed: dict[tuple, Value] = {}
        self._moved: dict[tuple, Value] = {}
        self._slots = 0
        self.donations: list[tuple[int, tuple[int, ...]]] = []  # (node index, input positions it asks to donate)

    def new_value(self, shape: tuple[int, ...], dtype: np.dtype, slice: Any, spec: P) -> Value:  # noqa: A002
        """A new value of the graph, numbered in order of creation."""
        self._slots += 1  # renumbered once the body returns, so that the program's inputs come first
        return Value(self._slots - 1, tuple(shape), np.dtype(dtype), slice, spec)

    def add_input(self, shape: tuple[int, ...], dtype: np.dtype, slice: Any, spec: P, source: Any) -> Value:  # noqa: A002
        """A new program input; ``source`` says where a call supplies it from (``Trace.sources``)."""
        value = self.new_value(shape, dtype, slice, spec)
        self.program.inputs.append(value)
        self.sources.append(source)
        return value

    def constant(self, value: Any, what: str) -> HostValue:
        """A host value the body passes to a pw.jit function: captured now, sent with every call (cached)."""
        host = as_host_data(value, what)
        ident = host.content_key() or ("id", id(value))
        hv = self._consts.get(ident)
        if hv is None:
            self.constants.append(host)
            hv = self._consts[ident] = HostValue(("const", len(self.constants) - 1), host.aval, self)
        return hv

    def place(self, hv: HostValue, target: Any, spec: P) -> Value:
        """The program input that carries ``hv`` to ``target`` as ``spec`` (one per destination)."""
        key = (hv.source, target.key, norm_spec(spec))
        value = self._placed.get(key)
        if value is None:
            shape, dtype = physical(hv.shape, hv.dtype)
            value = self.add_input(shape, dtype, target, spec, Placement(hv.source, target, spec, hv.aval))
            self._placed[key] = value
        return value

    def operand(self, leaf: Any, fn_name: str, where: str) -> TracedValue | HostValue:
        """``leaf`` as a value of this trace, or a ProgramError saying why it cannot be one."""
        if isinstance(leaf, (TracedValue, HostValue)):
            if leaf.trace is not self:
                raise ProgramError(f"{fn_name} got a value of another program being traced, at {user_line()}")
            return leaf
        if isinstance(leaf, Array):
            raise ProgramError(f"{fn_name} got a pw.Array that is not an argument of the program, at "
                               f"{user_line()}; pass every pw.Array into the @pw.program as an argument")
        if is_host_value(leaf):
            return self.constant(leaf, f"{fn_name}: {where}")
        raise ProgramError(f"{fn_name}: {where} is a {type(leaf).__name__}, which is not an array, at {user_line()}; "
                           "pass pw.Arrays, numpy or jax arrays, or scalars, or mark the argument static "
                           "(static_argnums/static_argnames)")

    def call(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call of pw.jit function ``fn`` inside the body: a Compute node, with transfers of arguments that live on
        another slice or with another sharding; returns its outputs as TracedValues."""
        try:
            bound = fn.bind(args, kwargs)
        except ProgramError as exc:
            raise ProgramError(f"{str(exc).rstrip('.')}, at {user_line()}") from None
        paths = jax.tree_util.tree_flatten_with_path((bound.dyn_args, bound.dyn_kwargs))[0]
        leaves = [self.operand(leaf, fn.name, f"argument {arg_path(path)}") for path, leaf in paths]
        slices = [leaf.slice for leaf in leaves if isinstance(leaf, TracedValue)]
        if fn.slice is None and not slices:
            raise ProgramError(f"{fn.name} has no slice and no pw.Array argument to take one from, at "
                               f"{user_line()}; give pw.jit a slice (pw.jit(fn, slice=s))")
        target = fn.slice or slices[0]
        try:  # a shape or sharding the function cannot take: the user's line says which call
            exported = fn.export(target, bound, [leaf.aval for leaf in leaves])
        except ProgramError as exc:
            raise ProgramError(f"{str(exc).rstrip('.')}, at {user_line()}") from None
        self.exes[exported.exe] = exported.blob
        inputs = []
        for leaf, spec in zip(leaves, exported.in_specs):
            if isinstance(leaf, HostValue):
                inputs.append(self.place(leaf, target, spec))
                continue
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
        donate = tuple(k for k, flag in enumerate(bound.donate) if flag)
        if donate:
            self.donations.append((len(self.program.nodes), donate))
        self.program.nodes.append(Compute(fn.name, exported.exe, target, tuple(inputs), tuple(outputs),
                                          exported.in_specs, exported.out_specs))
        results = [TracedValue(v, self, key, weak)
                   for v, key, weak in zip(outputs, exported.out_keys, exported.out_weak)]
        return jax.tree_util.tree_unflatten(exported.out_tree, results)

    def move(self, value: Value, target: Any, spec: P) -> Value:
        """A Transfer of ``value`` to ``target`` resharded as ``spec`` (one per destination)."""
        key = (value.slot, target.key, norm_spec(spec))
        moved = self._moved.get(key)
        if moved is None:
            moved = self.new_value(value.shape, value.dtype, target, spec)
            self.program.nodes.append(Transfer(value, moved))
            self._moved[key] = moved
        return moved

    def finish(self) -> dict[int, str]:
        """Settle donation and number the values (inputs first); returns {input index: function it was
        donated to}.

        A Compute keeps the donations it asked for only where that is safe: the value is used by no later
        node, is not an output of the program, is not sent to another slice (sends run in the background),
        is not passed twice to the same call, and is not a host value (those are the client's, and may be
        cached)."""
        program = self.program
        nodes = program.nodes
        last_read: dict[int, int] = {}
        sent: set[int] = set()
        for i, node in enumerate(nodes):
            for v in node.inputs:
                last_read[v.slot] = i
            if isinstance(node, Transfer):
                sent.add(node.source.slot)
        keep = {v.slot for v in program.outputs} | sent
        keep |= {v.slot for v, src in zip(program.inputs, self.sources) if isinstance(src, Placement)}
        input_index = {v.slot: k for k, v in enumerate(program.inputs)}
        donated_inputs: dict[int, str] = {}
        for i, positions in self.donations:
            node = nodes[i]
            slots = [v.slot for v in node.inputs]
            ok = tuple(p for p in positions
                       if slots[p] not in keep and last_read[slots[p]] == i and slots.count(slots[p]) == 1)
            if ok:
                nodes[i] = replace(node, donate=ok)
                for p in ok:
                    if slots[p] in input_index:
                        donated_inputs[input_index[slots[p]]] = node.name
        self._renumber()
        return donated_inputs

    def _renumber(self) -> None:
        program = self.program
        order = [v.slot for v in program.inputs] + [v.slot for n in program.nodes for v in n.outputs]
        if order == list(range(len(order))):
            return
        new = {old: k for k, old in enumerate(order)}

        def r(v: Value) -> Value:
            return replace(v, slot=new[v.slot])

        program.inputs = [r(v) for v in program.inputs]
        program.outputs = [r(v) for v in program.outputs]
        program.nodes = [replace(n, source=r(n.source), target=r(n.target)) if isinstance(n, Transfer)
                         else replace(n, inputs=tuple(map(r, n.inputs)), outputs=tuple(map(r, n.outputs)))
                         for n in program.nodes]


def arg_path(path: tuple) -> str:
    """'x', 'scale', 'params['w']': an argument as the user wrote it, from its path in ((args), {kwargs})."""
    if not path:
        return "value"
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0 and rest:  # positional
        first, rest = f"{rest[0].idx}" if hasattr(rest[0], "idx") else str(rest[0]), rest[1:]
    elif rest:
        first, rest = str(getattr(rest[0], "key", rest[0])), rest[1:]
    else:
        first = ""
    return first + jax.tree_util.keystr(rest)


@dataclass
class Traced:
    """One traced signature of a program: its graph, the executables it calls, where each of its inputs comes
    from on a call, and what dispatch needs to make its outputs (lowered lazily, per placement)."""

    program: Program
    exes: dict[str, bytes]
    sources: list  # per program input: ("array", leaf index) or a Placement
    constants: list[HostData]
    donated: dict[int, str]  # program input index -> the function it is donated to
    out_meta: list[tuple[KeyInfo | None, bool]]  # per output: key info, weak_type
    lowered: Any = None
    made: list | None = None  # what each call's outputs are made of (``client.dispatch``), worked out once

    @functools.cached_property
    def runs_on(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        """{slice key: (the slice, the functions that run or land there)}: what a call needs alive."""
        out: dict[str, tuple[Any, tuple[str, ...]]] = {}
        for node in self.program.nodes:
            where = node.slice if isinstance(node, Compute) else node.target.slice
            name = node.name if isinstance(node, Compute) else "a transfer"
            names = out.get(where.key, (where, ()))[1]
            out[where.key] = (where, names if name in names else (*names, name))
        return out

    @functools.cached_property
    def calling(self) -> str:
        """What a call of it is, in an error that stops one (said once, not formatted per call)."""
        return f"calling {self.program.name!r}"

    @functools.cached_property
    def returned(self) -> set[int]:
        """Program inputs that are also outputs: a host value placed for one is never shared through the cache."""
        n = len(self.program.inputs)
        return {v.slot for v in self.program.outputs if v.slot < n}
