"""``pw.filter_jit``: ``equinox.filter_jit`` on a virtual slice.

Equinox models are pytrees whose leaves mix arrays with anything else (Python numbers, activation
functions, flags). ``eqx.filter_jit`` traces the arrays and holds everything else static, arguments and
results alike. ``pw.filter_jit`` does the same around ``pw.jit``: every leaf that is an array
(``jax.Array``, numpy array or scalar, ``pw.Array``) is traced; every other leaf becomes part of the
call's static signature (each distinct value exports anew, so it must be hashable), and non-array leaves
of the result come back as the values the function returned. Arrays of the result are ``pw.Array`` s on
the slice, so a model returned by a training step stays there for the next one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from client.array import Array
from client.jit import CompiledFunction
from client.slices import VirtualSlice
from pathways.errors import ProgramError

__all__ = ["FilteredFunction", "Static", "filter_jit", "is_array"]

DONATE = ("none", "all", "all-except-first")


def is_array(x: Any) -> bool:
    """What ``pw.filter_jit`` traces: ``eqx.is_array``'s arrays (jax, numpy) and ``pw.Array`` s."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Array))


@jax.tree_util.register_pytree_node_class
class Static:
    """A non-array leaf held static: no children, so its value is part of the pytree's structure (and so of
    the export's signature), compared by type and value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def tree_flatten(self) -> tuple[tuple[()], Static]:
        return (), self

    @classmethod
    def tree_unflatten(cls, static: Static, children: Any) -> Static:
        return static


def _hold(tree: Any) -> Any:
    return jax.tree.map(lambda x: x if is_array(x) else Static(x), tree)


def _release(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.value if isinstance(x, Static) else x, tree,
                        is_leaf=lambda x: isinstance(x, Static))


class FilteredFunction:
    """What ``pw.filter_jit`` returns: call it like the function. One ``pw.jit`` export per slice shape,
    array signature and static values, as ``eqx.filter_jit`` compiles once per the same."""

    def __init__(self, fn: Callable, slice: VirtualSlice | None, in_specs: Any, out_specs: Any,  # noqa: A002
                 donate: str) -> None:
        if donate not in DONATE:
            raise ProgramError(f"pw.filter_jit: donate must be one of {DONATE}, got {donate!r}")
        leaves = jax.tree.leaves(fn)
        if any(is_array(x) for x in leaves):
            raise ProgramError("pw.filter_jit: the function holds arrays (a module used as the function); "
                               "pass the module as an argument instead")
        self.fn = fn
        self.slice = slice
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.donate = donate
        self.name = getattr(fn, "__name__", "fn")
        self._exports: dict = {}
        self._by_arity: dict[tuple, CompiledFunction] = {}

        @functools.wraps(fn)  # keeps fn's signature, so in_specs by name refer to its parameters
        def pure(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _release((args, kwargs))
            return _hold(fn(*args, **kwargs))

        self._pure = pure
        functools.update_wrapper(self, fn)

    def _compiled(self, n_args: int, kwarg_names: tuple[str, ...]) -> CompiledFunction:
        """The pw.jit function for calls with this many positional arguments and these keywords (donation is
        by argument, so it depends on them)."""
        key = (n_args, kwarg_names)
        compiled = self._by_arity.get(key)
        if compiled is None:
            first = 1 if self.donate == "all-except-first" else 0
            nums = tuple(range(first, n_args)) if self.donate != "none" else None
            names = kwarg_names if self.donate != "none" and kwarg_names else None
            compiled = CompiledFunction(self._pure, self.slice, self.in_specs, self.out_specs, self.name,
                                        self._exports, donate_argnums=nums, donate_argnames=names)
            self._by_arity[key] = compiled
        return compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        held_args, held_kwargs = _hold((args, kwargs))
        try:
            for leaf in jax.tree.leaves((held_args, held_kwargs), is_leaf=lambda x: isinstance(x, Static)):
                if isinstance(leaf, Static):
                    hash(leaf)
        except TypeError as exc:
            raise ProgramError(f"{self.name}: a non-array argument is not hashable ({exc}); pw.filter_jit, as "
                               "eqx.filter_jit, holds non-array leaves static, so they must be hashable") from None
        out = self._compiled(len(args), tuple(sorted(kwargs)))(*held_args, **held_kwargs)
        return _release(out)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As a method (``@pw.filter_jit def __call__(self, x)``): the instance is the first argument."""
        return self if instance is None else functools.partial(self, instance)

    def __repr__(self) -> str:
        where = f"slice {self.slice.key}" if self.slice is not None else "the slice of its first argument"
        return f"pw.filter_jit({self.name} on {where})"


def filter_jit(fn: Callable | None = None, *, slice: VirtualSlice | None = None, in_specs: Any = None,  # noqa: A002
               out_specs: Any = None, donate: str = "none") -> Any:
    """``equinox.filter_jit`` on a virtual slice: arrays are traced, every other leaf is static.

    ``@eqx.filter_jit`` becomes ``@pw.filter_jit(slice=s)``. Arguments and results are any pytrees
    (Equinox modules, optax states, tuples): array leaves (``jax.Array``, numpy, ``pw.Array``) run on
    the slice, other leaves (Python numbers, functions, flags) are held static as ``eqx.filter_jit``
    holds them: the function sees them as they are, each distinct value exports anew, and non-array
    leaves of the result are returned as they were computed. Array results are ``pw.Array`` futures.

    Args:
        fn: the function; without it, ``pw.filter_jit(...)`` returns a decorator.
        slice: as for ``pw.jit`` (None: the slice of the first ``pw.Array`` argument).
        in_specs, out_specs: as for ``pw.jit``; a PartitionSpec for a module applies to all its arrays.
        donate: as ``eqx.filter_jit``: ``"none"`` (default), ``"all"`` (every array argument), or
            ``"all-except-first"``; a donated ``pw.Array`` is gone after the call.

    Returns:
        A ``FilteredFunction``.

    Raises:
        ProgramError: an unknown ``donate``, a function that holds arrays, or (at a call) a non-array
            argument that is not hashable; otherwise as ``pw.jit``.
    """
    if fn is None:
        return lambda f: filter_jit(f, slice=slice, in_specs=in_specs, out_specs=out_specs, donate=donate)
    if not callable(fn):
        raise ProgramError(f"pw.filter_jit needs a function, got {type(fn).__name__}")
    if slice is not None and not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.filter_jit: slice must be a VirtualSlice from pw.slice(...), got "
                           f"{type(slice).__name__}")
    return FilteredFunction(fn, slice, in_specs, out_specs, donate)
