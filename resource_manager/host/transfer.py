"""Moving shards between hosts: cut a resident array into pieces, and rebuild one from pieces.

Pieces travel as numpy arrays through Ray's object store, are copied
straight out of a sender on the same node (``direct``), or arrive over the
network into the host's own landing buffers (``network``, as ``Landed``).
Every device's region is gathered into a buffer of the host's own, even when
one piece matches it exactly: a piece adopted as is would keep its
object-store memory pinned for as long as the array lives, on 4 KiB shared
pages that computations read slowly and a later same-node copy pins page by
page (slower than the huge pages of the host's own heap). A ``Landed``
piece already is such a buffer, so one that is exactly a device's region is
adopted without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding

from pathways.sharding import Index, intersection
from resource_manager.host.buffer_pool import aligned_empty
from resource_manager.host.transport.direct import Lent, copy_into

Alloc = Callable[[Sequence[int], np.dtype], np.ndarray]


class Landed(np.ndarray):
    """A received piece in a landing buffer of the host's own pool (64-byte aligned, C-contiguous): a device
    whose region it is exactly may adopt it without a copy."""


def index_of(slices: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """A shard's region as (start, stop) per dimension, from the slices JAX gives its index."""
    out = []
    for dim, extent in enumerate(shape):
        s = slices[dim] if dim < len(slices) else slice(None)
        start, stop, _ = s.indices(extent)
        out.append((start, stop))
    return tuple(out)


def local_pieces(array: jax.Array) -> dict[Index, jax.Array]:
    """This host's distinct shards of ``array``, by region."""
    pieces: dict[Index, jax.Array] = {}
    for shard in array.addressable_shards:
        pieces.setdefault(index_of(shard.index, array.shape), shard.data)
    return pieces


def region(pieces: dict[Index, np.ndarray | Lent], want: Index, dtype: np.dtype, alloc: Alloc = aligned_empty,
           lent: list | None = None) -> np.ndarray:
    """The ``want`` region, gathered from the pieces that overlap it into ``alloc``'s buffer.

    Overlaps with lent pieces are not copied here but appended to ``lent`` as ``(piece, out, want)``,
    for ``direct.copy_into`` to fill in one pass. The pieces must cover the region exactly once: a landing
    buffer is reused memory, and a byte no piece wrote would hand back whatever it held before (ValueError).
    """
    out = alloc([b - a for a, b in want], dtype)
    shared_all = []
    for have, data in pieces.items():
        shared = intersection(have, want)
        if shared is None:
            continue
        shared_all.append(shared)
        if isinstance(data, Lent):
            if lent is None:
                raise ValueError(f"region {want} overlaps a lent piece but no list collects the copies")
            lent.append((data, out, want))
        else:
            src = tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(shared, have))
            dst = tuple(slice(x - c, y - c) for (x, y), (c, _) in zip(shared, want))
            out[dst] = data[src]
    check_cover(shared_all, want)
    return out


def check_cover(parts: list[Index], want: Index) -> None:
    """ValueError unless ``parts`` (each within ``want``) cover every element of ``want`` exactly once."""
    size = math.prod(b - a for a, b in want)
    filled = sum(math.prod(y - x for x, y in p) for p in parts)
    if filled == size and len(parts) <= 64:
        overlapping = any(intersection(parts[i], parts[j]) is not None
                          for i in range(len(parts)) for j in range(i + 1, len(parts)))
    elif filled == size:  # many pieces: count each element's writers
        count = np.zeros([b - a for a, b in want], np.uint8)
        for p in parts:
            count[tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(p, want))] += 1
        overlapping = bool((count != 1).any())
    else:
        overlapping = filled > size
    if filled != size or overlapping:
        raise ValueError(f"received pieces {'overlap within' if overlapping else 'cover only part of'} region "
                         f"{want} ({filled} of its {size} elements written); refusing to land it")


@dataclass(frozen=True)
class Landing:
    """Where an array received on this host goes: its global shape and dtype, its sharding, and each local
    device's region. A recv op's landing is the same on every call, so the executor works it out once."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding
    wanted: list[tuple[jax.Device, Index]]

    @property
    def nbytes(self) -> int:
        """Bytes the array takes on this host once landed (each local device's region)."""
        return sum(math.prod(b - a for a, b in idx) for _, idx in self.wanted) * self.dtype.itemsize


def assemble(landing: Landing, pieces: dict[Index, np.ndarray | Lent], alloc: Alloc = aligned_empty) -> jax.Array:
    """A global array on ``landing.sharding`` whose local devices get their regions from ``pieces``."""
    lent: list = []
    adopted: set[Index] = set()
    regions = []
    for _, idx in landing.wanted:
        piece = pieces.get(idx)
        if type(piece) is Landed and piece.dtype == landing.dtype and idx not in adopted:
            adopted.add(idx)  # adopted once: two devices never share one buffer
            regions.append(piece.view(np.ndarray))
        else:
            regions.append(region(pieces, idx, landing.dtype, alloc, lent))
    if lent:
        copy_into(lent, landing.dtype.itemsize)
    if len(regions) == 1 and len(landing.sharding.device_set) == 1:  # one device: no per-device arrays to join
        return jax.device_put(regions[0], landing.sharding)
    arrays = [jax.device_put(r, dev) for r, (dev, _) in zip(regions, landing.wanted)]
    return jax.make_array_from_single_device_arrays(landing.shape, landing.sharding, arrays)
