"""Sharding specs on the wire, and the shard arithmetic that plans transfers.

Everything here is pure: the client plans which host sends which shard to
which host without touching a device, and hosts use the same functions to
assemble what they receive.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pathways.errors import ProgramError

Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def spec_to_wire(spec: P) -> list:
    """A PartitionSpec's msgpack form: each entry None, an axis name, or a list of axis names."""
    out: list = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        else:
            out.append(list(entry))
    return out


def spec_from_wire(entries: Sequence) -> P:
    """A PartitionSpec from its msgpack form."""
    return P(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def check_spec(spec: P, shape: Sequence[int], mesh_shape: Sequence[int],
               axis_names: Sequence[str], what: str = "value") -> None:
    """Raise ProgramError unless ``spec`` can shard an array of ``shape`` on the mesh."""
    if not isinstance(spec, P):
        raise ProgramError(f"{what}: expected a jax.sharding.PartitionSpec, got {spec!r}")
    if len(spec) > len(shape):
        raise ProgramError(f"{what}: spec {spec} has {len(spec)} entries but the array has rank {len(shape)}")
    sizes = dict(zip(axis_names, mesh_shape))
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        parts = 1
        for axis in _axes_of(entry):
            if axis not in sizes:
                raise ProgramError(
                    f"{what}: spec {spec} names mesh axis {axis!r}, but the slice's axes are {tuple(axis_names)}")
            if axis in seen:
                raise ProgramError(f"{what}: spec {spec} uses mesh axis {axis!r} twice")
            seen.add(axis)
            parts *= sizes[axis]
        if shape[dim] % parts:
            raise ProgramError(
                f"{what}: dimension {dim} of shape {tuple(shape)} is not divisible by the {parts} shards "
                f"that spec {spec} asks for on mesh {dict(sizes)}")


def fits(spec: P, shape: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str]) -> bool:
    """Whether ``spec`` can shard an array of ``shape`` on the mesh (``check_spec`` without the error)."""
    try:
        check_spec(spec, shape, mesh_shape, axis_names)
    except ProgramError:
        return False
    return True


def coords(flat: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh coordinates of device ``flat`` (row-major) on a mesh of ``mesh_shape``."""
    out = []
    for size in reversed(mesh_shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def shard_index(shape: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str],
                spec: P, flat_device: int) -> Index:
    """The (start, stop) region of the global array held by mesh device ``flat_device``."""
    c = dict(zip(axis_names, coords(flat_device, mesh_shape)))
    sizes = dict(zip(axis_names, mesh_shape))
    index = []
    for dim, extent in enumerate(shape):
        entry = spec[dim] if dim < len(spec) else None
        piece, parts = 0, 1
        for axis in _axes_of(entry):
            piece = piece * sizes[axis] + c[axis]
            parts *= sizes[axis]
        step = extent // parts
        index.append((piece * step, (piece + 1) * step))
    return tuple(index)


def device_indices(shape: Sequence[int], desc: Any, spec: P) -> list[Index]:
    """The region held by each device of a slice (anything with ``shape``, ``axes``, ``devices``), in mesh
    (row-major) order."""
    n = math.prod(desc.shape)
    return [shard_index(shape, desc.shape, desc.axes, spec, k) for k in range(n)]


def owned_shards(shape: Sequence[int], desc: Any, spec: P) -> dict[Index, int]:
    """Each distinct shard mapped to the host that sends it (its first holder)."""
    owners: dict[Index, int] = {}
    for k, index in enumerate(device_indices(shape, desc, spec)):
        owners.setdefault(index, desc.devices[k][0])
    return owners


def intersection(a: Index, b: Index) -> Index | None:
    """The region two regions share, or None when they do not overlap."""
    out = tuple((max(s0, t0), min(s1, t1)) for (s0, s1), (t0, t1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def overlaps(a: Index, b: Index) -> bool:
    """Whether two regions share any element."""
    return intersection(a, b) is not None


def plan_transfer(shape: Sequence[int], src: Any, src_spec: P, dst: Any, dst_spec: P
                  ) -> list[tuple[int, int, list[Index]]]:
    """Routes ``(source host, destination host, shards)`` of a transfer, sorted.

    Only shards that overlap what a destination host's devices need are sent, so
    matching shardings on equally shaped islands go host i to host i.
    """
    owners = owned_shards(shape, src, src_spec)
    needs: dict[int, list[Index]] = {}
    for k, index in enumerate(device_indices(shape, dst, dst_spec)):
        needs.setdefault(dst.devices[k][0], []).append(index)
    routes: dict[tuple[int, int], list[Index]] = {}
    for shard, host in owners.items():
        for to, wanted in needs.items():
            if any(overlaps(shard, w) for w in wanted):
                routes.setdefault((host, to), []).append(shard)
    return [(host, to, shards) for (host, to), shards in sorted(routes.items())]


def dtype_from_wire(name: str) -> np.dtype:
    """A dtype from its wire name, including JAX's extended ones (bfloat16, float8_*)."""
    return np.dtype(jnp.dtype(name))


def norm_spec(spec: P) -> tuple:
    """A PartitionSpec as a hashable tuple without trailing None entries, so equal shardings compare equal."""
    try:
        return _norm_spec(spec)  # every argument of every call: specs repeat
    except TypeError:  # an unhashable entry (a list): spec_to_wire says what is wrong with it, or takes it
        return _norm_spec.__wrapped__(spec)


@functools.lru_cache(maxsize=4096)
def _norm_spec(spec: P) -> tuple:
    entries = spec_to_wire(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)
