"""Moving shards between hosts: cut a resident array into pieces, and rebuild one from pieces.

Pieces travel as numpy arrays through Ray's object store, are copied
straight out of a sender on the same node (``direct``), or arrive over the
network (``network``): straight into the devices' regions when their receive
was registered first (``Scattered``), else into the host's own landing buffers
(``Landed``).
Every device's region is gathered into a buffer of the host's own, even when
one piece matches it exactly: a piece adopted as is would keep its
object-store memory pinned for as long as the array lives, on 4 KiB shared
pages that computations read slowly and a later same-node copy pins page by
page (slower than the huge pages of the host's own heap). A ``Landed``
piece already is such a buffer, so one that is exactly a device's region is
adopted without a copy. Lent pieces land by the host's plan for the pair of
shardings (``copy_plan``): worked out on the first transfer of a shape between
two shardings, then only executed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax._src.core import ShapedArray
from jax._src.interpreters.pxla import batched_device_put
from jax.sharding import NamedSharding

from pathways.sharding import Index, intersection
from resource_manager.host.buffer_pool import aligned_empty
from resource_manager.host.copy_plan import Plans, check_cover
from resource_manager.host.transport.direct import (
    CHUNK,
    INLINE_BYTES,
    READ_TIMEOUT_S,
    THREADS,
    Lent,
    copy_into,
    read_all,
)
from resource_manager.host.transport.network.scatter import Scattered, Target

Alloc = Callable[[Sequence[int], np.dtype], np.ndarray]
Piece = np.ndarray | Lent | Scattered  # a received piece: in this process, lent by its sender, or scattered


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


def region(pieces: dict[Index, Piece], want: Index, dtype: np.dtype, alloc: Alloc = aligned_empty,
           lent: list | None = None, local: list | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The ``want`` region, gathered from the pieces that overlap it into ``out`` (else ``alloc``'s buffer).

    Overlaps with lent pieces are not copied here but appended to ``lent`` as ``(piece, out, want)``,
    for ``direct.copy_into`` to fill in one pass; with ``local`` given, overlaps with pieces in this
    process are appended there as ``(out, dst, data, src)`` for ``gather`` to copy. Scattered pieces are in
    ``out`` already (it is their target's buffer for ``want``). The pieces must cover the region exactly once:
    a landing buffer is reused memory, and a byte no piece wrote would hand back whatever it held before
    (ValueError).
    """
    if out is None:
        out = alloc([b - a for a, b in want], dtype)
    shared_all = []
    for have, data in pieces.items():
        shared = intersection(have, want)
        if shared is None:
            continue
        shared_all.append(shared)
        if isinstance(data, Scattered):
            continue
        if isinstance(data, Lent):
            if lent is None:
                raise ValueError(f"region {want} overlaps a lent piece but no list collects the copies")
            lent.append((data, out, want))
        else:
            src = tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(shared, have))
            dst = tuple(slice(x - c, y - c) for (x, y), (c, _) in zip(shared, want))
            if local is None:
                out[dst] = data[src]
            else:
                local.append((out, dst, data, src))
    check_cover(shared_all, want)
    return out


@dataclass(frozen=True)
class Landing:
    """Where an array received on this host goes: its global shape and dtype, its sharding, and each local
    device's region. A recv op's landing is the same on every call, so the executor works it out once."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding
    wanted: list[tuple[jax.Device, Index]]

    @functools.cached_property
    def regions(self) -> tuple[Index, ...]:
        """The distinct regions of the local devices, in their order (devices holding the same region share one)."""
        return tuple(dict.fromkeys(idx for _, idx in self.wanted))

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes the array takes on this host once landed (each local device's region)."""
        return sum(math.prod(b - a for a, b in idx) for _, idx in self.wanted) * self.dtype.itemsize


PLANS = Plans()  # this host's copy plans of lent pieces (one host per process)
_gatherers = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gather")


def all_lent(pieces: dict[Index, Piece | None]) -> bool:
    """Whether ``pieces`` are all lent: still in their senders, to be read out of them (``assemble_lent``)."""
    return bool(pieces) and all(type(p) is Lent for p in pieces.values())


def all_scattered(pieces: dict[Index, Piece | None]) -> bool:
    """Whether ``pieces`` all arrived straight in their receive's regions (``Scattered``): nothing left to copy."""
    return bool(pieces) and all(type(p) is Scattered for p in pieces.values())


def assemble(landing: Landing, pieces: dict[Index, Piece], alloc: Alloc = aligned_empty) -> jax.Array:
    """A global array on ``landing.sharding`` whose local devices get their regions from ``pieces``: scattered
    ones are in their target's buffers already, which the devices adopt (other pieces copied into them); a landed
    piece that is exactly a device's region is adopted as is; the rest is gathered."""
    if all_lent(pieces):
        return assemble_lent([(landing, pieces)], alloc)[0]
    target = _target(pieces, landing)
    buffers = dict(zip(landing.regions, target.buffers(alloc))) if target is not None else {}
    lent: list = []
    local: list = []
    firsts: dict[Index, np.ndarray] = {}
    for idx in landing.regions:
        piece = pieces.get(idx)
        if idx in buffers:
            firsts[idx] = region(pieces, idx, landing.dtype, lent=lent, local=local, out=buffers[idx])
        elif type(piece) is Landed and piece.dtype == landing.dtype:
            firsts[idx] = piece.view(np.ndarray)
        else:
            firsts[idx] = region(pieces, idx, landing.dtype, alloc, lent, local)
    if lent:
        copy_into(lent, landing.dtype.itemsize)
    if local:
        gather(local)
    return _on_devices(landing, _per_device([idx for _, idx in landing.wanted], firsts, landing.dtype, alloc))


def _per_device(keys: Sequence[Any], buffers: Any, dtype: np.dtype, alloc: Alloc) -> list[np.ndarray]:
    """Each device's buffer (``keys``: per device, its region's key in ``buffers``): the first device with a region
    takes its buffer, any other a copy of its own, made here (two devices never share one buffer)."""
    out, seen = [], set()
    for key in keys:
        if key in seen:
            replica = alloc(buffers[key].shape, dtype)
            np.copyto(replica, buffers[key])
            out.append(replica)
        else:
            seen.add(key)
            out.append(buffers[key])
    return out


def _target(pieces: dict[Index, Piece], landing: Landing) -> Target | None:
    """The target the scattered ones of ``pieces`` landed in (ValueError unless it is ``landing``'s)."""
    targets = {id(p.target): p.target for p in pieces.values() if isinstance(p, Scattered)}
    if not targets:
        return None
    target = next(iter(targets.values()))
    if len(targets) > 1 or target.regions != landing.regions or target.dtype != landing.dtype:
        raise ValueError("pieces landed for another receive's regions; refusing to land them")
    return target


def gather(copies: list[tuple[np.ndarray, tuple, np.ndarray, tuple]]) -> None:
    """Run ``out[dst] = data[src]`` for each copy: pieces that arrived whole (over the network) regathered as the
    devices' regions. numpy lets go of the interpreter lock while it copies, so a large gather is cut into slabs
    of about ``CHUNK`` bytes along the first dimension and shared by several threads; a small one runs here."""
    slabs = []
    for out, dst, data, src in copies:
        rows = dst[0].stop - dst[0].start if dst else 1
        row_bytes = max(1, out[dst].nbytes // max(1, rows))
        step = max(1, CHUNK // row_bytes)
        if not dst or rows <= step:
            slabs.append((out, dst, data, src))
            continue
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            slabs.append((out, (slice(dst[0].start + lo, dst[0].start + hi), *dst[1:]), data,
                          (slice(src[0].start + lo, src[0].start + hi), *src[1:])))
    if len(slabs) == 1 or sum(out[dst].nbytes for out, dst, _, _ in slabs) <= INLINE_BYTES:
        for out, dst, data, src in slabs:
            out[dst] = data[src]
        return
    for future in [_gatherers.submit(_copy, *slab) for slab in slabs]:
        future.result(timeout=READ_TIMEOUT_S)  # TimeoutError: the receive fails, its op says how long it took


def _copy(out: np.ndarray, dst: tuple, data: np.ndarray, src: tuple) -> None:
    out[dst] = data[src]


def assemble_all(batch: Sequence[tuple[Landing, dict[Index, Piece]]],
                 alloc: Alloc = aligned_empty) -> list[jax.Array]:
    """``assemble`` for each ``(landing, pieces)`` of ``batch``; those whose pieces are all lent as one unit
    (``assemble_lent``)."""
    lent = [k for k, (_, pieces) in enumerate(batch) if all_lent(pieces)]
    out: list = [None] * len(batch)
    for k, array in zip(lent, assemble_lent([batch[k] for k in lent], alloc)):
        out[k] = array
    for k, (landing, pieces) in enumerate(batch):
        if out[k] is None:
            out[k] = assemble(landing, pieces, alloc)
    return out


def assemble_lent(batch: Sequence[tuple[Landing, dict[Index, Lent]]], alloc: Alloc = aligned_empty) -> list[jax.Array]:
    """Several arrays landed from lent pieces as one unit, each by the host's plan for its pair of shardings (each
    distinct region read once, replicas copied from it here): the read calls of all of them go to
    ``direct.read_all`` together, so the cores copy across the arrays' boundaries. OSError as ``read_all`` (which
    array's sender died is not said)."""
    calls: list[tuple] = []
    staged = []
    for landing, pieces in batch:
        order = tuple(sorted(pieces))
        plan = PLANS.get(tuple(idx for _, idx in landing.wanted), order, landing.dtype.itemsize)
        buffers = [alloc([b - a for a, b in r], landing.dtype) for r in plan.regions]
        calls.extend(plan.reads([pieces[k] for k in order], buffers))
        staged.append((landing, plan, buffers))
    read_all(calls)
    landed = []
    for landing, plan, buffers in staged:
        landed.append(_on_devices(landing, _per_device(plan.slots, buffers, landing.dtype, alloc)))
    return landed


def _on_devices(landing: Landing, regions: list[np.ndarray]) -> jax.Array:
    """The global array whose local devices adopt ``regions`` (one per ``landing.wanted`` entry, in order).

    One call of what ``jax.device_put`` itself ends in for numpy shards, adopting 64-byte aligned buffers without a
    copy: a tenth of the time of ``device_put`` per device and ``make_array_from_single_device_arrays``, on every
    array a weight sync lands. It is JAX's own, not public: the same in every JAX the project admits (0.10-0.12)."""
    return batched_device_put(ShapedArray(landing.shape, landing.dtype), landing.sharding, regions,
                              [dev for dev, _ in landing.wanted])
