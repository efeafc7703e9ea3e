"""``pw.nnx.jit``: ``flax.nnx.jit`` on a virtual slice (needs ``pip install 'pathways-ray[flax]'``).

Flax NNX modules, optimizers, metrics and ``nnx.Rngs`` are mutable Python objects. ``pw.nnx.jit`` does
what ``nnx.jit`` does around ``jax.jit``, around ``pw.jit`` instead, with NNX's own update context
(``nnx.update_context``): the graph nodes among the arguments are split into a graph definition
(static: it is part of the export's signature) and their state, the function runs on the slice on the
merged objects, and their new state is merged back into the caller's objects in place, shared
references, new attributes and returned modules included. After the first call the objects' arrays are
``pw.Array`` s resident on the slice: the next call takes them from there, and nothing travels but the
other arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
from flax import nnx
from flax.nnx.graph import is_graph_node
from jax.sharding import PartitionSpec as P

from client import tracer
from client.jit import Bound, CompiledFunction
from client.slices import VirtualSlice
from pathways.errors import ProgramError

__all__ = ["NodeFunction", "jit"]


@jax.tree_util.register_pytree_node_class
class NodeState:
    """A graph node as it crosses a ``pw.jit`` boundary: its graph definition (static, in the pytree's
    structure) and its state (the arrays)."""

    __slots__ = ("graphdef", "state")

    def __init__(self, graphdef: Any, state: Any) -> None:
        self.graphdef = graphdef
        self.state = state

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.state,), self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef: Any, children: Any) -> NodeState:
        return cls(graphdef, children[0])


def _is_state(x: Any) -> bool:
    return isinstance(x, NodeState)


def _split(ctx: Any, tree: Any) -> Any:
    return jax.tree.map(lambda x: NodeState(*ctx.split(x)) if is_graph_node(x) else x, tree, is_leaf=is_graph_node)


def _merge(ctx: Any, tree: Any) -> Any:
    return jax.tree.map(lambda x: ctx.merge(x.graphdef, x.state) if _is_state(x) else x, tree, is_leaf=_is_state)


class NodeFunction(CompiledFunction):
    """What ``pw.nnx.jit`` returns: a ``pw.jit`` function whose arguments and results may be NNX graph nodes.

    The compiled function sees ``(args, kwargs)`` with each graph node as a ``NodeState`` and returns
    ``(args_out, kwargs_out, out)``: the new state of every graph node it was given, then its result.
    """

    def __init__(self, fn: Callable, slice: VirtualSlice | None, in_specs: Any, out_specs: Any,  # noqa: A002
                 name: str | None, **options: Any) -> None:
        self.user_fn = fn

        @functools.wraps(fn)  # keeps fn's signature, so in_specs and static/donate names refer to its parameters
        def pure(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            with nnx.merge_context(self, inner=True) as ctx:
                args, kwargs = _merge(ctx, (args, kwargs))
            out = fn(*args, **kwargs)
            nodes = jax.tree.map(lambda x: x if is_graph_node(x) else None, (args, kwargs), is_leaf=is_graph_node)
            with nnx.split_context(self) as ctx:
                return _split(ctx, (*nodes, out))

        super().__init__(pure, slice, in_specs, out_specs, name or getattr(fn, "__name__", "fn"), **options)

    def out_prefix(self, bound: Bound, in_specs: list[P], out_shape: Any) -> Any:
        """Each graph node's new state keeps the specs its arrays had (``in_specs``, or a pw.Array's own), or, where
        the call changed the node's structure, its ``in_specs`` entry; the result takes ``out_specs``."""
        statics = bound.statics
        dyn_pos = [i for i in range(statics.n_positional) if i not in statics.static_pos]
        arg_specs, kw_specs = self._arg_specs(dyn_pos, bound.dyn_kwargs, set(statics.static_pos))
        leaf_args, leaf_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, in_specs)
        args_out, kwargs_out, _ = out_shape

        def keep(value: Any, given: Any, leaf_specs: Any, new_state: Any) -> Any:
            same = jax.tree_util.tree_structure(value) == jax.tree_util.tree_structure(new_state)
            return leaf_specs if same and _is_state(value) else given

        by_pos = {i: (bound.dyn_args[j], arg_specs[j], leaf_args[j]) for j, i in enumerate(dyn_pos)}
        return (tuple(keep(*by_pos[i], args_out[i]) if i in by_pos else None for i in range(statics.n_positional)),
                {k: keep(bound.dyn_kwargs[k], kw_specs.get(k), leaf_kwargs[k], kwargs_out[k])
                 if k in bound.dyn_kwargs else None for k in (*bound.dyn_kwargs, *statics.static_kw)},
                self.out_specs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracer.current_trace() is not None:  # the body of the one-call program: its arguments are split
            return super().__call__(*args, **kwargs)
        with nnx.update_context(self):
            with nnx.split_context(self) as ctx:
                args, kwargs = _split(ctx, (args, kwargs))
            out = super().__call__(*args, **kwargs)
            with nnx.merge_context(self, inner=False) as ctx:
                return _merge(ctx, out)[2]

    def on(self, slice: VirtualSlice) -> NodeFunction:  # noqa: A002
        """The same function bound to another slice."""
        return NodeFunction(self.user_fn, slice, self.in_specs, self.out_specs, self.name, **self._options)

    def __repr__(self) -> str:
        return "pw.nnx." + super().__repr__()[3:]


def jit(fn: Callable | None = None, *, slice: VirtualSlice | None = None, in_specs: Any = None,  # noqa: A002
        out_specs: Any = None, name: str | None = None, static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None, donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None) -> Any:
    """``flax.nnx.jit`` on a virtual slice: ``pw.jit`` whose arguments and results may be NNX graph nodes.

    ``@nnx.jit`` becomes ``@pw.nnx.jit(slice=s)``. Modules, optimizers, metrics, ``nnx.Rngs`` and
    ``nnx.Variable`` s passed in are updated in place, as ``nnx.jit`` does (BatchNorm statistics, RNG
    counts, optimizer steps, metric totals, attributes set inside); graph nodes returned are the
    caller's own objects where they were arguments. Their arrays become ``pw.Array`` s on the slice and
    stay there between calls. Reading one in the client (``metrics.compute()``, ``float(x)``) fetches it.

    Args:
        fn: the function; without it, ``pw.nnx.jit(...)`` returns a decorator.
        slice, in_specs, out_specs, name, static_argnums, static_argnames, donate_argnums, donate_argnames:
            as for ``pw.jit``. A graph node's ``in_specs`` entry (a PartitionSpec) applies to all of its
            state; without one, its arrays keep their shardings (pw.Arrays) or are replicated (new values). Its
            new state keeps the specs its arrays had. ``out_specs`` is for the result.

    Returns:
        A ``NodeFunction`` (a ``pw.CompiledFunction``).

    Raises:
        ProgramError: as ``pw.jit``.
    """
    options = {"static_argnums": static_argnums, "static_argnames": static_argnames,
               "donate_argnums": donate_argnums, "donate_argnames": donate_argnames}
    if fn is None:
        return lambda f: jit(f, slice=slice, in_specs=in_specs, out_specs=out_specs, name=name, **options)
    if not callable(fn):
        raise ProgramError(f"pw.nnx.jit needs a function, got {type(fn).__name__}")
    if slice is not None and not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.nnx.jit: slice must be a VirtualSlice from pw.slice(...), got {type(slice).__name__}")
    return NodeFunction(fn, slice, in_specs, out_specs, name, **options)
