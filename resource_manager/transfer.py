"""Moving shards between hosts: cut a resident array into pieces, and rebuild one from pieces.

Pieces travel as numpy arrays through Ray's object store or are copied
straight out of a sender on the same node (``direct``). Every device's region
is gathered into a buffer of the host's own, even when one piece matches it
exactly: a piece adopted as is would keep its object-store memory pinned for
as long as the array lives, on 4 KiB shared pages that computations read
slowly and a later same-node copy pins page by page (3x slower than the huge
pages of the host's own heap).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from pathways.sharding import Index, intersection
from resource_manager.buffer_pool import aligned_empty
from resource_manager.direct import Lent, copy_into

Alloc = Callable[[Sequence[int], np.dtype], np.ndarray]


def index_of(slices: tuple[slice, ...], shape: Sequence[int]) -> Index:
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
    for ``direct.copy_into`` to fill in one pass.
    """
    out = alloc([b - a for a, b in want], dtype)
    filled = 0
    for have, data in pieces.items():
        shared = intersection(have, want)
        if shared is None:
            continue
        if isinstance(data, Lent):
            if lent is None:
                raise ValueError(f"region {want} overlaps a lent piece but no list collects the copies")
            lent.append((data, out, want))
        else:
            src = tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(shared, have))
            dst = tuple(slice(x - c, y - c) for (x, y), (c, _) in zip(shared, want))
            out[dst] = data[src]
        filled += int(np.prod([y - x for x, y in shared]))
    if filled < out.size:
        raise ValueError(f"received pieces cover {filled} of the {out.size} elements of region {want}")
    return out


def assemble(shape: Sequence[int], dtype: np.dtype, sharding: NamedSharding,
             wanted: Sequence[tuple[jax.Device, Index]], pieces: dict[Index, np.ndarray | Lent],
             alloc: Alloc = aligned_empty) -> jax.Array:
    """A global array on ``sharding`` whose local devices get their regions from ``pieces``."""
    lent: list = []
    regions = [region(pieces, idx, dtype, alloc, lent) for _, idx in wanted]
    if lent:
        copy_into(lent, np.dtype(dtype).itemsize)
    arrays = [jax.device_put(r, dev) for r, (dev, _) in zip(regions, wanted)]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
