"""What travels on a data connection, byte by byte, and how shards are cut into chunks. Pure: no sockets.

A connection starts with a mutual handshake over a secret every host of the runtime holds (HMAC-SHA256 over
both sides' fresh nonces and identities), so a server accepts data only from the runtime's own hosts and a
sender gives data only to the host it meant (an address taken over by another process fails the check).
Then the sender writes data frames, one per chunk::

    magic "PWD1" | header length (u32) | msgpack header | payload (header["length"] bytes)

The header names the receive (``key``, the buffer id the recv op writes), the shard (its region of the
global array), its dtype and total size, and which byte range of the shard this chunk carries. The
receiver's checks of a header (``check_header``) come before any allocation: a size that disagrees with the
shard's region, or exceeds a hard ceiling, ends the connection. A ``probe`` frame carries raw bytes to be
landed and acknowledged, to time the bare link.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from pathways.sharding import Index, dtype_from_wire

PROTOCOL = b"PWNET\x00\x01\x00"  # name and version, sent first by the server
NONCE_BYTES = 32
MAC_BYTES = 32
IDENTITY = struct.Struct("<ii")  # (island, host)
SERVER_HELLO = struct.Struct(f"<8s{NONCE_BYTES}s8s")  # protocol, nonce, identity
CLIENT_HELLO = struct.Struct(f"<8s8s{NONCE_BYTES}s{MAC_BYTES}s")  # protocol, identity, nonce, mac
FRAME = struct.Struct("<4sI")  # magic, header length
MAGIC = b"PWD1"
MAX_HEADER_BYTES = 4096
MAX_NDIM = 32
ACK = b"\x06"

Identity = tuple[int, int]  # (island, host)


class ProtocolError(Exception):
    """A peer broke the protocol (bad handshake, malformed or absurd frame): its connection is closed."""


def pack_identity(identity: Identity) -> bytes:
    """A host's (island, host) as the handshake's fixed 8 bytes."""
    return IDENTITY.pack(*identity)


def unpack_identity(data: bytes) -> Identity:
    """The (island, host) in a handshake's 8 identity bytes."""
    island, host = IDENTITY.unpack(data)
    return island, host


def client_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes, client: Identity, server: Identity) -> bytes:
    """What the connecting host proves: it holds the secret, now, as ``client``, talking to ``server``."""
    msg = b"client" + server_nonce + client_nonce + pack_identity(client) + pack_identity(server)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def server_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes, client: Identity, server: Identity) -> bytes:
    """What the accepting host proves back, so a sender never streams data to an impostor."""
    msg = b"server" + client_nonce + server_nonce + pack_identity(server) + pack_identity(client)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    """Whether two MACs are equal; compares in constant time."""
    return hmac.compare_digest(a, b)


class Accepting:
    """The server's half of one data connection's handshake as a value that does no I/O (run by
    ``resource_manager.doorway``): the greeting, the bytes it then waits for, and the verdict, which is the host
    the peer proved to be."""

    expect = CLIENT_HELLO.size

    def __init__(self, secret: bytes, identity: Identity) -> None:
        self._secret, self._identity = secret, identity
        self._nonce = os.urandom(NONCE_BYTES)
        self.greeting = SERVER_HELLO.pack(PROTOCOL, self._nonce, pack_identity(identity))

    def finish(self, answer: bytes) -> tuple[bytes, Identity]:
        """The server's proof and the peer's identity; ProtocolError if the peer did not prove it holds the secret."""
        protocol, ident, client_nonce, mac = CLIENT_HELLO.unpack(answer)
        if protocol != PROTOCOL:
            raise ProtocolError(f"speaks protocol {protocol!r}, not {PROTOCOL!r}")
        peer = unpack_identity(ident)
        if not macs_equal(mac, client_mac(self._secret, self._nonce, client_nonce, peer, self._identity)):
            raise ProtocolError(f"failed authentication (claimed to be host {peer[1]} of island {peer[0]})")
        return server_mac(self._secret, self._nonce, client_nonce, peer, self._identity), peer


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
    """A data frame's prefix and header: ``length`` bytes at ``offset`` of shard ``shard`` of receive ``key``."""
    body = msgpack.packb({"key": key, "shard": [list(r) for r in shard], "dtype": dtype, "total": total,
                          "offset": offset, "length": length})
    return FRAME.pack(MAGIC, len(body)) + body


def encode_probe(nbytes: int) -> bytes:
    """A probe frame's prefix and header: ``nbytes`` raw bytes follow, to be landed and acknowledged."""
    body = msgpack.packb({"probe": nbytes})
    return FRAME.pack(MAGIC, len(body)) + body


def header_length(prefix: bytes) -> int:
    """The msgpack header's length from a frame's fixed prefix; a wrong magic or absurd length is fatal."""
    magic, length = FRAME.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a data frame (magic {magic!r})")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ProtocolError(f"a frame header of {length} bytes (at most {MAX_HEADER_BYTES})")
    return length


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
