"""Moving shards between hosts: cut a resident array into pieces, and rebuild one from pieces.

Pieces travel as numpy arrays through Ray's object store (zero-copy on the
receiving side); a destination device whose region matches a received piece
exactly takes that piece as is, otherwise its region is gathered from the
overlapping pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from pathways.sharding import Index


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


def aligned_empty(shape: Sequence[int], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on a 64-byte boundary: jax.device_put on CPU adopts such
    a buffer without copying, while numpy's own (16-byte aligned) allocations take XLA's slow copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def region(pieces: dict[Index, np.ndarray], want: Index, dtype: np.dtype) -> np.ndarray:
    """The ``want`` region, taken whole from one piece or gathered from several."""
    exact = pieces.get(want)
    if exact is not None:
        return exact
    out = aligned_empty([b - a for a, b in want], dtype)
    filled = 0
    for have, data in pieces.items():
        lo = [max(a, c) for (a, _), (c, _) in zip(have, want)]
        hi = [min(b, d) for (_, b), (_, d) in zip(have, want)]
        if any(x >= y for x, y in zip(lo, hi)):
            continue
        src = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, have))
        dst = tuple(slice(x - c, y - c) for x, y, (c, _) in zip(lo, hi, want))
        out[dst] = data[src]
        filled += int(np.prod([y - x for x, y in zip(lo, hi)]))
    if filled < out.size:
        raise ValueError(f"received pieces cover {filled} of the {out.size} elements of region {want}")
    return out


def assemble(shape: Sequence[int], dtype: np.dtype, sharding: NamedSharding,
             wanted: Sequence[tuple[jax.Device, Index]], pieces: dict[Index, np.ndarray]) -> jax.Array:
    """A global array on ``sharding`` whose local devices get their regions from ``pieces``."""
    arrays = [jax.device_put(region(pieces, idx, dtype), dev) for dev, idx in wanted]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
