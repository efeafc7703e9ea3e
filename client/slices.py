"""Virtual slices: a mesh shape with axis names and types, placed by the resource manager on one island."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, AxisType

from client import meshes
from client.session import Session, current
from pathways.errors import ResourceError
from pathways.ops import SliceDesc
from pathways.requests import Allocate, Release


class VirtualSlice:
    """Where computations run: ``shape`` over ``axis_names``, mapped one-to-one onto devices of ``island``.

    It is the mesh of what runs on it: ``axis_types`` are its axes' JAX types (Auto, or Explicit as
    ``jax.make_mesh`` makes them), and ``NamedSharding(s, P(...))`` names a sharding on it wherever pathways or
    ``jax.device_put`` take one (``client.meshes``). Usable as a context manager: leaving the block releases it.
    """

    _internal_device_list = None  # what NamedSharding reads of a mesh without devices (as of an AbstractMesh)

    def __init__(self, session: Session, wire: dict, axis_types: tuple[AxisType, ...] | None = None,
                 platform: str = "cpu") -> None:
        self._session = session
        self.platform = platform  # JAX's name for the island's platform ('cpu', 'cuda'): what code is exported for
        self.key: str = wire["key"]
        self.shape: tuple[int, ...] = tuple(wire["shape"])
        self.axis_names: tuple[str, ...] = tuple(wire["axes"])
        self.island: int = wire["island"]
        self.devices: tuple[tuple[int, int], ...] = tuple((h, d) for h, d in wire["devices"])
        self.tenant: str = wire["tenant"]
        self.axis_types: tuple[AxisType, ...] = axis_types or (AxisType.Auto,) * len(self.shape)
        self.released = False
        self._mesh = AbstractMesh(self.shape, self.axis_names, axis_types=self.axis_types)

    @property
    def size(self) -> int:
        """Number of devices in the slice."""
        return math.prod(self.shape)

    @property
    def hosts(self) -> tuple[int, ...]:
        """The island's hosts this slice spans, in order."""
        return tuple(sorted({h for h, _ in self.devices}))

    def desc(self) -> SliceDesc:
        """The slice as islands see it: key, mesh, and (host, local device) per mesh device."""
        return SliceDesc(self.key, self.shape, self.axis_names, self.devices)

    @property
    def mesh_key(self) -> tuple:
        """What an export for this slice depends on: its mesh's shape, axis names and axis types, and the
        platform its island runs."""
        return self.shape, self.axis_names, self.axis_types, self.platform


    def abstract_mesh(self) -> AbstractMesh:
        """The slice's mesh without devices, with its axis types: what the client exports StableHLO against."""
        return self._mesh

    def release(self) -> None:
        """Free the allocation; arrays on the slice stay valid until they are dropped."""
        session = self._session
        if not self.released and not session.closed:
            # What this client sent to the slice's island is admitted there before the slice is revoked: the
            # revoke goes by the resource manager and could overtake a call made just before, which the island
            # would then refuse, where arrays made on the slice must stay fetchable.
            others = {isl.index for isl in session.islands if isl.index != self.island}
            session.outboxes.drain(session.timeouts.op, skip=others | set(session.islands.dead))
            session.request(lambda rid: Release(rid, self.key), "pw.release")
            session.slices.pop(self.key, None)
        self.released = True

    def __enter__(self) -> VirtualSlice:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"VirtualSlice({self.key}: {axes} on island {self.island}, devices (host, device) {list(self.devices)})"


def slice(shape: Sequence[int], axis_names: Sequence[str], island: int | None = None, *,  # noqa: A001
          axis_types: AxisType | Sequence[AxisType] | None = None) -> VirtualSlice:
    """Ask the resource manager for a virtual slice: a mesh of ``shape`` over ``axis_names`` on one island.

    The slice maps one-to-one onto distinct devices of a single island: the least-loaded healthy island
    unless ``island`` is given, on one host when it fits there. Slices (of any tenant) may share devices;
    the island's scheduler time-multiplexes them. Its devices count against the tenant's quota until the
    slice is released.

    Args:
        shape: the mesh shape, e.g. ``(2, 2)``; at most as many devices as one island has.
        axis_names: one distinct, non-empty name per mesh dimension, e.g. ``("data", "model")``.
        island: the island to place it on (default: the resource manager picks).
        axis_types: the JAX type of each mesh axis, as ``jax.make_mesh``'s (one ``jax.sharding.AxisType`` for
            all axes is taken too): ``AxisType.Auto`` (the default: the compiler propagates shardings, as on
            ``jax.sharding.Mesh``) or ``AxisType.Explicit`` (shardings are part of the arrays' types, as on the
            mesh ``jax.make_mesh`` makes by default: ``jax.shard_map`` infers ``in_specs`` from the arguments).

    Returns:
        A ``pw.VirtualSlice``. Use it as a context manager, or ``pw.release`` it, to free the allocation.

    Raises:
        ResourceError: the slice cannot exist: a malformed shape, axis names or axis types, more devices than
            an island has, an unknown or unhealthy island, or over the tenant's device quota.
        PathwaysError: ``pw.init`` was not called.
    """
    session = current()
    try:
        dims, axes = [int(n) for n in shape], [str(a) for a in axis_names]
    except (TypeError, ValueError):
        raise ResourceError(f"pw.slice: shape {shape!r} must be a sequence of ints and axis_names {axis_names!r} "
                            "a sequence of names") from None
    if island is not None and (isinstance(island, bool) or not isinstance(island, int)):
        raise ResourceError(f"pw.slice: island must be an island's index, got {island!r}")
    types = _axis_types(axis_types, len(dims))
    wire = session.request(lambda rid: Allocate(rid, dims, axes, island), "pw.slice")
    s = VirtualSlice(session, wire, types, session.topology.jax_platform)
    session.slices[s.key] = s
    return s


def _axis_types(given: Any, n: int) -> tuple[AxisType, ...]:
    """``pw.slice``'s ``axis_types`` as one type per axis, or a ResourceError saying what is wrong with them."""
    if given is None:
        return (AxisType.Auto,) * n
    types = (given,) * n if isinstance(given, AxisType) else tuple(given) if isinstance(given, (tuple, list)) else None
    allowed = (AxisType.Auto, AxisType.Explicit)
    if types is None or len(types) != n or any(t not in allowed for t in types):
        raise ResourceError(f"pw.slice: axis_types must be one jax.sharding.AxisType per axis ({n}), each "
                            f"AxisType.Auto or AxisType.Explicit (Manual axes are what jax.shard_map makes inside), "
                            f"got {given!r}")
    return types


def release(s: VirtualSlice) -> None:
    """Free a slice's allocation (idempotent).

    Arrays already on it can still be fetched until they are dropped; new computations, puts and transfers
    on the slice, or taking its arrays as arguments, raise ProgramError.

    Args:
        s: a slice from ``pw.slice``.
    """
    s.release()


meshes.install()  # jax.set_mesh and jax.device_put take slices wherever the client is loaded
