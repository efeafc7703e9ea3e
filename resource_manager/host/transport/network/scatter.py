"""A scattered receive: a shard arriving over the network lands straight in the devices' regions.

Senders push whole shards of their own layout (``pathways.sharding.plan_transfer``'s routes), while this host's
devices want regions of another layout. Landing each shard in a buffer of its own and regathering the regions
from it passes over every byte a second time, and across two nodes that pass cost as much as the socket's own
copy. Once a receive is registered here together with where it lands (a ``Target``: the distinct regions of the
local devices), each chunk of a shard is read with ``recvmsg`` straight into the regions' buffers: the stretch of
the shard the chunk carries, cut into the runs each region takes (``direct.segments``, worked out once per shard
and pair of layouts, and kept within ``CACHE_BYTES``), and bytes no local device wants into a scratch buffer.
The kernel's copy out of the socket is then the only copy. A shard landed so reaches the receive side as a
``Scattered`` piece, whose bytes are already where the devices adopt them (``transfer.assemble``).
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pathways.sharding import Index
from resource_manager.host.transport.direct import IOV_MAX, Kept, segments

Alloc = Callable[[Sequence[int], np.dtype], np.ndarray]
SCRATCH = 1 << 16  # where bytes no local device wants are read to (a gap longer than this takes several segments)
CACHE_BYTES = 64 << 20  # the most bytes of offsets kept for shards' layouts; the least recently used go first


class _MsgHdr(ctypes.Structure):
    """``struct msghdr`` (Linux): a receive into ``msg_iov``, with no address and no control data."""

    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32), ("msg_iov", ctypes.c_void_p),
                ("msg_iovlen", ctypes.c_size_t), ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


def _load() -> Callable:
    fn = ctypes.CDLL(None, use_errno=True).recvmsg
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
    return fn


_recvmsg = _load()
_scratch = np.empty(SCRATCH, np.uint8)  # shared by every thread: what lands in it is never read


def _shape(region: Index) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


class Target:
    """Where one receive lands on this host: the distinct regions its local devices take (in their order) and
    their buffers, taken on first use (the first chunk an authenticated peer sends for it), so that a receive no
    data comes for holds no memory."""

    def __init__(self, regions: tuple[Index, ...], dtype: np.dtype) -> None:
        self.regions = regions
        self.dtype = np.dtype(dtype)
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] | None = None
        self._bases: np.ndarray | None = None

    def buffers(self, alloc: Alloc) -> list[np.ndarray]:
        """The regions' buffers (C-contiguous, from ``alloc`` the first time)."""
        with self._lock:
            if self._buffers is None:
                self._buffers = [alloc(_shape(r), self.dtype).view(np.ndarray) for r in self.regions]
                self._bases = np.array([b.ctypes.data for b in self._buffers], np.int64)
            return self._buffers

    def bases(self, alloc: Alloc) -> np.ndarray:
        """The buffers' addresses, in region order."""
        self.buffers(alloc)
        assert self._bases is not None
        return self._bases


@dataclass(frozen=True, eq=False)
class Scattered:
    """A shard of region ``index`` that arrived whole into ``target``'s buffers: ``nbytes`` of it went there (what it
    holds in this host's memory; the rest no local device wanted)."""

    target: Target
    index: Index
    dtype: np.dtype
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The runs of one shard's bytes in a target's buffers, sorted by their offset in the shard."""

    src: np.ndarray  # offset in the shard
    ends: np.ndarray  # src + lengths
    dst: np.ndarray  # offset in its region's buffer
    lengths: np.ndarray
    outs: np.ndarray  # which region
    nbytes: int  # bytes of the shard some region takes
    whole: bool  # every byte of the shard: the runs leave no gaps

    @property
    def offsets_bytes(self) -> int:
        """Memory the layout takes (what the cache counts)."""
        return sum(a.nbytes for a in (self.src, self.ends, self.dst, self.lengths, self.outs))


_EMPTY = Layout(*(np.zeros(0, np.int64) for _ in range(5)), nbytes=0, whole=False)


class Layouts(Kept[Layout]):
    """Shards' layouts by (shard, regions, itemsize), within ``limit`` bytes of offsets; the data server's
    connections share it. A weight sync lands the same shards into the same regions every step."""

    def __init__(self, limit: int = CACHE_BYTES) -> None:
        super().__init__(_layout, limit)


def _layout(shard: Index, regions: tuple[Index, ...], itemsize: int) -> Layout:
    found = segments(shard, regions, itemsize)
    if found is None:
        return _EMPTY
    src, dst, lengths, outs = found
    nbytes = int(lengths.sum())
    out = Layout(src, src + lengths, dst, lengths, outs.astype(np.int64), nbytes,
                 nbytes == math.prod(_shape(shard)) * itemsize)  # (the runs are disjoint)
    for a in (out.src, out.ends, out.dst, out.lengths, out.outs):
        a.flags.writeable = False
    return out


LAYOUTS = Layouts()  # this host's layouts (one host per process)


def iovecs(layout: Layout, bases: np.ndarray, offset: int, length: int) -> np.ndarray:
    """``struct iovec`` entries (address, length) that take bytes ``offset:offset+length`` of the shard: the runs
    of that stretch in the target's buffers (``bases``: their addresses), and the gaps between them into scratch."""
    end = offset + length
    i0 = int(np.searchsorted(layout.ends, offset, "right"))
    i1 = int(np.searchsorted(layout.src, end, "left"))
    src = layout.src[i0:i1].copy()
    lengths = layout.lengths[i0:i1].copy()
    addrs = bases[layout.outs[i0:i1]] + layout.dst[i0:i1]
    if i1 > i0:  # the stretch may begin or end inside a run
        cut = offset - int(src[0])
        if cut > 0:
            src[0] += cut
            addrs[0] += cut
            lengths[0] -= cut
        lengths[-1] -= max(0, int(src[-1] + lengths[-1]) - end)
    if layout.whole:  # every byte of the shard has a place: no gaps to fill with scratch
        out = np.empty((len(addrs), 2), np.uint64)
        out[:, 0], out[:, 1] = addrs, lengths
        return out
    n = len(src)
    all_addrs = np.empty(2 * n + 1, np.int64)
    all_lengths = np.empty(2 * n + 1, np.int64)
    all_addrs[0::2] = _scratch.ctypes.data
    all_lengths[0::2] = np.concatenate((src, [end])) - np.concatenate(([offset], src + lengths))
    all_addrs[1::2] = addrs
    all_lengths[1::2] = lengths
    gap = np.zeros(2 * n + 1, bool)
    gap[0::2] = True
    keep = all_lengths > 0
    all_addrs, all_lengths, gap = all_addrs[keep], all_lengths[keep], gap[keep]
    long = gap & (all_lengths > SCRATCH)
    if long.any():  # cut into segments that fit the scratch buffer
        counts = np.where(long, -(-all_lengths // SCRATCH), 1)
        step = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * SCRATCH
        all_addrs = np.repeat(all_addrs, counts)
        all_lengths = np.where(np.repeat(long, counts), np.minimum(np.repeat(all_lengths, counts) - step, SCRATCH),
                               np.repeat(all_lengths, counts))
    out = np.empty((len(all_addrs), 2), np.uint64)
    out[:, 0], out[:, 1] = all_addrs, all_lengths
    return out


def receive(sock: socket.socket, iov: np.ndarray) -> None:
    """Fill the segments ``iov`` (``iovecs``'s, changed as they fill) from ``sock``, in order, with one ``recvmsg``
    per IOV_MAX segments that waits in the kernel until they are all filled (``MSG_WAITALL``: no return to Python,
    nor for the interpreter lock, each time a few packets arrived). ConnectionError if the peer closes first;
    OSError as the socket's reads."""
    msg = _MsgHdr()
    i, left = 0, int(iov[:, 1].sum())
    while i < len(iov):
        part = iov[i:i + IOV_MAX]
        msg.msg_iov, msg.msg_iovlen = part.ctypes.data, len(part)
        got = _recvmsg(sock.fileno(), ctypes.byref(msg), socket.MSG_WAITALL)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"reading a shard off the network failed: {os.strerror(err)}")
        if got == 0:
            raise ConnectionError("the other side closed the connection")
        left -= got
        if not left:  # the usual read: MSG_WAITALL filled every segment at once
            return
        ends = np.cumsum(part[:, 1], dtype=np.int64)
        whole = int(np.searchsorted(ends, got, "right"))  # segments filled completely
        i += whole
        if whole < len(part):
            done = got - (int(ends[whole - 1]) if whole else 0)
            if done:
                iov[i, 0] += np.uint64(done)
                iov[i, 1] -= np.uint64(done)
