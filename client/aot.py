"""Ahead-of-time lowering and compiling of a ``pw.jit`` function, as ``jax.jit(f).lower(*args).compile()``.

``f.lower(*args)`` exports the function for its slice and these arguments (the StableHLO the island's
hosts compile) without running anything. ``.compile()`` returns a ``Compiled`` that runs like ``f`` for
arguments of the same signature and reports XLA's cost and memory analysis where the client can obtain
real figures: for an island of CPU hosts, the client compiles the same module for the same mesh on its
own CPU devices (the hosts run the same XLA on the same kind of device, so the figures are theirs). Where
it cannot (an island of GPUs, or fewer CPU devices in the client than the slice has), the analyses are
None and ``Compiled.analysis_note`` says why; no figure is ever estimated.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from client.array import Array
from client.host_values import host_aval, is_host_value
from client.session import current
from client.slices import VirtualSlice
from pathways.errors import ProgramError

__all__ = ["Compiled", "Lowered", "lower"]


def _aval(leaf: Any, what: str) -> tuple[tuple[int, ...], Any, bool]:
    if isinstance(leaf, Array):
        return leaf.shape, leaf.dtype, leaf.weak_type
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return tuple(leaf.shape), leaf.dtype, bool(leaf.weak_type)
    if is_host_value(leaf):
        return host_aval(leaf)
    raise ProgramError(f"{what} is a {type(leaf).__name__}; lower takes pw.Arrays, host arrays, scalars or "
                       "jax.ShapeDtypeStruct s (mark other arguments static)")


def lower(fn: Any, args: tuple, kwargs: dict[str, Any]) -> Lowered:
    """``fn.lower(*args, **kwargs)`` for a ``pw.jit`` function ``fn`` (see ``CompiledFunction.lower``)."""
    bound = fn.bind(args, kwargs)
    arrays = [leaf for leaf in bound.leaves if isinstance(leaf, Array)]
    target = fn.slice or (arrays[0].slice if arrays else None)
    if target is None:
        raise ProgramError(f"{fn.name}.lower: the function has no slice and no pw.Array argument to take one "
                           "from; give pw.jit a slice (pw.jit(fn, slice=s))")
    avals = [_aval(leaf, f"{fn.name}.lower: argument {k}") for k, leaf in enumerate(bound.leaves)]
    return Lowered(fn, target, bound, avals)


class Lowered:
    """A ``pw.jit`` function exported for one slice and one argument signature, not yet compiled."""

    def __init__(self, fn: Any, slice: VirtualSlice, bound: Any, avals: list) -> None:  # noqa: A002
        self.fn = fn
        self.slice = slice
        self._bound = bound
        self._avals = avals
        self.exported = fn.export(slice, bound, avals)
        self._key = (slice.key, bound.in_tree, tuple(avals), bound.statics)

    @functools.cached_property
    def _module(self) -> Any:
        return jax.export.deserialize(bytearray(self.exported.blob))

    def as_text(self) -> str:
        """The StableHLO the island's hosts compile (text), as ``jax.stages.Lowered.as_text()``."""
        return self._module.mlir_module()

    @property
    def in_avals(self) -> list[tuple[tuple[int, ...], Any, bool]]:
        """(shape, dtype, weak_type) of each array argument, in the order of the flattened arguments."""
        return list(self._avals)

    def compile(self) -> Compiled:
        """A ``Compiled`` that runs like the ``pw.jit`` function for arguments of this signature."""
        return Compiled(self)

    def __repr__(self) -> str:
        return f"Lowered({self.fn.name} for slice {self.slice.key}, {len(self._avals)} array arguments)"


class Compiled:
    """What ``Lowered.compile()`` returns: callable like the ``pw.jit`` function, with XLA's analyses.

    ``cost_analysis()`` and ``memory_analysis()`` come from compiling the same StableHLO, for the same
    mesh, with the same XLA as the island's CPU hosts, on the client's own CPU devices. They are None
    where that is not the island's compiler (a GPU island) or the client has fewer CPU devices than the
    slice (start the client with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``); then
    ``analysis_note`` says so. The hosts compile the module themselves when it first runs.
    """

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self._local, self.analysis_note = _compile_locally(lowered)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lowered = self.lowered
        bound = lowered.fn.bind(args, kwargs)
        avals = [_aval(leaf, f"{lowered.fn.name}: argument {k}") for k, leaf in enumerate(bound.leaves)]
        arrays = [leaf for leaf in bound.leaves if isinstance(leaf, Array)]
        target = lowered.fn.slice or (arrays[0].slice if arrays else None)
        key = (getattr(target, "key", None), bound.in_tree, tuple(avals), bound.statics)
        if key != lowered._key:
            want = ", ".join(f"{s}{list(sh)}" for sh, s, _ in lowered._avals)
            got = ", ".join(f"{s}{list(sh)}" for sh, s, _ in avals)
            raise ProgramError(f"{lowered.fn.name}: compiled for arguments ({want}) on slice {lowered.slice.key}, "
                               f"called with ({got}) on {getattr(target, 'key', None)}; lower it again for these")
        return lowered.fn(*args, **kwargs)

    def cost_analysis(self) -> dict[str, float] | None:
        """XLA's cost analysis of the compiled module per device (flops, bytes accessed, ...), or None (see
        ``analysis_note``)."""
        if self._local is None:
            return None
        cost = self._local.cost_analysis()
        return cost[0] if isinstance(cost, list) else cost

    def memory_analysis(self) -> Any:
        """XLA's memory analysis per device (argument, output, temporary and generated code bytes), or None
        (see ``analysis_note``)."""
        return None if self._local is None else self._local.memory_analysis()

    def as_text(self) -> str:
        """The StableHLO, as ``Lowered.as_text()``."""
        return self.lowered.as_text()

    def __repr__(self) -> str:
        return f"Compiled({self.lowered.fn.name} for slice {self.lowered.slice.key}; {self.analysis_note})"


def _compile_locally(lowered: Lowered) -> tuple[Any, str]:
    """The module compiled on the client's CPU devices for the slice's mesh, when that is the compile the
    island's hosts do; otherwise (None, why not)."""
    slice_ = lowered.slice
    platform = current().topology.platform
    if platform != "cpu":
        return None, (f"no cost or memory analysis: island {slice_.island} compiles for {platform}, and the "
                      "client can compile only for CPU")
    devices = jax.devices("cpu")
    if len(devices) < slice_.size:
        return None, (f"no cost or memory analysis: the slice has {slice_.size} devices and the client "
                      f"{len(devices)} CPU device(s); start the client with "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={slice_.size} to get them")
    exported = lowered._module
    mesh = Mesh(np.array(devices[:slice_.size]).reshape(slice_.shape), slice_.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(slice_.shape))
    in_sh = tuple(NamedSharding(mesh, s) for s in lowered.exported.in_specs)
    out_sh = tuple(NamedSharding(mesh, s) for s in lowered.exported.out_specs)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exported.in_avals, in_sh)]
    donate = tuple(k for k, (flag, leaf) in enumerate(zip(lowered._bound.donate, lowered._bound.leaves))
                   if flag and isinstance(leaf, Array))
    with warnings.catch_warnings():  # as on the hosts: a donated input no output can reuse is not reused
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = jax.jit(exported.call, in_shardings=in_sh, out_shardings=out_sh,
                           donate_argnums=donate).lower(*structs).compile()
    return compiled, (f"analyses from XLA:CPU compiling this module for a {'x'.join(map(str, slice_.shape))} "
                      "mesh in the client, as the island's CPU hosts do")
