"""Same-node transfers without the object store: the receiver copies shards straight out of the sender.

Writing a large array into Ray's object store is several times slower than a
memcpy (its shared-memory pages are slow to fill). Two hosts on one node share
a kernel, so the sender instead *lends* its shards: it keeps the arrays alive
and sends their addresses. The receiver's recv op copies them with Linux's
cross-memory attach (``process_vm_readv``, what MPI libraries use for large
intra-node messages) straight into the buffers its devices will adopt: one
copy, even when resharding, because one call reads a contiguous stretch of the
sender's memory and scatters it over many local segments (the rows of several
destination shards). Then the lease goes back and the sender lets go of the
arrays.

A route uses this path only after a probe showed that the receiver runs on the
same Ray node and may read this process (the kernel's ptrace rules allow it:
same user, and Yama's ptrace_scope 0); otherwise shards go through the object
store. Hosts never widen those rules for themselves: the receiver reads only
the process at the other end of its authenticated socket (``resource_manager.host.transport.channel``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import queue
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from pathways.sharding import Index, intersection

CHUNK = 4 * 2**20  # bytes per read call: big copies are split over several threads
IOV_MAX = 1024  # Linux's limit on segments per call
THREADS = max(1, min(4, os.cpu_count() or 1))  # threads copying one read_all: its caller and THREADS - 1 others
INLINE_BYTES = 1 << 20  # reads of at most this many bytes in all run on the calling thread
READ_TIMEOUT_S = 120.0  # the longest a caller waits for a read thread to finish a call it took (a GiB is < 1 s)
PROBE = bytes(range(64))
T = TypeVar("T")


@dataclass(frozen=True)
class Lent:
    """A shard that stays in its sender: where to copy it from, and whom to return the lease to."""

    pid: int
    addr: int
    index: Index
    src: tuple[int, int]  # (island, host)
    lease: int
    reply: str  # the sender's channel address, where the lease goes back ("" = by Ray)


def _load() -> Callable | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()


def readable() -> bool:
    """Whether this platform lets a process copy out of another (Linux's ``process_vm_readv``)."""
    return _readv is not None


def _iovecs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A C array of ``struct iovec`` (base, length): two 64-bit words each."""
    out = np.empty((len(addrs), 2), dtype=np.uint64)
    out[:, 0], out[:, 1] = addrs, lengths
    return out


def _read(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
    got = _readv(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    if got != nbytes:
        err = ctypes.get_errno() if got < 0 else 0
        raise OSError(err, f"copying {nbytes} bytes out of process {pid} stopped after {max(got, 0)}: "
                           f"{os.strerror(err) if err else 'its memory changed under the copy'}")


@functools.lru_cache(maxsize=4096)
def runs(have: Index, want: Index, itemsize: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Byte offsets of the contiguous runs where region ``have`` overlaps ``want`` (both row-major).

    Returns (offsets in ``have``, offsets in ``want``, run length), or None when they do not overlap.
    Trailing dimensions both regions hold whole merge into longer runs. A training loop moves the same
    regions every step, so results are cached (read-only arrays).
    """
    shared = intersection(have, want)
    if shared is None:
        return None
    ndim = len(have)
    if ndim == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), itemsize
    lo = [x for x, _ in shared]
    box = [y - x for x, y in shared]
    src_shape = [b - a for a, b in have]
    dst_shape = [b - a for a, b in want]
    last = ndim - 1
    while last > 0 and box[last] == src_shape[last] == dst_shape[last]:
        last -= 1
    length = int(np.prod(box[last:], dtype=np.int64)) * itemsize

    def offsets(region: Index, shape: list[int]) -> np.ndarray:
        strides = np.cumprod([1] + shape[::-1][:-1], dtype=np.int64)[::-1] * itemsize
        start = np.array([x - a for x, (a, _) in zip(lo, region)], dtype=np.int64)
        base = int(start @ strides)
        if last == 0:
            out = np.array([base], np.int64)
        else:
            out = base + strides[:last] @ np.indices(box[:last], dtype=np.int64).reshape(last, -1)
        out.flags.writeable = False
        return out

    return offsets(have, src_shape), offsets(want, dst_shape), length


def segments(have: Index, regions: Sequence[Index], itemsize: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Where the bytes of region ``have`` go in ``regions`` (disjoint): per contiguous run, its offset in ``have``,
    its offset in its region, its length and which region, sorted by the offset in ``have`` (one stretch of a
    shard holds rows of several destination regions in turn); None when ``have`` overlaps none of them."""
    parts = []
    for r, want in enumerate(regions):
        found = runs.__wrapped__(have, want, itemsize)  # not through the cache: callers keep what they make
        if found is not None:
            src, dst, length = found
            parts.append((src, dst, np.full(len(src), length, np.int64), np.full(len(src), r, np.int32)))
    if not parts:
        return None
    src, dst, lengths, outs = (np.concatenate(p) for p in zip(*parts))
    order = np.argsort(src, kind="stable")
    return src[order], dst[order], lengths[order], outs[order]


class Kept(Generic[T]):
    """Things made from regions (copy plans, layouts) by key, within ``limit`` bytes of offsets (each one's
    ``offsets_bytes``); the least recently used go first. Thread-safe. Regions come from admitted ops and
    authenticated peers; a tenant that varies its shapes only churns the cache, whose bytes stay bounded."""

    def __init__(self, make: Callable[..., T], limit: int) -> None:
        self._make = make
        self.limit = limit
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple, T] = OrderedDict()
        self.nbytes = 0
        self.made = 0
        self.reused = 0

    def get(self, *key: Any) -> T:
        """``make(*key)``: made on first use, then the same one (what ``make`` raises, otherwise)."""
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                self.reused += 1
                return found
        made = self._make(*key)
        size = made.offsets_bytes
        with self._lock:
            self.made += 1
            if size <= self.limit and key not in self._kept:
                self._kept[key] = made
                self.nbytes += size
                while self.nbytes > self.limit:
                    _, old = self._kept.popitem(last=False)
                    self.nbytes -= old.offsets_bytes
        return made

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


def copy_into(jobs: Sequence[tuple[Lent, np.ndarray, Index]], itemsize: int) -> int:
    """Fill each ``(piece, out, out_index)``'s overlap with the lent piece; returns the bytes copied.

    Per piece, every destination's runs are sorted by their place in the sender's memory, so each call
    reads one contiguous stretch there and scatters it; calls run on several threads.
    """
    if _readv is None:
        raise OSError("process_vm_readv is not available on this platform")
    by_piece: dict[Lent, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for piece, out, index in jobs:
        found = runs(piece.index, index, itemsize)
        if found is not None:
            src, dst, length = found
            by_piece.setdefault(piece, []).append((src, dst + out.ctypes.data, np.full(len(src), length, np.int64)))
    calls = []
    for piece, parts in by_piece.items():
        if len(parts) == 1:  # one destination: its runs are in the sender's order already, and disjoint
            calls.extend(_calls(piece, *parts[0]))
            continue
        src, dst, lengths = (np.concatenate(p) for p in zip(*parts))
        order = np.argsort(src, kind="stable")
        src, dst, lengths = src[order], dst[order], lengths[order]
        if len(src) > 1 and np.any(src[1:] < src[:-1] + lengths[:-1]):  # two destinations want the same bytes
            for part in parts:
                calls.extend(_calls(piece, *part))
        else:
            calls.extend(_calls(piece, src, dst, lengths))
    read_all(calls)
    return sum(call[3] for call in calls)


class _Reads:
    """The read calls of one ``read_all``, shared by its caller and the read threads: each takes the next call not
    yet taken until none are left, so every core copies until the end and nobody hands calls over one by one."""

    def __init__(self, calls: Sequence[tuple[int, np.ndarray, np.ndarray, int]]) -> None:
        self.calls = sorted(calls, key=lambda call: -call[3])  # the longest first: the last ones end together
        self._next = itertools.count()  # next() on it is atomic under the interpreter lock
        self._lock = threading.Lock()
        self._left = len(self.calls)
        self.done = threading.Event()
        self.error: Exception | None = None

    def work(self) -> None:
        """Run calls until none are left to take; the first error is kept, and the calls after it are skipped."""
        while (k := next(self._next)) < len(self.calls):
            try:
                if self.error is None:
                    _read(*self.calls[k])
            except Exception as exc:  # kept for the caller: a read thread lives on
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.done.set()


class _ReadThreads:
    """Threads that join a ``read_all`` in progress: one wake each per ``read_all``, not one per call."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._work: queue.SimpleQueue[_Reads] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0

    def join(self, reads: _Reads) -> None:
        """Let up to ``count`` threads take calls of ``reads`` besides its caller."""
        with self._lock:
            while self._started < self.count:
                threading.Thread(target=self._run, name=f"direct-read-{self._started}", daemon=True).start()
                self._started += 1
        for _ in range(min(self.count, len(reads.calls) - 1)):
            self._work.put(reads)

    def _run(self) -> None:
        while True:
            self._work.get().work()


_helpers = _ReadThreads(THREADS - 1)


def read_all(calls: Sequence[tuple[int, np.ndarray, np.ndarray, int]]) -> None:
    """Run read calls ``(pid, local iovecs, remote iovecs, bytes)``: this thread and the read threads take them in
    turn, or this thread alone when they are one call or few bytes (waking another would cost more than the copy).
    OSError when a sender's memory cannot be read (it died), or a read thread did not finish within
    ``READ_TIMEOUT_S``."""
    if _readv is None:
        raise OSError("process_vm_readv is not available on this platform")
    if len(calls) == 1 or _helpers.count == 0 or sum(call[3] for call in calls) <= INLINE_BYTES:
        for call in calls:
            _read(*call)
        return
    reads = _Reads(calls)
    _helpers.join(reads)
    reads.work()
    if not reads.done.wait(READ_TIMEOUT_S):
        raise TimeoutError(f"a read thread took over {READ_TIMEOUT_S:.0f}s to copy its part of "
                           f"{sum(call[3] for call in calls)} bytes")
    if reads.error is not None:
        raise reads.error


def _calls(piece: Lent, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> list[tuple]:
    """Cut sorted, non-overlapping runs into read calls of at most IOV_MAX segments and about CHUNK bytes."""
    if len(src) == 1 and lengths[0] <= CHUNK:  # the common case: one whole shard
        return [(piece.pid, _iovecs(dst, lengths), _iovecs(piece.addr + src, lengths), int(lengths[0]))]
    if lengths.max() > CHUNK:  # a long run becomes several, so threads can share it
        pieces = [np.arange(0, n, CHUNK, dtype=np.int64) for n in lengths]
        counts = np.array([len(p) for p in pieces])
        step = np.concatenate(pieces)
        src, dst = np.repeat(src, counts) + step, np.repeat(dst, counts) + step
        lengths = np.minimum(np.repeat(lengths, counts) - step, CHUNK)
    per_call = int(max(1, min(IOV_MAX, CHUNK // max(1, int(lengths.max())))))
    calls = []
    for start in range(0, len(src), per_call):
        s, d, n = src[start:start + per_call], dst[start:start + per_call], lengths[start:start + per_call]
        breaks = np.flatnonzero(np.r_[True, s[1:] != s[:-1] + n[:-1]])
        remote = _iovecs(piece.addr + s[breaks], np.add.reduceat(n, breaks))
        calls.append((piece.pid, _iovecs(d, n), remote, int(n.sum())))
    return calls


def can_read(pid: int, addr: int, expected: bytes) -> bool:
    """Whether this process may read process ``pid`` (same kernel, ptrace permission) and sees ``expected``."""
    if _readv is None:
        return False
    out = np.empty(len(expected), np.uint8)
    one = np.array([len(expected)], np.int64)
    try:
        _read(pid, _iovecs(np.array([out.ctypes.data]), one), _iovecs(np.array([addr]), one), len(expected))
    except OSError:
        return False
    return out.tobytes() == expected
