"""A virtual slice where JAX takes a mesh: ``jax.set_mesh(s)``, ``NamedSharding(s, spec)`` and ``jax.device_put``
in the client, and the slice's mesh as JAX's context mesh while user code is traced for it.

JAX's own ``jax.set_mesh`` and ``jax.device_put`` know only meshes of this process's devices. Loading the client
puts two functions in their place (in ``jax`` and ``jax.sharding``) that do for a slice what JAX's do for a mesh,
and hand every other call to JAX's own, unchanged:

- ``jax.set_mesh(s)`` (a setter, or ``with jax.set_mesh(s):``) makes ``s`` this thread's current slice, so a bare
  ``PartitionSpec`` given to ``jax.device_put`` means that spec on ``s``, as a bare spec means it on the mesh
  ``jax.set_mesh`` set. JAX's own context mesh is unset meanwhile: the client computes locally without one.
- ``jax.device_put(x, NamedSharding(s, spec))`` (or a spec under ``jax.set_mesh(s)``, or a pytree prefix of
  either) places ``x`` on ``s``: host values are sent there (``pw.put``); a ``pw.Array`` on another slice or with
  another spec is transferred (``pw.transfer``), one already there with that spec is returned as it is. A bare
  spec for a ``pw.Array`` with no slice set means that spec on the array's own slice. Without a destination a
  ``pw.Array`` is returned as it is (it lives on devices already, as ``jax.device_put(x)`` returns a committed
  ``jax.Array``). Inside a ``@pw.program`` the placement joins the program's graph.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways.errors import ProgramError

if TYPE_CHECKING:  # for annotations only: client.slices imports this module (and installs it)
    from client.slices import VirtualSlice

_current: contextvars.ContextVar[VirtualSlice | None] = contextvars.ContextVar("pathways_current_slice",
                                                                               default=None)
_JAX_SET_MESH = jax.set_mesh
_JAX_DEVICE_PUT = jax.device_put


def current_slice() -> VirtualSlice | None:
    """The slice ``jax.set_mesh(s)`` made current in this thread, if any."""
    return _current.get()


@contextlib.contextmanager
def tracing_on(slice: VirtualSlice) -> Iterator[None]:  # noqa: A002
    """The slice's mesh as JAX's context mesh while user code is traced for it, as under ``jax.set_mesh``:
    ``jax.shard_map`` without ``mesh=``, ``jax.sharding.get_abstract_mesh()`` and ``jax.sharding.reshard`` see
    it. A mesh the client set for its own devices is out of context meanwhile."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_JAX_SET_MESH(None))
        except ValueError:  # inside a JAX transformation, where jax.set_mesh refuses: the abstract mesh is what counts
            pass
        stack.enter_context(jax.sharding.use_abstract_mesh(slice.abstract_mesh()))
        yield


def is_slice(value: Any) -> bool:
    """Whether ``value`` is a ``pw.VirtualSlice``."""
    from client.slices import VirtualSlice

    return isinstance(value, VirtualSlice)


def slice_of(sharding: Any) -> VirtualSlice | None:
    """The slice of a ``NamedSharding(s, spec)`` over a virtual slice (None for anything else)."""
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    return mesh if is_slice(mesh) else None


def spec_leaves(prefix: Any, tree: Any, what: str) -> list[P | None]:
    """One spec per leaf of ``tree`` from a pytree prefix of PartitionSpecs (a ``NamedSharding`` over a slice
    gives its spec); None where the prefix has None (no spec given)."""
    out: list[P | None] = []

    def visit(spec: Any, sub: Any) -> None:
        if slice_of(spec) is not None:
            spec = spec.spec
        if spec is not None and not isinstance(spec, P):
            raise ProgramError(f"{what}: expected a PartitionSpec, a NamedSharding over a pw.slice, or None; got "
                               f"{spec!r}")
        out.extend([spec] * len(jax.tree_util.tree_leaves(sub)))

    try:
        jax.tree_util.tree_map(visit, prefix, tree, is_leaf=lambda x: x is None or isinstance(x, (P, NamedSharding)))
    except ValueError as exc:
        raise ProgramError(f"{what} {prefix!r} does not match the structure of the values: {exc}") from None
    return out


def placement(target: Any, specs: Any, what: str) -> tuple[Any, Any]:
    """(slice, specs) of a ``pw.put``/``pw.transfer`` whose destination is a slice, or a ``NamedSharding`` over
    one (its spec then stands for ``specs``, which must be None)."""
    owner = slice_of(target)
    if owner is None:
        return target, specs
    if specs is not None:
        raise ProgramError(f"{what}: the destination NamedSharding gives the spec ({target.spec}); pass no other")
    return owner, target.spec


class set_mesh:  # noqa: N801 - it stands for jax.set_mesh
    """``jax.set_mesh`` that also takes a ``pw.VirtualSlice`` (see the module's docstring); every mesh of this
    process's devices goes to JAX's own, and unsets a current slice."""

    __slots__ = ("_jax", "_token")

    def __init__(self, mesh: Any) -> None:
        ours = is_slice(mesh)
        self._jax = _JAX_SET_MESH(None if ours else mesh)
        self._token = _current.set(mesh if ours else None)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        _current.reset(self._token)
        self._jax.__exit__(*exc)


_DESTINATION = (P, NamedSharding, type(None))


def _placement(dest: Any, leaves: list) -> tuple[VirtualSlice | None, P | None] | None:
    """Where ``jax.device_put`` of these leaves to ``dest`` goes: (slice, spec); (None, spec) for each pw.Array on
    its own slice (a bare spec, or none); None when it is JAX's own (host values for this process's devices, or
    pw.Arrays fetched to them)."""
    from client.array import Array
    from client.tracer import TracedValue

    target = slice_of(dest)
    if target is not None:
        return target, dest.spec
    current = current_slice()
    if isinstance(dest, P) and current is not None:
        return current, dest
    on_slices = bool(leaves) and all(isinstance(x, (Array, TracedValue)) for x in leaves)
    return (None, dest) if on_slices and (dest is None or isinstance(dest, P)) else None


def _place(tree: Any, target: VirtualSlice | None, spec: P | None) -> Any:
    from client.array import put
    from client.program import transfer
    from client.tracer import current_trace

    if target is None:  # pw.Arrays, each on its own slice (as they are, without a spec)
        return tree if spec is None else jax.tree_util.tree_map(lambda x: _place(x, x.slice, spec), tree)
    if current_trace() is not None:
        return transfer(tree, target, spec if spec is not None else P())
    return put(tree, target, spec)


def device_put(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``jax.device_put`` that also places values on virtual slices (see ``client.meshes``); other calls, and
    the parts of a call that are not for a slice, go to JAX's own with the same options. On a slice ``src``,
    ``donate`` and ``may_alias`` do not apply: a value already there with the spec asked for is returned as it
    is, any other is copied."""
    if isinstance(device, NamedSharding) and slice_of(device) is None or \
            not isinstance(device, (*_DESTINATION, list, tuple, dict)):  # a local sharding or device: JAX's own
        return _JAX_DEVICE_PUT(x, device, *args, **kwargs)

    def is_dest(d: Any) -> bool:
        return isinstance(d, _DESTINATION)

    def is_pair(p: Any) -> bool:
        return type(p) is _Pair

    try:
        pairs = _Pair(device, x) if is_dest(device) else \
            jax.tree_util.tree_map(_Pair, device, x, is_leaf=is_dest)
    except (ValueError, TypeError):  # not a prefix of x, or not a destination: JAX's own error
        return _JAX_DEVICE_PUT(x, device, *args, **kwargs)
    flat, treedef = jax.tree_util.tree_flatten(pairs, is_leaf=is_pair)
    where = [_placement(p.dest, jax.tree_util.tree_leaves(p.tree)) if is_dest(p.dest) else None for p in flat]
    if all(w is None for w in where):
        return _JAX_DEVICE_PUT(x, device, *args, **kwargs)
    out = [_place(p.tree, *w) if w is not None else _JAX_DEVICE_PUT(p.tree, p.dest, *args, **kwargs)
           for p, w in zip(flat, where)]
    return jax.tree_util.tree_unflatten(treedef, out)


class _Pair:
    """A destination of ``jax.device_put`` with the subtree it is for (a leaf of the destinations' pytree)."""

    __slots__ = ("dest", "tree")

    def __init__(self, dest: Any, tree: Any) -> None:
        self.dest = dest
        self.tree = tree


def install() -> None:
    """Put ``set_mesh`` and ``device_put`` in the place of JAX's (idempotent)."""
    for module in (jax, jax.sharding):
        if getattr(module, "set_mesh", None) is _JAX_SET_MESH:
            module.set_mesh = set_mesh
    if jax.device_put is _JAX_DEVICE_PUT:
        jax.device_put = device_put
