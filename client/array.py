"""``pw.Array``: a handle (future) to an array resident on an island's hosts.

The buffers never leave the island unless fetched. Dropping the last
reference frees them (in batches, ordered after every fragment already sent).
A handle reads like a read-only ``jax.Array`` (shape, dtype, sharding,
``np.asarray``, ``float()``, ``len``, ...); reading its contents fetches them
once and keeps them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from client.host_values import HostData, KeyInfo, as_host_data, dtype_name, physical
from client.interop import LocalArrayMethods, asked_by_jax, called_by_device_get, local_value, register
from client.meshes import placement, spec_leaves
from client.session import Session, current
from client.slices import VirtualSlice
from pathways.errors import ClusterSuspendedError, IslandFailedError, PathwaysError, ProgramError
from pathways.messages import Put
from pathways.ops import Aval, SliceDesc, spec_of
from pathways.protocol.connection import Connection
from pathways.requests import Fetch, PutData
from pathways.sharding import check_spec, device_indices, fits, norm_spec, spec_to_wire


class Array(LocalArrayMethods):
    """A future for an array on a virtual slice, sharded by ``spec``.

    It behaves like a read-only ``jax.Array`` where that makes sense without
    moving data: ``shape``, ``dtype``, ``ndim``, ``size``, ``nbytes``,
    ``sharding`` and ``weak_type`` are known at once; ``np.asarray(x)``,
    ``jax.device_get(x)``, ``float(x)``/``int(x)``/``bool(x)`` (0-d arrays)
    fetch the value. A typed PRNG key array keeps its key dtype and fetches as
    a ``jax.Array`` of keys. Where JAX code in the client takes a ``jax.Array``
    (``jnp`` functions, operators, ``jax.jit``, ``f"{x:.3f}"``), the value is
    fetched once and used as a local ``jax.Array`` (``client.interop``). An array
    donated to a ``pw.jit`` function (see ``donate_argnums``) is gone: any later
    use raises ``ProgramError``.
    """

    __slots__ = ("id", "shape", "dtype", "slice", "spec", "islands", "weak_type", "epoch", "_key", "_session",
                 "_value", "_local", "_refs", "_donated", "_signature", "__weakref__")

    def __init__(self, session: Session, buffer_id: int, shape: tuple[int, ...], dtype: Any,
                 slice: VirtualSlice, spec: P, islands: frozenset[int], *,  # noqa: A002
                 weak_type: bool = False, key: KeyInfo | None = None, epoch: int | None = None,
                 signature: object | None = None) -> None:
        self._session = session
        # the island's restart count when the buffer was made: a restart loses it
        self.epoch = session.epoch(slice.island) if epoch is None else epoch
        self.id = buffer_id
        self.shape = tuple(shape)
        self.dtype = key.dtype if key is not None else np.dtype(dtype)
        self.slice = slice
        self.spec = spec
        self.islands = islands  # every island its value depends on, for failure detection
        self.weak_type = weak_type
        self._key = key
        self._value: Any = None
        self._local: jax.Array | None = None  # the value as a local jax.Array, once JAX code in the client used it
        self._refs: list | None = None  # fetch requests already sent (copy_to_host_async)
        self._donated: str | None = None  # the function it was donated to
        self._signature = signature  # ``signature``, once asked (or known to its maker: a call's output)

    @property
    def signature(self) -> object:
        """What a traced program depends on about this argument (shape, dtype, weak type, slice and spec), as one
        token: equal for every array that traces the same, so an op-by-op call's trace is found by identity."""
        token = self._signature
        if token is None:
            token = self._signature = array_signature(self.shape, self.dtype, self.weak_type, self.slice, self.spec)
        return token

    def usable(self) -> bool:
        """Whether it can be an argument at once, without ``check_usable`` asking anything: not donated, its
        session open and its island not failed since it was made, its slice not released."""
        session = self._session
        return (self._donated is None and not session.closed and not self.slice.released
                and not session.islands.dead
                and (self._value is not None or session.epoch(self.slice.island) == self.epoch))

    # -- what is known without the value ----------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes the value takes on the island (for key arrays: their key data), as ``jax.Array.nbytes``."""
        shape, dtype = self.physical
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    @property
    def physical(self) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of the buffer on the island (a key array's uint32 data has trailing dims)."""
        return physical(self.shape, self.dtype)

    @property
    def sharding(self) -> NamedSharding | None:
        """A ``NamedSharding`` of ``spec`` over the slice's abstract mesh (axis names and sizes, no devices).

        JAX's own code, placing the array as an argument, sees None: it computes with the local copy."""
        if asked_by_jax():
            return None
        return NamedSharding(self.slice.abstract_mesh(), self.spec)

    def is_deleted(self) -> bool:
        """True once the array was donated to a function; its buffer is gone."""
        return self._donated is not None

    def _check_live(self, what: str) -> None:
        if self._donated is not None:
            raise ProgramError(
                f"{what} {self._describe()}: it was donated to {self._donated} (donate_argnums/donate_argnames), "
                "so its buffer was reused for that call's outputs. Use the outputs, or stop donating this argument")
        if self._session.closed:
            raise PathwaysError(
                f"{what} a pw.Array {dtype_name(self.dtype)}{list(self.shape)} after pw.shutdown(): its buffers "
                "were freed with the session that made it (arrays do not outlive their session). Fetch what you "
                "need before pw.shutdown() (np.asarray(x), jax.device_get(tree)); a value fetched before stays "
                "readable, and pw.put copies it into a new session")
        island = self.slice.island
        if island in self._session.islands.dead:
            self._session.refresh(island)  # it may have restarted meanwhile, with empty buffers
        if self._value is None and self._session.epoch(island) != self.epoch:
            raise IslandFailedError(f"{self._describe()} was lost: island {self.slice.island} restarted after it "
                                    "failed, with empty buffers (pw.status() says when and why); compute it again")

    def _describe(self) -> str:
        return f"pw.Array {dtype_name(self.dtype)}{list(self.shape)} (buffer {self.id})"

    # -- reading the value ------------------------------------------------------------------------
    def _send_fetch(self, timeout: float | None, ready_only: bool) -> tuple[list, float]:
        s = self._session
        t = s.timeouts.fetch if timeout is None else float(timeout)
        sink = None if ready_only else pieces_sink(*self.physical)
        return [s.ask(self.slice.island, h, lambda rid: Fetch(rid, self.id, t, ready_only), sink)
                for h in self.slice.hosts], t

    def _wait(self, futures: list, t: float) -> list:
        what = f"fetching {dtype_name(self.dtype)}{list(self.shape)} (buffer {self.id}) from island {self.slice.island}"
        # The hosts wait at most ``t`` for the buffer and then answer; the answer itself needs a round trip more,
        # so a value that is already there comes back even with timeout=0.
        return self._session.wait(futures, self.islands, t, what)

    def copy_to_host_async(self) -> None:
        """Start fetching the value without waiting (``jax.device_get`` calls this on every leaf first, so a
        tree of arrays is fetched in parallel)."""
        if self._value is not None:
            return
        self._check_live("fetching")
        if self._refs is None:
            self._refs, _ = self._send_fetch(None, ready_only=False)

    def fetch(self, timeout: float | None = None) -> Any:
        """The value as a read-only numpy array (a ``jax.Array`` of keys for a key array); blocks at most
        ``timeout`` seconds (the session's fetch timeout by default). The value is kept: fetching again is free,
        and works after ``pw.shutdown()``."""
        if self._value is not None:
            return self._value
        self._check_live("fetching")
        if self._value is None:
            refs, self._refs = self._refs, None
            parts = self._read(timeout, False, refs)
            data = assemble(self.physical, [piece for part in parts for piece in part])
            if self._key is not None:
                self._value = self._key.wrap(data)
            else:
                if data.flags.writeable:
                    data.flags.writeable = False  # like np.asarray of a jax.Array: the value is shared
                self._value = data
        return self._value

    def block_until_ready(self, timeout: float | None = None) -> Array:
        """Wait until the value is computed on the island, without moving it (as ``jax.Array.block_until_ready``)."""
        if self._value is None:
            self._check_live("waiting for")
            self._read(timeout, True, None)
        return self

    def _read(self, timeout: float | None, ready_only: bool, refs: list | None) -> list:
        """The hosts' answers to a fetch (``refs``: one already sent). A cluster suspended meanwhile is waited for
        (``pw.Timeouts.suspend``) and asked again once it resumes: the value was saved with it."""
        try:
            return self._wait(*self._sent(timeout, ready_only, refs))
        except ClusterSuspendedError:
            pass  # suspended while it waited: the value was saved with the cluster, so ask again once it resumes
        return self._wait(*self._sent(timeout, ready_only, None))

    def _sent(self, timeout: float | None, ready_only: bool, refs: list | None) -> tuple[list, float]:
        s = self._session
        if not s.gate.open:
            s.gate.wait_open(s.timeouts.suspend, f"fetching {self._describe()}")
        return (refs, s.timeouts.fetch) if refs is not None else self._send_fetch(timeout, ready_only)

    def __jax_array__(self) -> jax.Array:
        """The value as a local ``jax.Array`` (fetched once, then kept): what ``jnp`` functions, operators and
        ``jax.jit`` in the client compute with."""
        if self._local is None:
            value = self.fetch()
            self._local = value if self._key is not None else local_value(value, self.weak_type)
        return self._local

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.fetch()
        if self._key is not None:
            if called_by_device_get():
                return value  # jax.device_get gives a key array back as keys, as for a jax.Array of keys
            return np.asarray(value)  # raises JAX's TypeError, as np.asarray(jax.random.key(0)) does
        if dtype is not None and np.dtype(dtype) != value.dtype:
            return value.astype(dtype)
        return value.copy() if copy else value

    def __setitem__(self, index: Any, value: Any) -> None:
        """Replace the value on the island in place, as for a numpy array (Flax writes a Variable's value so:
        ``metrics.reset()``), where a ``jax.Array`` refuses it. ``x[...] = v`` needs no fetch; another index
        fetches ``x`` and sends the updated whole."""
        self._check_live("assigning to")
        if index is Ellipsis:
            new = jax.numpy.broadcast_to(jax.numpy.asarray(value, dtype=self.dtype), self.shape)
        else:
            new = self.__jax_array__().at[index].set(value)
        replacement = put_host(self._session, as_host_data(new, f"{self._describe()}[...] ="), self.slice,
                               self.spec, "item assignment")
        if not self._session.closed:
            self._session.frees.add(self.slice.island, self.id)  # ordered after every program that read it
        self.id, self.epoch, self.islands = replacement.id, replacement.epoch, replacement.islands
        self._value = self._local = self._refs = None
        replacement._donated = f"the pw.Array it was assigned to (buffer {self.id})"  # its buffer is ours now

    def _scalar(self, what: str) -> Any:
        if self.shape != ():
            raise TypeError(f"only 0-d arrays convert to a Python {what}; this pw.Array has shape {self.shape}")
        return self.fetch()[()]

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __complex__(self) -> complex:
        return complex(self._scalar("complex"))

    def __bool__(self) -> bool:
        return bool(self._scalar("bool"))

    def __index__(self) -> int:
        if self._key is not None or self.dtype.kind not in "iub":
            raise TypeError(f"only integer arrays can be used as an index; this pw.Array is {dtype_name(self.dtype)}")
        return int(self._scalar("int"))

    def item(self) -> Any:
        """The value of a 0-d array as a Python scalar."""
        return self._scalar("scalar").item()

    def tolist(self) -> Any:
        """The value as nested Python lists (fetches it)."""
        return self.fetch().tolist()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __del__(self) -> None:
        try:
            if self._donated is None and not self._session.closed:
                self._session.frees.add(self.slice.island, self.id)
        except Exception:  # interpreter shutdown: the cluster frees everything anyway
            pass

    def _settle(self) -> None:
        """The client knows this value was computed (it read a value computed from it on its island): from now
        on it depends on its own island alone, so waiting for it, or for values computed from it there, no
        longer fails because another island it once came from failed."""
        self.islands = frozenset({self.slice.island})

    def _donate(self, to: str) -> None:
        """The buffer was given to ``to``: free it now (the host drops it at the call, or, if it could not
        donate it, after the call) and refuse every later use."""
        if self._donated is None:
            self._donated = to
            self._value = self._local = None
            if not self._session.closed:
                self._session.frees.add(self.slice.island, self.id)

    def __repr__(self) -> str:
        where = f"spec={self.spec}, island={self.slice.island}, slice={self.slice.key}"
        if self._donated is not None:
            return f"pw.Array({dtype_name(self.dtype)}{list(self.shape)}, donated to {self._donated})"
        if self._value is not None and self._key is None:
            body = np.array2string(self._value, separator=", ", prefix="pw.Array(", threshold=40)
            return f"pw.Array({body}, dtype={dtype_name(self.dtype)}, {where})"
        return f"pw.Array({dtype_name(self.dtype)}{list(self.shape)}, {where})"


register(Array)


def _check_slice(slice: Any, what: str) -> None:  # noqa: A002
    if not isinstance(slice, VirtualSlice):
        raise ProgramError(f"{what} needs a VirtualSlice from pw.slice(...), got {type(slice).__name__}")
    if slice.released:
        raise ProgramError(f"{slice} was released; allocate a new slice")


def put(tree: Any, slice: VirtualSlice, specs: Any = None) -> Any:  # noqa: A002
    """Copy host values onto a slice: the same pytree, with a ``pw.Array`` for each leaf.

    Returns at once: the values travel in order with this client's later messages to the island, so a
    computation dispatched afterwards finds them. On a slice that spans several hosts, each host
    receives only the shards its devices hold. A leaf that is a ``pw.Array`` already is transferred
    (``pw.transfer``, one program for all of them) unless it lives on ``slice`` with that spec already, when
    it is returned as it is: ``pw.put`` (and ``jax.device_put``) of arrays that live on a slice moves them.

    Args:
        tree: an array, a scalar, or any pytree of them (a params dict, an optax state); leaves may be
            numpy arrays, Python or numpy scalars, ``jax.Array`` s, typed PRNG key arrays and ``pw.Array`` s.
            Dtypes are canonicalized as JAX does (float64 becomes float32 unless ``jax_enable_x64`` is on).
        slice: a ``pw.VirtualSlice`` that has not been released, or ``NamedSharding(s, spec)`` over one (its
            spec then applies to every leaf).
        specs: a PartitionSpec for every leaf, or a pytree prefix of ``tree`` with one per subtree; None (the
            default, or at any place in the prefix) means replicated for a host value and its own spec (where
            it fits the slice) for a ``pw.Array``.

    Returns:
        ``tree`` with each leaf replaced by a ``pw.Array`` future on ``slice``.

    Raises:
        ProgramError: ``slice`` is not a live slice; a leaf is not an array; a value does not fit its canonical
            dtype; or a spec does not match the tree, names an axis the slice lacks, or does not divide the
            array's shape.
    """
    session = current()
    slice, specs = placement(slice, specs, "pw.put")  # noqa: A001
    _check_slice(slice, "pw.put")
    spec_list = spec_leaves(specs, tree, "pw.put: specs")
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: list = []
    moves: list[tuple[int, Array, P]] = []
    for (path, leaf), spec in zip(paths, spec_list):
        what = "pw.put" + (f" of {jax.tree_util.keystr(path)}" if path else "")
        if isinstance(leaf, Array):
            own = leaf.spec if fits(leaf.spec, leaf.shape, slice.shape, slice.axis_names) else P()
            spec = own if spec is None else spec
            check_spec(spec, leaf.shape, slice.shape, slice.axis_names, what)
            out.append(leaf)
            if leaf.slice is not slice or norm_spec(leaf.spec) != norm_spec(spec):
                check_usable(leaf, what)
                moves.append((len(out) - 1, leaf, spec))
            continue
        out.append(put_host(session, as_host_data(leaf, what), slice, P() if spec is None else spec, what))
    if moves:
        from client.program import transfer_each  # the program layer sits above the arrays it moves

        for (k, _, _), moved in zip(moves, transfer_each([m[1] for m in moves], slice, [m[2] for m in moves])):
            out[k] = moved
    return jax.tree_util.tree_unflatten(treedef, out)


def put_host(session: Session, host: HostData, slice: VirtualSlice, spec: P, what: str) -> Array:  # noqa: A002
    """Send one converted host value to ``slice``, sharded by ``spec``: each host receives only its own shards,
    straight from this process, one piece per distinct device region (a device adopts its piece as is)."""
    check_spec(spec, host.shape, slice.shape, slice.axis_names, what)
    array = host.data
    mine = {h: sorted(index) for h, index in owned_regions(array.shape, slice.desc(), spec).items()}
    sizes = {(slice.island, h): array.itemsize * sum(math.prod(b - a for a, b in index) for index in indices)
             for h, indices in mine.items()}
    session.parked.make_room(sizes, what)  # outside the gate: a suspension need not wait for this
    with session.gate.sending(session.timeouts.suspend, what):
        buffer_id = session.mint()
        for h in slice.hosts:
            datas = [np.ascontiguousarray(array[tuple(np.s_[a:b] for a, b in index)]) for index in mine[h]]
            upload = PutData(buffer_id, [[list(r) for r in index] for index in mine[h]], array.dtype.name)
            session.upload(slice.island, h, upload.encode(), datas)
        msg = Put(buffer_id, slice.desc(), spec_of(spec_to_wire(spec)), Aval(tuple(array.shape), array.dtype.name))
        session.submit(slice.island, msg.encode())
    out = Array(session, buffer_id, host.shape, host.dtype, slice, spec, frozenset({slice.island}),
                weak_type=host.weak_type, key=host.key)
    session.parked.sent(out, sizes)
    return out


def owned_regions(shape: tuple[int, ...], desc: SliceDesc, spec: P) -> dict[int, set]:
    """The distinct regions each host of a slice holds."""
    out: dict[int, set] = {}
    for (host, _), index in zip(desc.devices, device_indices(shape, desc, spec)):
        out.setdefault(host, set()).add(index)
    return out


_SIGNATURES: dict[tuple, object] = {}
MAX_SIGNATURES = 4096


def array_signature(shape: tuple[int, ...], dtype: Any, weak_type: bool, slice: VirtualSlice,  # noqa: A002
                    spec: P) -> object:
    """``Array.signature`` of an array of this shape (a tuple), dtype (an np.dtype, or a key dtype), weak type,
    slice and spec."""
    return signature_token(("array", shape, dtype, weak_type, slice.key, norm_spec(spec)))


def signature_token(signature: tuple) -> object:
    """One object per distinct argument signature (``Array.signature``)."""
    token = _SIGNATURES.get(signature)
    if token is None:
        if len(_SIGNATURES) >= MAX_SIGNATURES:
            _SIGNATURES.clear()  # tokens already handed out stay valid: a later equal signature only misses once
        token = _SIGNATURES[signature] = object()
    return token


def check_usable(value: Array, what: str) -> None:
    """Raise unless ``value`` can be an argument: not donated, its session open, its slice not released."""
    value._check_live(what)
    if value.slice.released:
        raise ProgramError(
            f"{what} a pw.Array {dtype_name(value.dtype)}{list(value.shape)} on slice {value.slice.key}, which was "
            "released: nothing runs on a released slice. The array stays fetchable until it is dropped; to "
            "compute with it, fetch it and pw.put it on a live slice (or pw.transfer it before the release)")


Piece = tuple[tuple[tuple[int, int], ...], np.ndarray]


def pieces_sink(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """How a fetch's answer is read: the regions the host names, each read straight off the connection into an
    array of its own (checked first against the array this handle stands for)."""

    def sink(value: Any, conn: Connection, nbytes: int) -> list[Piece]:
        if not isinstance(value, dict) or list(value.get("shape", ())) != list(shape) \
                or value.get("dtype") != np.dtype(dtype).name:
            raise PathwaysError(f"a host answered a fetch of {np.dtype(dtype).name}{list(shape)} with {value!r}")
        regions = [tuple((int(a), int(b)) for a, b in r) for r in value["pieces"]]
        sizes = [int(np.prod([b - a for a, b in r], dtype=np.int64)) * np.dtype(dtype).itemsize for r in regions]
        if sum(sizes) != nbytes or any(not 0 <= a < b <= n for r in regions for (a, b), n in zip(r, shape)):
            raise PathwaysError(f"a host's answer to a fetch names regions {regions} but carries {nbytes} bytes")
        out = []
        for region in regions:
            piece = np.empty([b - a for a, b in region], dtype)
            conn.read_into(memoryview(piece.reshape(-1).view(np.uint8)))
            out.append((region, piece))
        return out

    return sink


def assemble(physical: tuple[tuple[int, ...], np.dtype], pieces: list[Piece]) -> np.ndarray:
    """The whole array from the pieces its hosts sent (one that covers it all is used as it is)."""
    shape, dtype = physical
    whole = tuple((0, n) for n in shape)
    for region, piece in pieces:
        if region == whole:
            return piece
    data = np.empty(shape, dtype)
    covered = np.zeros(shape, bool) if pieces else None
    for region, piece in pieces:
        index = tuple(np.s_[a:b] for a, b in region)
        data[index] = piece
        covered[index] = True
    if covered is None or not covered.all():
        raise PathwaysError(f"the hosts' answers cover only part of a {dtype}{list(shape)} array")
    return data
