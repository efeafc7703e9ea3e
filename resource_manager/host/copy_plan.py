"""How lent shards land in a receiving host's devices: which bytes of which piece go where, worked out once.

A transfer between islands on one node reads the sender's shards straight out of its memory
(``transport.direct``). Which byte ranges of which piece go to which offsets of which destination buffer
depends only on the array's shape and dtype, the pieces' regions (the source sharding) and the local devices'
regions (the destination sharding). A training loop, and a weight sync above all, moves the same shapes between
the same shardings every step, so the host works that out once per such pair (``plan``, cached) and then only
executes it: per read call, one vectorised add of the buffers' addresses to the planned offsets.

The plan reads each distinct destination region once. Devices that hold the same region (a spec replicated
over some mesh axes) get a local copy of the first one's buffer instead of a second read out of the sender:
a memcpy within this process costs less than pinning the sender's pages again. Each read call takes one
contiguous stretch of a piece and scatters it over many destination segments (``direct``'s rule); large
stretches are cut so that several threads share them, and a landing of few bytes is read on the calling thread
(a hand-off to the read threads costs more than such a copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pathways.sharding import Index, intersection
from resource_manager.host.transport.direct import CHUNK, IOV_MAX, Kept, Lent, segments

PLAN_BYTES = 64 << 20  # the most bytes of offsets the host keeps in plans; the least recently used go first


@dataclass(frozen=True)
class ReadCall:
    """One ``process_vm_readv`` call: segments of destination buffers (by index) and the stretches of one piece
    that fill them, as offsets from the buffers' and the piece's starts."""

    piece: int
    outs: np.ndarray  # per local segment: which destination buffer
    local: np.ndarray  # per local segment: (offset, length), int64
    remote: np.ndarray  # per remote stretch: (offset, length), int64
    nbytes: int


@dataclass(frozen=True)
class CopyPlan:
    """The landing of one array from lent pieces: its distinct destination regions (one buffer each), for each
    local device the region it takes (``slots``) and the read calls that fill the buffers."""

    regions: tuple[Index, ...]
    slots: tuple[int, ...]
    calls: tuple[ReadCall, ...]
    nbytes: int

    @property
    def offsets_bytes(self) -> int:
        """Memory the plan's offsets take (what the host's cache of plans counts)."""
        return sum(c.outs.nbytes + c.local.nbytes + c.remote.nbytes for c in self.calls)

    def reads(self, pieces: Sequence[Lent], buffers: Sequence[np.ndarray]) -> list[tuple]:
        """The read calls that fill ``buffers`` (one per region, C-contiguous) from ``pieces`` (in the order
        planned), for ``direct.read_all``: the planned offsets moved to where the buffers and pieces are."""
        bases = np.array([b.ctypes.data for b in buffers], dtype=np.int64)
        calls = []
        for call in self.calls:
            piece = pieces[call.piece]
            local = np.empty((len(call.outs), 2), np.uint64)
            local[:, 0] = bases[call.outs] + call.local[:, 0]
            local[:, 1] = call.local[:, 1]
            remote = np.empty((len(call.remote), 2), np.uint64)
            remote[:, 0] = piece.addr + call.remote[:, 0]
            remote[:, 1] = call.remote[:, 1]
            calls.append((piece.pid, local, remote, call.nbytes))
        return calls


def _shape(region: Index) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


class Plans(Kept[CopyPlan]):
    """The host's plans by (wanted regions, piece regions, itemsize), within ``limit`` bytes of offsets; receives on
    several threads share it."""

    def __init__(self, limit: int = PLAN_BYTES) -> None:
        super().__init__(make, limit)

    def stats(self) -> dict[str, int]:
        """Plans kept, their bytes, plans made and plans reused."""
        return {"copy_plans": len(self), "copy_plan_bytes": self.nbytes, "copy_plans_made": self.made,
                "copy_plans_reused": self.reused}


def make(wanted: tuple[Index, ...], pieces: tuple[Index, ...], itemsize: int) -> CopyPlan:
    """The plan that lands ``pieces`` (regions of lent shards) into the ``wanted`` regions (one per local device).

    ValueError unless the pieces cover every wanted region exactly once: a landing buffer is reused memory, and
    a byte no piece wrote would hand back whatever it held before.
    """
    regions = tuple(dict.fromkeys(wanted))
    slots = tuple(regions.index(w) for w in wanted)
    for want in regions:
        check_cover([s for s in (intersection(p, want) for p in pieces) if s is not None], want)
    calls: list[ReadCall] = []
    for k, have in enumerate(pieces):
        found = segments(have, regions, itemsize)  # one contiguous stretch of the piece feeds many segments
        if found is not None:
            calls.extend(_calls(k, *found))
    return CopyPlan(regions, slots, tuple(calls), sum(c.nbytes for c in calls))


def _calls(piece: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, outs: np.ndarray) -> list[ReadCall]:
    """Sorted, disjoint runs of one piece cut into read calls of at most IOV_MAX segments and about CHUNK bytes."""
    if lengths.max() > CHUNK:  # a long run becomes several, so threads can share it
        steps = [np.arange(0, n, CHUNK, dtype=np.int64) for n in lengths]
        counts = np.array([len(s) for s in steps])
        step = np.concatenate(steps)
        src, dst = np.repeat(src, counts) + step, np.repeat(dst, counts) + step
        lengths, outs = np.minimum(np.repeat(lengths, counts) - step, CHUNK), np.repeat(outs, counts)
    per_call = int(max(1, min(IOV_MAX, CHUNK // max(1, int(lengths.max())))))
    calls = []
    for start in range(0, len(src), per_call):
        cut = slice(start, start + per_call)
        s, d, n, o = src[cut], dst[cut], lengths[cut], outs[cut]
        breaks = np.flatnonzero(np.r_[True, s[1:] != s[:-1] + n[:-1]])
        remote = np.stack([s[breaks], np.add.reduceat(n, breaks)], axis=1)
        local = np.stack([d, n], axis=1)
        for a in (local, remote, o):
            a.flags.writeable = False
        calls.append(ReadCall(piece, o, local, remote, int(n.sum())))
    return calls


def check_cover(parts: list[Index], want: Index) -> None:
    """ValueError unless ``parts`` (each within ``want``) cover every element of ``want`` exactly once."""
    size = math.prod(b - a for a, b in want)
    filled = sum(math.prod(y - x for x, y in p) for p in parts)
    if filled == size and len(parts) <= 64:
        overlapping = any(intersection(parts[i], parts[j]) is not None
                          for i in range(len(parts)) for j in range(i + 1, len(parts)))
    elif filled == size:  # many pieces: count each element's writers
        count = np.zeros(_shape(want), np.uint8)
        for p in parts:
            count[tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(p, want))] += 1
        overlapping = bool((count != 1).any())
    else:
        overlapping = filled > size
    if filled != size or overlapping:
        raise ValueError(f"received pieces {'overlap within' if overlapping else 'cover only part of'} region "
                         f"{want} ({filled} of its {size} elements written); refusing to land it")
