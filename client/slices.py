"""Virtual slices: a mesh shape with axis names, placed by the resource manager on one island."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, AxisType

from client.session import Session, current
from pathways.errors import ResourceError
from pathways.ops import SliceDesc
from pathways.requests import Allocate, Release


class VirtualSlice:
    """Where computations run: ``shape`` over ``axis_names``, mapped one-to-one onto devices of ``island``.

    Usable as a context manager: leaving the block releases it.
    """

    def __init__(self, session: Session, wire: dict) -> None:
        self._session = session
        self.key: str = wire["key"]
        self.shape: tuple[int, ...] = tuple(wire["shape"])
        self.axis_names: tuple[str, ...] = tuple(wire["axes"])
        self.island: int = wire["island"]
        self.devices: tuple[tuple[int, int], ...] = tuple((h, d) for h, d in wire["devices"])
        self.tenant: str = wire["tenant"]
        self.released = False

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

    def abstract_mesh(self) -> AbstractMesh:
        """The slice's mesh without devices (axis types Auto): what the client exports StableHLO against."""
        return AbstractMesh(self.shape, self.axis_names, axis_types=(AxisType.Auto,) * len(self.shape))

    def release(self) -> None:
        """Free the allocation; arrays on the slice stay valid until they are dropped."""
        if not self.released and not self._session.closed:
            self._session.request(lambda rid: Release(rid, self.key), "pw.release")
            self._session.slices.pop(self.key, None)
        self.released = True

    def __enter__(self) -> VirtualSlice:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"VirtualSlice({self.key}: {axes} on island {self.island}, devices (host, device) {list(self.devices)})"


def slice(shape: Sequence[int], axis_names: Sequence[str], island: int | None = None) -> VirtualSlice:  # noqa: A001
    """Ask the resource manager for a virtual slice: a mesh of ``shape`` over ``axis_names`` on one island.

    The slice maps one-to-one onto distinct devices of a single island: the least-loaded healthy island
    unless ``island`` is given, on one host when it fits there. Slices (of any tenant) may share devices;
    the island's scheduler time-multiplexes them. Its devices count against the tenant's quota until the
    slice is released.

    Args:
        shape: the mesh shape, e.g. ``(2, 2)``; at most as many devices as one island has.
        axis_names: one distinct, non-empty name per mesh dimension, e.g. ``("data", "model")``.
        island: the island to place it on (default: the resource manager picks).

    Returns:
        A ``pw.VirtualSlice``. Use it as a context manager, or ``pw.release`` it, to free the allocation.

    Raises:
        ResourceError: the slice cannot exist: a malformed shape or axis names, more devices than an
            island has, an unknown or unhealthy island, or over the tenant's device quota.
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
    wire = session.request(lambda rid: Allocate(rid, dims, axes, island), "pw.slice")
    s = VirtualSlice(session, wire)
    session.slices[s.key] = s
    return s


def release(s: VirtualSlice) -> None:
    """Free a slice's allocation (idempotent).

    Arrays already on it can still be fetched until they are dropped; new computations, puts and transfers
    on the slice, or taking its arrays as arguments, raise ProgramError.

    Args:
        s: a slice from ``pw.slice``.
    """
    s.release()
