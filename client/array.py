"""``pw.Array``: a handle (future) to an array resident on an island's hosts.

The buffers never leave the island unless fetched. Dropping the last
reference frees them (in batches, ordered after every fragment already sent).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import ray
from jax.sharding import PartitionSpec as P

from client.session import Session, current
from client.slices import VirtualSlice
from pathways.errors import IslandFailedError, PathwaysError, ProgramError
from pathways.messages import Fetch, Put
from pathways.ops import Aval, SliceDesc, spec_of
from pathways.sharding import check_spec, device_indices, spec_to_wire


class Array:
    """A future for an array on a virtual slice, sharded by ``spec``."""

    __slots__ = ("id", "shape", "dtype", "slice", "spec", "islands", "epoch", "_session", "_value", "__weakref__")

    def __init__(self, session: Session, buffer_id: int, shape: tuple[int, ...], dtype: np.dtype,
                 slice: VirtualSlice, spec: P, islands: frozenset[int], epoch: int = 0) -> None:  # noqa: A002
        self._session = session
        self.epoch = epoch  # the island's restart count when the buffer was made: a restart loses it
        self.id = buffer_id
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.slice = slice
        self.spec = spec
        self.islands = islands  # every island its value depends on, for failure detection
        self._value: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def check_alive(self) -> None:
        """IslandFailedError if the island restarted since this array was made (its buffers were lost)."""
        s = self._session
        if s.epoch(self.slice.island) != self.epoch and self._value is None:
            raise IslandFailedError(f"{self} was lost: island {self.slice.island} restarted after it failed, with "
                                    "empty buffers (pw.status() says when and why); compute it again")

    def _request(self, timeout: float | None, ready_only: bool) -> list:
        s = self._session
        self.check_alive()
        t = s.timeouts.fetch if timeout is None else float(timeout)
        payload = Fetch(self.id, t, ready_only).encode()
        mac = s.sign("fetch", payload)
        hosts = self.slice.hosts
        refs = [h.fetch.remote(s.client_id, payload, mac) for h in s.hosts_of(self.slice.island, hosts)]
        what = f"fetching {self.dtype.name}{list(self.shape)} (buffer {self.id}) from island {self.slice.island}"
        return s.wait(refs, self.islands, t, what)

    def fetch(self, timeout: float | None = None) -> np.ndarray:
        """The value as numpy; blocks at most ``timeout`` seconds (the session's fetch timeout by default)."""
        if self._value is None:
            parts = self._request(timeout, ready_only=False)
            if isinstance(parts[0], np.ndarray):
                self._value = parts[0]
            else:
                out = np.empty(self.shape, self.dtype)
                for part in parts:
                    for index, data in part.items():
                        out[tuple(np.s_[a:b] for a, b in index)] = data
                self._value = out
        return self._value

    def block_until_ready(self, timeout: float | None = None) -> Array:
        """Wait until the value is computed on the island, without moving it."""
        if self._value is None:
            self._request(timeout, ready_only=True)
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.fetch()
        return value if dtype is None else value.astype(dtype)

    def __del__(self) -> None:
        try:
            if not self._session.closed:
                self._session.frees.add(self.slice.island, self.id)
        except Exception:  # interpreter shutdown: the cluster frees everything anyway
            pass

    def __repr__(self) -> str:
        return (f"pw.Array({self.dtype.name}{list(self.shape)}, spec={self.spec}, "
                f"island={self.slice.island}, slice={self.slice.key})")


def put(value: Any, slice: VirtualSlice, spec: P | None = None) -> Array:  # noqa: A002
    """Copy a host value onto a slice, sharded by ``spec`` (replicated by default)."""
    session = current()
    if not isinstance(slice, VirtualSlice):
        raise ProgramError(f"pw.put needs a VirtualSlice from pw.slice(...), got {type(slice).__name__}")
    if slice.released:
        raise ProgramError(f"{slice} was released; allocate a new slice")
    if isinstance(value, Array):
        raise ProgramError("pw.put got a pw.Array; use it directly, or fetch it first with np.asarray")
    spec = P() if spec is None else spec
    array = np.asarray(value)
    if array.dtype == object:
        raise ProgramError(f"pw.put needs a numeric array, got {type(value).__name__} of objects")
    dtype = jax.dtypes.canonicalize_dtype(array.dtype)
    array = np.asarray(array, dtype=dtype, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    check_spec(spec, array.shape, slice.shape, slice.axis_names, "pw.put")
    buffer_id = session.mint()
    aval = Aval(tuple(array.shape), dtype.name)
    if len(slice.hosts) == 1:
        refs = [ray.put(array)]
        per_host = False
    else:  # scatter: each host of the slice receives only the shards its devices hold
        regions = owned_regions(array.shape, slice.desc(), spec)
        refs = [ray.put({index: np.asarray(array[tuple(np.s_[a:b] for a, b in index)], order="C")
                         for index in regions[h]}) for h in slice.hosts]
        per_host = True
    msg = Put(buffer_id, slice.desc(), spec_of(spec_to_wire(spec)), aval, per_host)
    session.submit(slice.island, msg.encode(), refs)
    return Array(session, buffer_id, array.shape, dtype, slice, spec, frozenset({slice.island}),
                 session.epoch(slice.island))


def owned_regions(shape: tuple[int, ...], desc: SliceDesc, spec: P) -> dict[int, set]:
    """The distinct regions each host of a slice holds."""
    out: dict[int, set] = {}
    for (host, _), index in zip(desc.devices, device_indices(shape, desc, spec)):
        out.setdefault(host, set()).add(index)
    return out


def ensure_arrays(values: list, what: str) -> None:
    for v in values:
        if not isinstance(v, Array):
            raise ProgramError(f"{what} takes pw.Array arguments; got {type(v).__name__}. Use pw.put(value, slice)")
        if v._session.closed:
            raise PathwaysError(f"{v} belongs to a session that was shut down")
