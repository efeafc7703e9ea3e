"""Every message after the handshake, byte by byte:

    payload length (u32) | data length (u64) | sequence number (u64) | MAC (32) | payload | data

The payload is one msgpack message of ``pathways.wire`` (versioned, validated on decode). The data is raw
bytes that travel beside it (array contents), laid out as the payload says. The sequence number starts at 1
in each direction of a connection and grows by one per frame. The MAC is an HMAC-SHA256 under the
connection's key (``handshake.connection_key``) over the direction, the fixed prefix and the payload, so a
frame cannot be replayed, reordered, reflected back or moved to another connection. Array bytes are not in
the MAC: their length and layout are, and the connection they arrive on is authenticated; the protocol does
not encrypt (run it on a private network, or through a tunnel, where the network is not trusted).

Lengths are checked against the receiver's ceilings before anything is allocated, and a large payload is counted
against its tenant's ``frame_bytes`` budget and taken in pieces as its bytes arrive.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from pathways.errors import PathwaysError

PREFIX = struct.Struct("<IQQ")
MAC_BYTES = 32
HEAD_BYTES = PREFIX.size + MAC_BYTES
NO_KEY_MAC = bytes(MAC_BYTES)  # the MAC field of an anonymous connection's frames
TO_SERVER, TO_CLIENT = b"c", b"s"
ONE_SHOT = 4096  # a payload up to this many bytes is MACed in one call (copied once, with its prefix, to do so)


class FrameError(PathwaysError):
    """A frame that its receiver must not trust: the connection is closed without reading further."""


class OverBudget(FrameError):
    """A frame its sender's tenant may not have read now (``error`` names the budget): the endpoint says so, then
    closes the connection, since the rest of the frame is never read."""

    def __init__(self, error: PathwaysError) -> None:
        super().__init__(str(error))
        self.error = error


def mac(key: bytes | None, direction: bytes, prefix: bytes, payload: bytes) -> bytes:
    """The MAC of one frame (zeros on an anonymous connection, whose requests carry their own credentials)."""
    if key is None:
        return NO_KEY_MAC
    if len(payload) <= ONE_SHOT:  # the usual small message: one call into C, twice as fast as building an HMAC
        return hmac.digest(key, direction + prefix + payload, "sha256")
    h = hmac.new(key, direction, hashlib.sha256)
    h.update(prefix)
    h.update(payload)
    return h.digest()


def head(key: bytes | None, direction: bytes, seq: int, payload: bytes, data_bytes: int) -> bytes:
    """The fixed prefix and MAC of a frame carrying ``payload`` and ``data_bytes`` of data."""
    prefix = PREFIX.pack(len(payload), data_bytes, seq)
    return prefix + mac(key, direction, prefix, payload)


def parse_head(raw: bytes, expected_seq: int, max_payload: int, max_data: int) -> tuple[int, int, bytes, bytes]:
    """(payload length, data length, prefix, MAC) of a frame's head; FrameError for a sequence number that is
    not the next one or a length over the receiver's ceilings."""
    prefix = raw[:PREFIX.size]
    payload_len, data_len, seq = PREFIX.unpack(prefix)
    if seq != expected_seq:
        raise FrameError(f"frame {seq} where frame {expected_seq} was due (a replayed or reordered frame)")
    if payload_len > max_payload:
        raise FrameError(f"a message of {payload_len} bytes, over this endpoint's limit of {max_payload}")
    if data_len > max_data:
        raise FrameError(f"{data_len} bytes of data, over this endpoint's limit of {max_data}")
    return payload_len, data_len, prefix, raw[PREFIX.size:]


def check_mac(key: bytes | None, direction: bytes, prefix: bytes, payload: bytes, got: bytes) -> None:
    """FrameError unless ``got`` is the frame's MAC under ``key``."""
    if not hmac.compare_digest(mac(key, direction, prefix, payload), got):
        raise FrameError("a frame failed its MAC (forged, replayed from another connection, or corrupted)")
