"""``pw.jit``: a JAX function compiled for a virtual slice, exported as StableHLO by the client.

The client exports against the slice's *abstract* mesh, so it needs no
devices; hosts compile the serialized bytes once per content hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from client import tracer
from client.slices import VirtualSlice
from pathways.errors import ProgramError
from pathways.sharding import check_spec

Aval = tuple[tuple[int, ...], np.dtype]


@dataclass(frozen=True)
class ExportedCall:
    """One export of a function for one slice shape and one input signature."""

    exe: str
    blob: bytes
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    out_avals: tuple[Aval, ...]
    out_tree: Any


def broadcast_specs(prefix: Any, tree: Any, what: str) -> list[P]:
    """One spec per leaf of ``tree``, from a pytree prefix of specs (None means replicated)."""
    out: list[P] = []

    def visit(spec: Any, sub: Any) -> None:
        if spec is not None and not isinstance(spec, P):
            raise ProgramError(f"{what}: expected a PartitionSpec or None, got {spec!r}")
        out.extend([spec if spec is not None else P()] * len(jax.tree_util.tree_leaves(sub)))

    try:
        jax.tree_util.tree_map(visit, prefix, tree, is_leaf=lambda x: isinstance(x, P) or x is None)
    except ValueError as exc:
        raise ProgramError(f"{what} {prefix!r} does not match the structure of the values: {exc}") from None
    return out


class CompiledFunction:
    """What ``pw.jit`` returns. Call it inside a ``@pw.program``, or alone (a one-node program)."""

    def __init__(self, fn: Callable, slice: VirtualSlice | None, in_specs: Any, out_specs: Any,  # noqa: A002
                 name: str | None = None, exports: dict | None = None) -> None:
        self.fn = fn
        self.slice = slice
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.name = name or getattr(fn, "__name__", "fn")
        self._exports: dict = {} if exports is None else exports
        self._single: Any = None

    def on(self, slice: VirtualSlice) -> CompiledFunction:  # noqa: A002
        """The same function bound to another slice; exports are shared between slices of one shape."""
        return CompiledFunction(self.fn, slice, self.in_specs, self.out_specs, self.name, self._exports)

    def export(self, slice: VirtualSlice, args: tuple, avals: list[Aval]) -> ExportedCall:  # noqa: A002
        in_tree = jax.tree_util.tree_structure(args)
        key = (slice.shape, slice.axis_names, in_tree, tuple(avals))
        hit = self._exports.get(key)
        if hit is not None:
            return hit
        prefix = self.in_specs
        if prefix is None or isinstance(prefix, P):
            prefix = (prefix,) * len(args)
        elif isinstance(prefix, list):
            prefix = tuple(prefix)
        if not isinstance(prefix, tuple) or len(prefix) != len(args):
            raise ProgramError(f"{self.name}: in_specs has {len(prefix) if isinstance(prefix, tuple) else 1} "
                               f"entries but the function was called with {len(args)} arguments")
        in_specs = broadcast_specs(prefix, args, f"{self.name}: in_specs")
        mesh = slice.abstract_mesh()
        for k, ((shape, _), spec) in enumerate(zip(avals, in_specs)):
            check_spec(spec, shape, slice.shape, slice.axis_names, f"{self.name}: argument {k}")
        in_sh = [NamedSharding(mesh, s) for s in in_specs]
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for (shape, dtype), sh in zip(avals, in_sh)]

        def unflat(*leaves: Any) -> Any:
            return self.fn(*jax.tree_util.tree_unflatten(in_tree, leaves))

        try:
            out_shape = jax.eval_shape(unflat, *structs)
        except Exception as exc:  # user code failing for these shapes is the user's error
            sig = ", ".join(f"{np.dtype(d).name}{list(s)}" for s, d in avals)
            raise ProgramError(f"{self.name} cannot run on arguments ({sig}): {type(exc).__name__}: {exc}") from None
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        out_specs = broadcast_specs(P() if self.out_specs is None else self.out_specs, out_shape,
                                    f"{self.name}: out_specs")
        for k, (leaf, spec) in enumerate(zip(out_leaves, out_specs)):
            check_spec(spec, leaf.shape, slice.shape, slice.axis_names, f"{self.name}: output {k}")
        out_sh = tuple(NamedSharding(mesh, s) for s in out_specs)

        def flat(*leaves: Any) -> tuple:
            return tuple(jax.tree_util.tree_leaves(unflat(*leaves)))

        try:
            exported = jax.export.export(jax.jit(flat, in_shardings=tuple(in_sh), out_shardings=out_sh))(*structs)
        except Exception as exc:  # sharding or lowering errors for this signature
            raise ProgramError(f"{self.name} cannot be exported for slice {slice.shape}: {exc}") from None
        blob = bytes(exported.serialize())
        result = ExportedCall(hashlib.sha256(blob).hexdigest(), blob, tuple(in_specs), tuple(out_specs),
                              tuple((tuple(o.shape), np.dtype(o.dtype)) for o in out_leaves), out_tree)
        self._exports[key] = result
        return result

    def __call__(self, *args: Any) -> Any:
        trace = tracer.current_trace()
        if trace is not None:
            return trace.call(self, args)
        if self._single is None:
            self._single = tracer.ProgramFunction(lambda *a: self(*a), name=self.name, op_by_op=True)
        return self._single(*args)

    def __repr__(self) -> str:
        where = f"slice {self.slice.key}" if self.slice is not None else "the slice of its first argument"
        return f"pw.jit({self.name} on {where})"


def jit(fn: Callable, slice: VirtualSlice | None = None, in_specs: Any = None,  # noqa: A002
        out_specs: Any = None, name: str | None = None) -> CompiledFunction:
    """Compile ``fn`` for ``slice`` (or, when None, for the slice of its first argument).

    ``in_specs`` has one PartitionSpec (or pytree prefix of them) per argument,
    ``out_specs`` is a prefix of the output tree; both default to replicated.
    """
    if slice is not None and not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.jit: slice must be a VirtualSlice from pw.slice(...), got {type(slice).__name__}")
    return CompiledFunction(fn, slice, in_specs, out_specs, name)
