"""Reusable landing buffers for received shards, so a transfer writes into memory that is already mapped.

A fresh large numpy array can cost more than the copy into it: every page
faults on first touch, and the kernel sometimes stalls compacting memory
into the huge pages numpy asks for. Training loops
receive the same shapes every step, so a host keeps the buffers of received
shards once nothing uses them any more and hands them out again by size.

A buffer is back in the pool when only the pool references its allocation:
every numpy view (and the ``jax.Array`` that adopted one without copying)
keeps the allocation alive through its ``base``, so the reference count says
exactly when the memory is free, whatever views were made of it.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

ALIGNMENT = 64  # jax.device_put on CPU adopts 64-byte aligned numpy buffers without a copy
_UNUSED_REFS = 3  # the pool's list, the loop variable, sys.getrefcount's argument
COLLECT_EVERY = 64  # takes between scans for freed buffers while every take finds a free one of its size (a scan of
# every buffer in use on each take cost a weight sync more than its reads); a take that finds none scans at once


def _aligned(raw: np.ndarray, nbytes: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    offset = -raw.ctypes.data % ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array whose data starts on a 64-byte boundary: jax.device_put on CPU adopts such
    a buffer without copying, while numpy's own (16-byte aligned) allocations take XLA's slow copy."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
    return _aligned(np.empty(nbytes + ALIGNMENT, dtype=np.uint8), nbytes, shape, dtype)


class BufferPool:
    """Aligned buffers by size: ``take`` reuses an allocation nothing references any more.

    At most ``limit`` bytes of unused buffers are kept; the least recently freed go first.
    """

    def __init__(self, limit: int = 2**30) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._used: list[np.ndarray] = []
        self._free: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self.free_bytes = 0
        self._takes = 0
        self.reused = 0
        self.allocated = 0

    def take(self, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        """An uninitialized, 64-byte aligned array of ``shape`` and ``dtype``, reusing a free allocation of its size
        when there is one."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
        size = nbytes + ALIGNMENT
        with self._lock:
            self._takes += 1
            if not self._free.get(size) or self._takes >= COLLECT_EVERY:
                self._collect()
            spare = self._free.get(size)
            if spare:
                raw = spare.pop()
                self.free_bytes -= size
                self.reused += 1
                if not spare:
                    del self._free[size]
            else:
                raw = np.empty(size, dtype=np.uint8)
                self.allocated += 1
            self._used.append(raw)
        return _aligned(raw, nbytes, shape, dtype)

    def _collect(self) -> None:
        self._takes = 0
        used, self._used = self._used, []
        for raw in used:
            if sys.getrefcount(raw) > _UNUSED_REFS:
                self._used.append(raw)
                continue
            self._free.setdefault(raw.size, []).append(raw)
            self._free.move_to_end(raw.size)
            self.free_bytes += raw.size
        while self.free_bytes > self.limit:
            size, spare = next(iter(self._free.items()))
            spare.pop(0)
            self.free_bytes -= size
            if not spare:
                del self._free[size]

    def stats(self) -> dict:
        """The pool's counters: bytes kept free, allocations reused, allocations made."""
        with self._lock:
            self._collect()
            return {"pool_free_bytes": self.free_bytes, "pool_reused": self.reused,
                    "pool_allocated": self.allocated}
