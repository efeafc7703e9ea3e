"""``@pw.program`` and ``pw.transfer``: a Python block traced once per signature, then dispatched per call.

``ProgramFunction`` traces its body with ``client.tracer`` (one ``Traced`` per
input signature, cached) and hands each call to ``client.dispatch``, which
sends one message per island. A ``pw.jit`` function called alone runs as a
one-node program of this kind.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array, check_usable
from client.dispatch import dispatch
from client.host_values import PYTHON_SCALARS, host_aval, is_host_value, is_key_dtype, key_info
from client.meshes import placement
from client.session import current
from client.slices import VirtualSlice
from client.tracer import (
    HostValue,
    InTrace,
    Trace,
    Traced,
    TracedValue,
    arg_path,
    current_trace,
    enter,
    user_line,
    user_stacklevel,
)
from pathways.errors import ProgramError
from pathways.graph import Program
from pathways.sharding import check_spec, norm_spec

_recent: dict[str, Program] = {}  # each program name's latest graph, for `pathways graph` after a script ran
TRACE_CACHE_SIZE = 64  # traced signatures a program keeps; the least recently used goes first
SCALAR_RETRACES = 3  # distinct values of one Python-scalar argument that make a program warn (once)


def recent_graph(name: str) -> Program | None:
    """The graph a program called ``name`` traced most recently in this process, if any."""
    return _recent.get(name)


class ProgramFunction:
    """What ``@pw.program`` returns: traces once per signature, then dispatches on every call.

    Arguments: pytrees of pw.Arrays; numpy arrays, numpy scalars and jax.Arrays (sent to the slice of
    each pw.jit function that takes them, per its in_specs, on every call; small ones are cached by
    content); and other hashable values, which are static: the body sees them as they are, so Python
    control flow may depend on them, and each distinct value traces the program anew. Python scalars
    are static in a program (a program warns once when one argument took ``SCALAR_RETRACES`` values:
    pass ``np.float32(x)`` to send it as a value instead); a pw.jit function called alone takes them as
    (weakly typed) arrays. The last ``TRACE_CACHE_SIZE`` (64) traced signatures are kept, least recently
    used first out.
    """

    def __init__(self, fn: Callable, name: str | None = None, op_by_op: bool = False) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "program")
        self.op_by_op = op_by_op
        self._cache: OrderedDict[Any, Traced] = OrderedDict()
        self._by_token: dict[tuple, Traced] = {}  # op-by-op calls of pw.Arrays: (statics, argument tokens) -> trace
        self._last: Traced | None = None
        self._scalars: dict[int, set] = {}  # leaf position -> Python-scalar values traced there (a few)
        self._warned = False

    def _signature(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list, Any, Any]:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        sig: list = []
        first: dict[int, int] = {}
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Array):
                check_usable(leaf, f"{self.name} got")
                sig.append(("array", leaf.shape, leaf.dtype, leaf.weak_type, leaf.slice.key,
                            norm_spec(leaf.spec), first.setdefault(leaf.id, k)))
            elif is_host_value(leaf) and (self.op_by_op or type(leaf) not in PYTHON_SCALARS):
                sig.append(("host", *host_aval(leaf)))
            elif isinstance(leaf, InTrace):
                raise ProgramError(f"{self.name} got a value of a program being traced; call it inside that "
                                   "program's body, where it is inlined")
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise ProgramError(f"{self.name}: argument {leaf!r} is neither an array nor a hashable "
                                       "static value") from None
                sig.append(("static", type(leaf), leaf))
        return leaves, treedef, (treedef, tuple(sig))

    def _trace(self, leaves: list, treedef: Any) -> Traced:
        trace = Trace(self.name, self.op_by_op)
        traced_args: list = []
        by_id: dict[int, TracedValue] = {}
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Array):
                tv = by_id.get(leaf.id)
                if tv is None:  # the same pw.Array passed twice is one input
                    shape, dtype = leaf.physical
                    value = trace.add_input(shape, dtype, leaf.slice, leaf.spec, ("array", k))
                    tv = by_id[leaf.id] = TracedValue(value, trace, leaf._key, leaf.weak_type)
                traced_args.append(tv)
            elif is_host_value(leaf) and (self.op_by_op or type(leaf) not in PYTHON_SCALARS):
                traced_args.append(HostValue(("arg", k), host_aval(leaf), trace))
            else:
                traced_args.append(leaf)
        with enter(trace):
            args, kwargs = jax.tree_util.tree_unflatten(treedef, traced_args)
            out = self.fn(*args, **kwargs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        for leaf in out_leaves:
            if not (isinstance(leaf, TracedValue) and leaf.trace is trace):
                what = "a host value it was given" if isinstance(leaf, HostValue) else type(leaf).__name__
                raise ProgramError(f"@pw.program {self.name} returned {what}; a program returns values computed "
                                   "by pw.jit functions (or its own pw.Array arguments)")
        trace.program.outputs = [leaf.value for leaf in out_leaves]
        trace.program.out_tree = out_tree
        donated = trace.finish()
        return Traced(trace.program, trace.exes, trace.sources, trace.constants, donated,
                      [(leaf.key, leaf.weak_type) for leaf in out_leaves])

    def _traced(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Traced, list]:
        tokens = self._tokens(args) if self.op_by_op and not kwargs else None
        if tokens is not None:
            traced = self._by_token.get(tokens)
            if traced is not None:
                return traced, list(args)  # an op-by-op call's leaves: its statics, then its arrays
        leaves, treedef, key = self._signature(args, kwargs)
        traced = self._cache.get(key)
        if traced is None:
            self._count_scalars(leaves, args, kwargs)
            start = time.time()
            traced = self._trace(leaves, treedef)
            self._cache[key] = traced
            if len(self._cache) > TRACE_CACHE_SIZE:
                self._cache.popitem(last=False)
            self._last = traced
            _recent[self.name] = traced.program
            current().events.span(f"trace {self.name}", "trace", start, time.time(),
                                  nodes=len(traced.program.nodes))
        else:
            self._cache.move_to_end(key)
        if tokens is not None:
            if len(self._by_token) >= TRACE_CACHE_SIZE:
                self._by_token.clear()
            self._by_token[tokens] = traced
        return traced, leaves

    def _tokens(self, args: tuple) -> tuple | None:
        """An op-by-op call's trace key when its arguments (after the statics) are distinct, usable pw.Arrays: the
        statics and each array's ``signature`` token, found without flattening anything. None otherwise."""
        tokens = [args[0]]
        for arg in args[1:]:
            if type(arg) is not Array or not arg.usable():
                return None  # host values, or an array check_usable must explain: the general path
            tokens.append(arg.signature)
        if len(args) > 2 and len({a.id for a in args[1:]}) != len(args) - 1:
            return None  # the same array twice is one input of the trace
        return tuple(tokens)

    def _count_scalars(self, leaves: list, args: tuple, kwargs: dict[str, Any]) -> None:
        """Before a new trace: warn (once) if a Python-scalar argument keeps changing, which retraces the
        program on every call."""
        if self.op_by_op or self._warned:
            return
        for k, leaf in enumerate(leaves):
            if type(leaf) not in (int, float, complex):  # a bool has two values: a flag, not a changing number
                continue
            seen = self._scalars.setdefault(k, set())
            seen.add(leaf)
            if len(seen) >= SCALAR_RETRACES:
                self._warned = True
                path = self._argument(jax.tree_util.tree_flatten_with_path((args, kwargs))[0][k][0])
                kind = type(leaf).__name__
                warnings.warn(
                    f"@pw.program {self.name} was traced again for each new value of its Python {kind} argument "
                    f"{path} ({', '.join(map(repr, sorted(seen, key=repr)))}): Python scalars are static in a "
                    f"program, so each new value traces and lowers the whole program again. Pass it as a value "
                    f"instead, e.g. np.{'float32' if kind != 'int' else 'int32'}({path}), which is sent with each "
                    "call and traced once; keep a Python scalar only where the body's Python control flow "
                    "depends on it", UserWarning, stacklevel=user_stacklevel())
                return

    def _argument(self, path: tuple) -> str:
        """An argument as the user named it: 'lr', 'opts['lr']' (a positional one by its parameter's name)."""
        text = arg_path(path)
        index, rest = text[:len(text) - len(text.lstrip("0123456789"))], text.lstrip("0123456789")
        if index:
            try:
                names = [k for k, p in inspect.signature(self.fn).parameters.items()
                         if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            except (TypeError, ValueError):
                names = []
            if int(index) < len(names):
                return names[int(index)] + rest
        return text

    def _check_slices(self, traced: Traced) -> None:
        """Refuse a call that would run on a released slice, naming the slice and what runs there."""
        for key, (where, names) in traced.runs_on.items():
            if where.released:
                head = (f"{self.name} runs" if self.op_by_op
                        else f"@pw.program {self.name} runs {', '.join(names)}")
                raise ProgramError(
                    f"{head} on slice {key} (island {where.island}), which was released: nothing runs on a "
                    "released slice (arrays made there stay fetchable until dropped). Allocate a new slice and "
                    "create the function on it: pw.jit(fn, slice=pw.slice(...)), or f.on(new_slice)")

    @property
    def last_graph(self) -> Program | None:
        """The graph this function traced most recently, if it ever ran."""
        return None if self._last is None else self._last.program

    def graph(self, *args: Any, **kwargs: Any) -> Program:
        """The Program this function traces to for these arguments (traced once, then cached).

        With no arguments: the most recently traced graph.
        """
        if not args and not kwargs and self._last is not None:
            return self._last.program
        return self._traced(args, kwargs)[0].program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if current_trace() is not None:
            return self.fn(*args, **kwargs)  # a program called from a program is inlined into the outer graph
        traced, leaves = self._traced(args, kwargs)
        self._check_slices(traced)
        return dispatch(traced, leaves)


_moves: dict[tuple, ProgramFunction] = {}  # the one-program transfers of each destination and specs, as used
MAX_MOVES = 256  # programs kept in _moves; past that it starts anew (each holds its slice)


def _move_program(key: tuple, body: Callable) -> ProgramFunction:
    fn = _moves.get(key)
    if fn is None:
        if len(_moves) >= MAX_MOVES:
            _moves.clear()
        fn = _moves[key] = ProgramFunction(body, name="transfer")
    return fn


def transfer_each(values: list, slice: VirtualSlice, specs: list[P]) -> list:  # noqa: A002
    """pw.Arrays moved to ``slice``, each resharded as its own spec, in one program (one dispatch)."""
    specs = list(specs)
    key = ("each", slice.key, tuple(norm_spec(s) for s in specs))
    fn = _move_program(key, lambda vs: [transfer(v, slice, s) for v, s in zip(vs, specs)])
    return fn(list(values))


def transfer(value: Any, slice: Any, spec: P | None = None) -> Any:  # noqa: A002
    """Move ``value`` (a pw.Array, or a pytree of them) to ``slice``, resharded as ``spec`` (default: its own).

    Inside a program the transfer joins the graph here: the send still leaves
    right after the value is produced (sends never wait), and the receiving
    island takes the value at this point in its order. Outside a program it
    runs as a one-transfer program. A host value (numpy, jax.Array) is sent
    to the slice like ``pw.put`` (default spec: replicated). Each destination
    host receives only the source shards that overlap what its devices hold.

    Args:
        value: a ``pw.Array`` or a pytree of them (inside a program: its values, or host arrays).
        slice: the destination ``pw.VirtualSlice``, on the same or another island, or ``NamedSharding(s,
            spec)`` over one (its spec then stands for ``spec``).
        spec: the PartitionSpec on ``slice`` (default: the value's own spec).

    Returns:
        ``value``'s pytree with each leaf on ``slice`` (``pw.Array`` futures; traced values in a program).

    Raises:
        ProgramError: ``slice`` is not a live slice, ``spec`` is not a PartitionSpec, or it does not fit
            ``slice`` (unknown axis, or it does not divide a leaf's shape).
    """
    slice, spec = placement(slice, spec, "pw.transfer")  # noqa: A001
    if not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.transfer needs a VirtualSlice from pw.slice(...) to move to, got "
                           f"{type(slice).__name__}")
    if slice.released:
        raise ProgramError(f"pw.transfer: {slice} was released; allocate a new slice")
    if spec is not None and not isinstance(spec, P):
        raise ProgramError(f"pw.transfer: spec must be a jax.sharding.PartitionSpec (or None to keep the value's "
                           f"own), got {spec!r}")
    trace = current_trace()
    if trace is None:
        leaves = jax.tree_util.tree_leaves(value)
        for leaf in leaves:
            target_spec = spec if spec is not None else getattr(leaf, "spec", None) or P()
            shape = leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)
            check_spec(target_spec, tuple(shape), slice.shape, slice.axis_names, "pw.transfer")
        # the spec's length too: P("x") and P("x", None) shard alike but fit different ranks, and the body keeps it
        key = (slice.key, None if spec is None else (norm_spec(spec), len(spec)), len(leaves))
        return _move_program(key, lambda v: transfer(v, slice, spec))(value)

    def move(leaf: Any) -> TracedValue:
        if isinstance(leaf, Array) or not (isinstance(leaf, InTrace) or is_host_value(leaf)):
            raise ProgramError(f"pw.transfer inside a program takes its values, got {type(leaf).__name__} "
                               f"at {user_line()}")
        leaf = trace.operand(leaf, "pw.transfer", "value")
        target_spec = (leaf.spec if isinstance(leaf, TracedValue) else P()) if spec is None else spec
        check_spec(target_spec, leaf.shape, slice.shape, slice.axis_names, f"pw.transfer at {user_line()}")
        if isinstance(leaf, HostValue):
            key = key_info(leaf.dtype) if is_key_dtype(leaf.dtype) else None
            return TracedValue(trace.place(leaf, slice, target_spec), trace, key, leaf.weak_type)
        if leaf.slice is slice and norm_spec(leaf.spec) == norm_spec(target_spec):
            return leaf
        return TracedValue(trace.move(leaf.value, slice, target_spec), trace, leaf.key, leaf.weak_type)

    return jax.tree_util.tree_map(move, value)


def program(fn: Callable) -> ProgramFunction:
    """Decorate a function that calls pw.jit functions: each call runs it as one dataflow program.

    The body is traced once per argument signature into a graph of computations and transfers, lowered
    to one fragment per island, and every call sends one message per island without waiting; the call
    returns ``pw.Array`` futures at once. Inside the body, values are futures: reading their contents
    raises ProgramError naming the line. A value used on another slice is transferred where it is used
    (or where ``pw.transfer`` says). A program called from a program is inlined.

    A pw.jit function inside that donates an argument (``donate_argnums``) donates it only where that
    is safe within the program; a donated pw.Array argument of the program is gone once the program is
    dispatched.

    Args:
        fn: the body. Its arguments are pytrees of pw.Arrays, host arrays (numpy, jax.Array; sent on
            every call, small ones cached by content) and hashable static values (Python scalars
            included), which the body sees as they are; each distinct static value traces anew (see
            ``ProgramFunction``). It returns a pytree of values computed by pw.jit functions (or of its
            own pw.Array arguments).

    Returns:
        A ``ProgramFunction``: call it like ``fn``; ``.graph(*args)`` returns the traced ``pw.Program``.
    """
    return ProgramFunction(fn)
