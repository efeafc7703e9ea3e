"""What travels on a data connection, and how shards are cut into chunks. Pure: no sockets.

A data connection speaks the client protocol's handshake and framing (``pathways.protocol``): the server greets
as the data server of host ``(island, host)`` (role ``data``), and the sending host proves a session that names
it (``session_of``) under a key only holders of the runtime's secret can derive for it (``host_key``); the server
proves the same key back, so a server accepts data only from the runtime's own hosts and a sender gives data only
to the host it meant (an address taken over by another process fails the check). Both then share a key for this
connection, and every frame carries a sequence number and a MAC under it (``pathways.protocol.frames``), so a
frame cannot be forged, replayed or moved to another connection. A data frame's payload is a msgpack header::

    {"key", "shard", "dtype", "total", "offset", "length"}

naming the receive (``key``, the buffer id the recv op writes), the shard (its region of the global array), its
dtype and total size, and which byte range of the shard the frame's data carries. The receiver's checks of a
header (``decode_header``) come before any allocation: a size that disagrees with the shard's region, or exceeds
a hard ceiling, ends the connection. A ``probe`` frame carries raw bytes to be landed and acknowledged, to time
the bare link.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from pathways.protocol import handshake
from pathways.sharding import Index, dtype_from_wire

ROLE = "data"  # a data server's role in its handshake identity
RUNTIME = "pathways-data"  # its runtime field: the runtime is the secret both sides hold
IDENTITY = struct.Struct("<ii")  # (island, host), as a host's key is derived over it
HOST_BITS = 32  # a session id is 1 + (island << HOST_BITS) + host: never 0, the anonymous session
MAX_HEADER_BYTES = 4096
MAX_NDIM = 32
ACK = msgpack.packb({"ack": True})

Identity = tuple[int, int]  # (island, host)


class ProtocolError(Exception):
    """A peer broke the protocol (bad handshake, malformed or absurd frame): its connection is closed."""


def session_of(host: Identity) -> int:
    """The session id a sending host proves in the handshake: it names the host."""
    island, index = host
    if not (0 <= island < 1 << 31 and 0 <= index < 1 << HOST_BITS - 1):
        raise ValueError(f"no session names host {index} of island {island}")
    return 1 + (island << HOST_BITS) + index


def host_of(session: int) -> Identity | None:
    """The host a session id names (``session_of``'s inverse), or None for an id no host's session has."""
    rest = session - 1
    island, index = rest >> HOST_BITS, rest & ((1 << HOST_BITS) - 1)
    return (island, index) if 0 <= island < 1 << 31 and index < 1 << HOST_BITS - 1 else None


def host_key(secret: bytes, host: Identity) -> bytes:
    """The key host ``host`` proves its session with: derived from the runtime's secret, for that host alone."""
    return hmac.new(secret, b"pathways-data-host" + IDENTITY.pack(*host), hashlib.sha256).digest()


def server_identity(host: Identity) -> handshake.Identity:
    """What the data server of ``host`` says it is in the handshake."""
    return handshake.Identity(RUNTIME, ROLE, host[0], host[1])


def accepting(secret: bytes, host: Identity) -> handshake.Accepting:
    """The data server's half of one handshake (run by ``resource_manager.doorway``): any runtime host may prove
    itself, under the key the secret derives for the host its session names."""
    def session_key(session: int) -> bytes | None:
        peer = host_of(session)
        return None if peer is None else host_key(secret, peer)

    return handshake.Accepting(server_identity(host), session_key, anonymous=False)


# -- data frames ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """One data frame's header, checked: the bytes ``offset:offset+length`` of shard ``shard`` of receive ``key``."""

    key: int
    shard: Index
    dtype: np.dtype
    total: int
    offset: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shard's shape."""
        return tuple(b - a for a, b in self.shard)


def encode_header(key: int, shard: Index, dtype: str, total: int, offset: int, length: int) -> bytes:
    """A data frame's payload: its data is ``length`` bytes at ``offset`` of shard ``shard`` of receive ``key``."""
    return msgpack.packb({"key": key, "shard": [list(r) for r in shard], "dtype": dtype, "total": total,
                          "offset": offset, "length": length})


def encode_probe(nbytes: int) -> bytes:
    """A probe frame's payload: its data is ``nbytes`` raw bytes, to be landed and acknowledged."""
    return msgpack.packb({"probe": nbytes})


def _int(body: dict, name: str, low: int = 0) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ProtocolError(f"frame field {name!r} must be an integer >= {low}, got {value!r}")
    return value


def decode_header(raw: bytes, ceiling: int) -> Header | int:
    """A checked data header, or the byte count of a probe frame. Raises ProtocolError for anything the
    runtime's own senders never write: then the connection is dropped before a byte is allocated."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame header: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("a frame header must be a map")
    if "probe" in body:
        nbytes = _int(body, "probe", 1)
        if nbytes > ceiling:
            raise ProtocolError(f"a probe of {nbytes} bytes is over the ceiling of {ceiling}")
        return nbytes
    key, total, offset, length = (_int(body, "key"), _int(body, "total", 1), _int(body, "offset"),
                                  _int(body, "length", 1))
    shard = body.get("shard")
    if (not isinstance(shard, list) or len(shard) > MAX_NDIM or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            and 0 <= r[0] < r[1] for r in shard)):
        raise ProtocolError(f"frame field 'shard' must be a list of [start, stop) ranges, got {shard!r}")
    index = tuple((a, b) for a, b in shard)
    try:
        dtype = dtype_from_wire(body.get("dtype"))
    except Exception:  # numpy and ml_dtypes raise TypeError or others on unknown names
        raise ProtocolError(f"frame field 'dtype' names no dtype: {body.get('dtype')!r}") from None
    if total > ceiling:
        raise ProtocolError(f"a shard of {total} bytes is over the ceiling of {ceiling} bytes")
    expected = math.prod(b - a for a, b in index) * dtype.itemsize
    if total != expected:
        raise ProtocolError(f"shard {index} of {dtype.name} is {expected} bytes but the frame says {total}")
    if offset + length > total:
        raise ProtocolError(f"bytes {offset}:{offset + length} of a {total}-byte shard")
    return Header(key, index, dtype, total, offset, length)


# -- chunking ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Bytes ``offset:offset+length`` of piece ``piece`` (an index into the pieces of one send)."""

    piece: int
    offset: int
    length: int


def chunks(sizes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Each piece of ``sizes`` bytes cut into chunks of at most ``chunk_bytes``, in order (an empty piece has
    none: empty arrays do not take this path)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [Chunk(i, off, min(chunk_bytes, size - off)) for i, size in enumerate(sizes)
            for off in range(0, size, chunk_bytes)]


def stream_count(total: int, streams: int, min_bytes_per_stream: int) -> int:
    """How many connections one send uses: more only when each gets at least ``min_bytes_per_stream``."""
    return max(1, min(streams, total // max(1, min_bytes_per_stream)))


def as_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes, without a copy (for any dtype, bfloat16 included)."""
    if not array.flags.c_contiguous:
        raise ValueError("only C-contiguous arrays go on the wire without a copy")
    return memoryview(array.reshape(-1).view(np.uint8))
