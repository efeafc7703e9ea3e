"""Virtual slices: a mesh shape with axis names, placed by the resource manager on one island."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, AxisType

from client.session import Session, current
from pathways.errors import ResourceError
from pathways.ops import SliceDesc


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
        return math.prod(self.shape)

    @property
    def hosts(self) -> tuple[int, ...]:
        """The island's hosts this slice spans, in order."""
        return tuple(sorted({h for h, _ in self.devices}))

    def desc(self) -> SliceDesc:
        return SliceDesc(self.key, self.shape, self.axis_names, self.devices)

    def abstract_mesh(self) -> AbstractMesh:
        return AbstractMesh(self.shape, self.axis_names, axis_types=(AxisType.Auto,) * len(self.shape))

    def release(self) -> None:
        """Free the allocation; arrays on the slice stay valid until they are dropped."""
        if not self.released and not self._session.closed:
            self._session.request("release", {"slice": self.key})
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
    """Ask the resource manager for a virtual slice; raises ResourceError if it cannot exist."""
    session = current()
    try:
        body = {"shape": [int(n) for n in shape], "axes": [str(a) for a in axis_names], "island": island}
    except (TypeError, ValueError):
        raise ResourceError(f"pw.slice: shape {shape!r} must be a sequence of ints and axis_names {axis_names!r} "
                            "a sequence of names") from None
    wire = session.request("allocate", body)
    s = VirtualSlice(session, wire)
    session.slices[s.key] = s
    return s


def release(s: VirtualSlice) -> None:
    """Free a slice's allocation. Arrays on it stay valid until they are dropped."""
    s.release()
