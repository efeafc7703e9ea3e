"""``pw.jit``: a JAX function compiled for a virtual slice, exported as StableHLO by the client.

The client exports against the slice's *abstract* mesh, so it needs no
devices; hosts compile the serialized bytes once per content hash. The
arguments follow ``jax.jit``: static arguments (by position or name) are part
of the export cache key, keyword arguments are traced like positional ones,
and donated arguments are handed to XLA on the hosts.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from client import tracer
from client.aot import Lowered, lower
from client.host_values import KeyInfo, dtype_name, is_key_dtype, key_info, physical
from client.meshes import spec_leaves, tracing_on
from client.program import ProgramFunction
from client.slices import VirtualSlice
from pathways.errors import ProgramError
from pathways.sharding import check_spec, fits, norm_spec

Aval = tuple[tuple[int, ...], Any, bool]  # shape, dtype (numpy or key), weak_type

__all__ = ["Bound", "CompiledFunction", "ExportedCall", "Statics", "jit"]


@dataclass(frozen=True)
class ExportedCall:
    """One export of a function for one slice shape and one input signature.

    Specs and avals are of the buffers on the hosts: a key array is its uint32
    key data (trailing dims unsharded), and ``out_keys`` says which outputs
    turn back into keys.
    """

    exe: str
    blob: bytes
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    out_avals: tuple[tuple[tuple[int, ...], np.dtype], ...]
    out_keys: tuple[KeyInfo | None, ...]
    out_weak: tuple[bool, ...]
    out_tree: Any


def _index_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _str_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _infer(sig: inspect.Signature | None, nums: tuple[int, ...], names: tuple[str, ...],
           given_nums: bool, given_names: bool) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """jax.jit's rule: numbers given alone imply the names of those parameters, and names the numbers."""
    if sig is None or given_nums == given_names:
        return nums, names
    params = [(i, k) for i, (k, p) in enumerate(sig.parameters.items())
              if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if given_nums:
        return nums, tuple(k for i, k in params if i in nums)
    return tuple(i for i, k in params if k in names), names


_NO_STATICS: dict[int, Statics] = {}  # a call of n positional arguments, none static: one object per n


@dataclass(frozen=True, eq=False)
class Statics:
    """The static arguments of one call and where they go; hashable and equal by value (with types, as jax.jit
    compares them), so it keys the export cache and an op-by-op call's trace. It holds no dynamic argument."""

    n_positional: int
    static_pos: dict[int, Any]
    static_kw: dict[str, Any]
    key: tuple

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Statics) and self.key == other.key

    def rebuild(self, dyn_args: Iterable, dyn_kwargs: dict[str, Any]) -> tuple[list, dict]:
        """The full (args, kwargs) of a call, with these static values around the dynamic ones."""
        it = iter(dyn_args)
        args = [self.static_pos[i] if i in self.static_pos else next(it) for i in range(self.n_positional)]
        return args, {**dyn_kwargs, **self.static_kw}


@dataclass(frozen=True, eq=False)
class Bound:
    """One call's arguments split the way jax.jit splits them: static values, and the dynamic pytree
    ``(args, kwargs)`` whose leaves are traced, with the spec ``in_specs`` gives each leaf (None where it gives
    none: a pw.Array keeps its own, a host value is replicated) and a donate flag per leaf."""

    statics: Statics
    dyn_args: tuple
    dyn_kwargs: dict[str, Any]
    leaves: list
    in_tree: Any
    specs: list[P | None]
    donate: list[bool]


class CompiledFunction:
    """What ``pw.jit`` returns. Call it inside a ``@pw.program``, or alone (a one-node program).

    Called alone, its pw.Array arguments must live on its slice; numpy arrays,
    Python scalars and jax.Arrays are sent there (see ``pw.jit``).
    """

    def __init__(self, fn: Callable, slice: VirtualSlice | None, in_specs: Any, out_specs: Any,  # noqa: A002
                 name: str | None = None, exports: dict | None = None, *, static_argnums: Any = None,
                 static_argnames: Any = None, donate_argnums: Any = None, donate_argnames: Any = None) -> None:
        self.fn = fn
        self.slice = slice
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.name = name or getattr(fn, "__name__", "fn")
        self._exports: dict = {} if exports is None else exports
        self._single: Any = None
        self._options = {"static_argnums": static_argnums, "static_argnames": static_argnames,
                         "donate_argnums": donate_argnums, "donate_argnames": donate_argnames}
        try:  # jax.jit validates the options against the signature, with its own messages
            self._jax = jax.jit(fn, **self._options)
        except (ValueError, TypeError) as exc:
            raise ProgramError(f"pw.jit({self.name}): {exc}") from None
        try:
            self._sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none; jax.jit then skips the inference too
            self._sig = None
        self.static_argnums, self.static_argnames = _infer(
            self._sig, _index_tuple(static_argnums), _str_tuple(static_argnames),
            static_argnums is not None, static_argnames is not None)
        self.donate_argnums, self.donate_argnames = _infer(
            self._sig, _index_tuple(donate_argnums), _str_tuple(donate_argnames),
            donate_argnums is not None, donate_argnames is not None)
        self._positional = [k for k, p in (self._sig.parameters.items() if self._sig else ())
                            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if isinstance(in_specs, dict) and self._sig is not None:
            known = set(self._sig.parameters)
            takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in self._sig.parameters.values())
            unknown = [k for k in in_specs if k not in known]
            if unknown and not takes_kwargs:
                raise ProgramError(f"pw.jit({self.name}): in_specs names {unknown}, which are not parameters of "
                                   f"the function; its parameters are {list(known)}")

    def on(self, slice: VirtualSlice) -> CompiledFunction:  # noqa: A002
        """The same function bound to another slice; exports are shared between slices of one shape."""
        return CompiledFunction(self.fn, slice, self.in_specs, self.out_specs, self.name, self._exports,
                                **self._options)

    # -- arguments ----------------------------------------------------------------------------------
    def split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Statics, list[int], tuple, dict[str, Any]]:
        """(static values, positions of the dynamic positional arguments, those arguments, dynamic keyword
        arguments): the part of ``bind`` every op-by-op call needs."""
        n = len(args)
        if not kwargs and not self.static_argnums:  # the usual op-by-op call
            statics = _NO_STATICS.get(n)
            if statics is None:
                statics = _NO_STATICS[n] = Statics(n, {}, {}, (n, (), ()))
            return statics, list(range(n)), args, kwargs
        static_pos = {i % n: args[i] for i in self.static_argnums if -n <= i < n}  # negative: from the end
        static_kw = {k: v for k, v in kwargs.items() if k in self.static_argnames} if kwargs else {}
        if not static_pos and not static_kw:
            statics = _NO_STATICS.get(n)
            if statics is None:
                statics = _NO_STATICS[n] = Statics(n, {}, {}, (n, (), ()))
            return statics, list(range(n)), args, kwargs
        dyn_pos = [i for i in range(n) if i not in static_pos]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}
        key = (n, tuple((i, type(v), v) for i, v in sorted(static_pos.items())),
               tuple((k, type(v), v) for k, v in sorted(static_kw.items())))
        try:
            hash(key)
        except TypeError:
            self._raise_jax_static_error(args, kwargs)
        return Statics(n, static_pos, static_kw, key), dyn_pos, tuple(args[i] for i in dyn_pos), dyn_kwargs

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> Bound:
        """Split a call's arguments into static values and the dynamic pytree, as jax.jit does, with a spec and
        a donate flag for each dynamic leaf."""
        statics, dyn_pos, dyn_args, dyn_kwargs = self.split(args, kwargs)
        n = len(args)
        donate_nums = {i % n for i in self.donate_argnums if -n <= i < n}
        arg_specs, kw_specs = self._arg_specs(dyn_pos, dyn_kwargs, set(statics.static_pos))
        tree = (dyn_args, dyn_kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten(tree)
        specs = spec_leaves((tuple(arg_specs), kw_specs), tree, f"{self.name}: in_specs")
        donated = (tuple(i in donate_nums for i in dyn_pos),
                   {k: k in self.donate_argnames for k in dyn_kwargs})
        flags: list[bool] = []
        jax.tree_util.tree_map(lambda flag, sub: flags.extend([flag] * len(jax.tree_util.tree_leaves(sub))),
                               donated, tree)
        return Bound(statics, dyn_args, dyn_kwargs, leaves, in_tree, specs, flags)

    def _raise_jax_static_error(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """An unhashable static argument: raise the error jax.jit raises for the same call."""
        def placeholder(_: Any) -> Any:
            return jax.ShapeDtypeStruct((), np.float32)

        n = len(args)
        static_nums = {i % n for i in self.static_argnums if -n <= i < n}
        args = tuple(a if i in static_nums else placeholder(a) for i, a in enumerate(args))
        kwargs = {k: v if k in self.static_argnames else placeholder(v) for k, v in kwargs.items()}
        try:
            self._jax.trace(*args, **kwargs)
        except ValueError as exc:
            raise ProgramError(f"{self.name}: {exc}") from exc
        except Exception:  # jax failed on something else first: fall back to our own words
            pass
        raise ProgramError(f"{self.name}: Non-hashable static arguments are not supported; static_argnums "
                           f"{self.static_argnums} / static_argnames {self.static_argnames} must be hashable")

    def _arg_specs(self, dyn_pos: list[int], dyn_kwargs: dict[str, Any], static_nums: set[int]) -> tuple[list, dict]:
        """The spec prefix of each dynamic argument. ``in_specs`` is None or one PartitionSpec (every argument),
        a tuple/list (one entry per non-static positional argument, as jax.jit's in_shardings; a keyword
        argument naming such a parameter takes its entry), or a dict by parameter name; an argument it does not
        cover gets None (a pw.Array keeps its sharding, a host value is replicated)."""
        specs = self.in_specs
        if specs is None or isinstance(specs, (P, NamedSharding)):
            return [specs] * len(dyn_pos), {k: specs for k in dyn_kwargs}
        names = self._positional
        if isinstance(specs, dict):
            def by_name(i: int) -> Any:
                return specs.get(names[i]) if i < len(names) else None
            return [by_name(i) for i in dyn_pos], {k: specs.get(k) for k in dyn_kwargs}
        if not isinstance(specs, (tuple, list)):
            raise ProgramError(f"{self.name}: in_specs must be None, a PartitionSpec, a tuple with one entry per "
                               f"positional argument, or a dict by parameter name; got {type(specs).__name__}")
        if len(specs) < len(dyn_pos):
            raise ProgramError(f"{self.name}: in_specs has {len(specs)} entries but the function was called with "
                               f"{len(dyn_pos)} (non-static) positional arguments")
        dyn_names = [k for i, k in enumerate(names) if i not in static_nums and k not in self.static_argnames]
        takes_varargs = self._sig is not None and any(
            p.kind == inspect.Parameter.VAR_POSITIONAL for p in self._sig.parameters.values())
        if len(specs) > max(len(dyn_pos), len(dyn_names)) and not takes_varargs:
            raise ProgramError(f"{self.name}: in_specs has {len(specs)} entries but the function was called with "
                               f"{len(dyn_pos)} (non-static) positional arguments")
        kw = {k: specs[dyn_names.index(k)] if k in dyn_names and dyn_names.index(k) < len(specs) else None
              for k in dyn_kwargs}
        return list(specs[:len(dyn_pos)]), kw

    def out_prefix(self, bound: Bound, in_specs: list[P], out_shape: Any) -> Any:
        """The PartitionSpec prefix of this call's outputs (``out_specs``); None where it gives none. ``in_specs``
        are the arguments' specs (one per leaf), ``out_shape`` the outputs' ``jax.eval_shape``."""
        return self.out_specs

    def in_specs_of(self, slice: VirtualSlice, bound: Bound) -> list[P]:  # noqa: A002
        """Each argument leaf's spec on ``slice``: what ``in_specs`` gives it, else, as jax.jit does for committed
        arrays, the sharding a pw.Array (or a value of a program) has, where it fits the slice's mesh; else
        replicated."""
        out = []
        for spec, leaf in zip(bound.specs, bound.leaves):
            if spec is None:
                own = getattr(leaf, "spec", None) if getattr(leaf, "slice", None) is not None else None
                spec = own if own is not None and fits(own, leaf.shape, slice.shape, slice.axis_names) else P()
            out.append(spec)
        return out

    # -- export -------------------------------------------------------------------------------------
    def export(self, slice: VirtualSlice, bound: Bound, avals: list[Aval]) -> ExportedCall:  # noqa: A002
        """The StableHLO of this function for ``slice``'s mesh, these argument avals and the arguments' specs
        (cached). User code is traced with the slice's mesh as JAX's context mesh."""
        specs = self.in_specs_of(slice, bound)
        key = (slice.mesh_key, bound.in_tree, tuple(avals), bound.statics, tuple(map(norm_spec, specs)))
        hit = self._exports.get(key)
        if hit is not None:
            return hit
        with tracing_on(slice):
            result = self._export(slice, bound, avals, specs)
        self._exports[key] = result
        return result

    def _export(self, slice: VirtualSlice, bound: Bound, avals: list[Aval], specs: list[P]) -> ExportedCall:  # noqa: A002
        mesh = slice.abstract_mesh()
        statics, in_tree = bound.statics, bound.in_tree  # the closures below must not hold the arguments
        structs, keys = [], []
        for k, ((shape, dtype, weak), spec) in enumerate(zip(avals, specs)):
            check_spec(spec, shape, slice.shape, slice.axis_names, f"{self.name}: argument {k}")
            pshape, pdtype = physical(shape, dtype)
            keys.append(key_info(dtype) if is_key_dtype(dtype) else None)
            structs.append(jax.ShapeDtypeStruct(pshape, pdtype, sharding=NamedSharding(mesh, spec),
                                                weak_type=weak and keys[-1] is None))

        def unflat(*leaves: Any) -> Any:
            leaves = [k.wrap(x) if k is not None else x for k, x in zip(keys, leaves)]
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            args, kwargs = statics.rebuild(dyn_args, dyn_kwargs)
            return self.fn(*args, **kwargs)

        try:
            out_shape = jax.eval_shape(unflat, *structs)
        except Exception as exc:  # user code failing for these shapes is the user's error
            sig = ", ".join(f"{dtype_name(d)}{list(s)}" for s, d, _ in avals)
            raise ProgramError(f"{self.name} cannot run on arguments ({sig}): {type(exc).__name__}: {exc}") from None
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        given = spec_leaves(self.out_prefix(bound, specs, out_shape), out_shape, f"{self.name}: out_specs")
        out_specs = [typed_spec(leaf) if spec is None else spec for leaf, spec in zip(out_leaves, given)]
        for k, (leaf, spec) in enumerate(zip(out_leaves, out_specs)):
            check_spec(spec, leaf.shape, slice.shape, slice.axis_names, f"{self.name}: output {k}")
        out_keys = tuple(key_info(o.dtype) if is_key_dtype(o.dtype) else None for o in out_leaves)
        out_sh = tuple(NamedSharding(mesh, s) for s in out_specs)

        def flat(*leaves: Any) -> tuple:
            outs = jax.tree_util.tree_leaves(unflat(*leaves))
            return tuple(jax.random.key_data(o) if k is not None else o for k, o in zip(out_keys, outs))

        try:
            in_sh = tuple(s.sharding for s in structs)
            exported = jax.export.export(jax.jit(flat, in_shardings=in_sh, out_shardings=out_sh),
                                         platforms=(slice.platform,))(*structs)
        except Exception as exc:  # sharding or lowering errors for this signature
            raise ProgramError(f"{self.name} cannot be exported for slice {slice.shape}: {exc}") from None
        blob = bytes(exported.serialize())
        return ExportedCall(hashlib.sha256(blob).hexdigest(), blob, tuple(specs), tuple(out_specs),
                            tuple(physical(tuple(o.shape), o.dtype) for o in out_leaves), out_keys,
                            tuple(bool(getattr(o, "weak_type", False)) for o in out_leaves), out_tree)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = tracer.current_trace()
        if trace is not None:
            return trace.call(self, args, kwargs)
        statics, _, dyn_args, dyn_kwargs = self.split(args, kwargs)  # statics: one hashable value, in the trace key
        if self._single is None:
            def one(statics: Statics, *dyn_args: Any, **dyn_kwargs: Any) -> Any:
                full_args, full_kwargs = statics.rebuild(dyn_args, dyn_kwargs)
                return self(*full_args, **full_kwargs)

            self._single = ProgramFunction(one, name=self.name, op_by_op=True)
        return self._single(statics, *dyn_args, **dyn_kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Export for these arguments without running anything, as ``jax.jit(f).lower(*args)``.

        Arguments are what a call takes (pw.Arrays, host values, static values) or ``jax.ShapeDtypeStruct``
        s. The result has ``as_text()`` (the StableHLO the hosts compile) and ``compile()``, whose result
        runs like this function for arguments of the same signature and carries ``cost_analysis()`` and
        ``memory_analysis()`` (see ``client.aot``)."""
        return lower(self, args, kwargs)

    def __repr__(self) -> str:
        where = f"slice {self.slice.key}" if self.slice is not None else "the slice of its first argument"
        return f"pw.jit({self.name} on {where})"


def typed_spec(leaf: Any) -> P:
    """An output's spec where ``out_specs`` gives none: on Explicit mesh axes the sharding its type carries (as
    jax.jit's output), else replicated."""
    sharding = getattr(leaf, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


def jit(fn: Callable | None = None, slice: VirtualSlice | None = None, in_specs: Any = None,  # noqa: A002
        out_specs: Any = None, name: str | None = None, *, static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None) -> Any:
    """Compile ``fn`` for a virtual slice: the client exports it as StableHLO, the island's hosts run it.

    Works as ``pw.jit(fn, slice=s)``, ``@pw.jit``, ``@pw.jit(slice=s)`` and
    ``@functools.partial(pw.jit, slice=s, ...)``. The options follow ``jax.jit``.
    The function is exported once per slice shape, argument signature and static
    values, against the slice's abstract mesh, so the client needs no devices.

    Args:
        fn: a JAX-traceable function. Without it, ``pw.jit(...)`` returns a decorator.
        slice: the ``pw.VirtualSlice`` to run on; None: the slice of its first ``pw.Array`` argument.
            Pass it by keyword.
        in_specs: how each argument is sharded on the slice. None, or one PartitionSpec for every
            argument; a tuple with one entry (a PartitionSpec, or a pytree prefix of them) per non-static
            positional argument, like jax.jit's ``in_shardings``; or a dict by parameter name, which also
            covers keyword arguments. ``NamedSharding(s, spec)`` over the slice stands for ``spec``. What it
            does not cover (None) keeps its sharding, as jax.jit takes a committed array's: a pw.Array's
            spec (where it fits the slice's mesh), a host value replicated.
        out_specs: a PartitionSpec pytree prefix of the outputs. Where it gives none (None, the default), an
            output takes the sharding its type carries on Explicit mesh axes (as under jax.jit), else it is
            replicated.
        name: the name in graphs, traces and errors (default: ``fn.__name__``).
        static_argnums: positional arguments passed as Python values into the function; each
            distinct value (compared by hash and equality, with its type) is a separate export. They
            must be hashable.
        static_argnames: the same, by parameter name.
        donate_argnums: positional arguments whose buffers the call may reuse for its outputs. A
            donated pw.Array is gone after the call (using it raises ProgramError), so a training step
            holds one copy of the parameters instead of two. A host keeps a buffer that another
            pending op still reads (then the call runs without donating it).
        donate_argnames: the same, by parameter name.

    Returns:
        A ``pw.CompiledFunction``. Called alone it runs as a one-computation program and returns
        ``pw.Array`` futures at once; called inside a ``@pw.program`` it becomes a node of that graph.
        Its pw.Array arguments must live on its slice when called alone (``pw.transfer`` moves them);
        numpy arrays, Python and numpy scalars, jax.Arrays and typed PRNG keys are sent to the slice
        per ``in_specs`` (Python scalars weakly typed, as under jax.jit). Small values (64 KiB or less)
        already sent are recognised by content and jax.Arrays by identity, so a value passed again is
        not sent again.

    Raises:
        ProgramError: ``fn`` is not callable, ``slice`` is not a slice, or ``jax.jit`` refuses the
            options. Calls raise ProgramError when the arguments do not fit ``in_specs`` or the
            function cannot be exported for them.
    """
    options = {"static_argnums": static_argnums, "static_argnames": static_argnames,
               "donate_argnums": donate_argnums, "donate_argnames": donate_argnames}
    if fn is None:
        return lambda f: jit(f, slice, in_specs, out_specs, name, **options)
    if isinstance(fn, VirtualSlice):
        raise ProgramError("pw.jit: pass the slice by keyword, pw.jit(fn, slice=s) or @pw.jit(slice=s)")
    if not callable(fn):
        raise ProgramError(f"pw.jit needs a function, got {type(fn).__name__}")
    if slice is not None and not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.jit: slice must be a VirtualSlice from pw.slice(...), got {type(slice).__name__}")
    return CompiledFunction(fn, slice, in_specs, out_specs, name, **options)
