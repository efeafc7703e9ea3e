"""The first bytes of every client connection: who the endpoint is, which session the client holds, and the
key the two sides then share for this connection only.

    server -> client   TAG | server nonce (32) | identity length (u16) | identity (msgpack)
    client -> server   TAG | client nonce (32) | session id (u64) | proof (32)
    server -> client   OK | proof (32)          or   REFUSED | reason length (u16) | reason

The identity names the runtime (a random id per start), the endpoint's role (the resource manager, or host
``host`` of island ``island``) and its epoch (the island's restart count). The client checks it is the endpoint
it meant; its proof is an HMAC under its session key over both nonces, the identity and the session id, and the
server's proof answers with the same key, so neither side can be impersonated by a process without the key.
Session 0 is anonymous: only the resource manager takes it, for requests that carry a credential of their own
(opening a session, the admin's operations); opening a session upgrades that connection to the new key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from pathways.errors import PathwaysError, TenantAccessError

TAG = b"PWCP\x00\x02\x00\x00"  # the protocol's name and version
NONCE_BYTES = 32
PROOF_BYTES = 32
SERVER_HELLO = struct.Struct(f"<8s{NONCE_BYTES}sH")
CLIENT_HELLO = struct.Struct(f"<8s{NONCE_BYTES}sQ{PROOF_BYTES}s")
OK, REFUSED = b"\x00", b"\x01"
MAX_IDENTITY = 1024
ANONYMOUS = 0
TIMEOUT_S = 10.0  # the whole handshake, on either side


class HandshakeError(PathwaysError):
    """The other side is not the endpoint (or the client) it should be, or broke the handshake."""


@dataclass(frozen=True)
class Identity:
    """An endpoint of one runtime: the resource manager (``role`` "rm") or host ``host`` of island ``island``
    at restart ``epoch``."""

    runtime: str
    role: str
    island: int = -1
    host: int = -1
    epoch: int = 0

    def encode(self) -> bytes:
        """The identity's bytes, as the server sends them and both proofs cover them."""
        return msgpack.packb([self.runtime, self.role, self.island, self.host, self.epoch])

    @classmethod
    def decode(cls, data: bytes) -> Identity:
        """An identity from ``encode``'s bytes; HandshakeError for anything else."""
        try:
            runtime, role, island, host, epoch = msgpack.unpackb(data)
            if not (isinstance(runtime, str) and isinstance(role, str)
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in (island, host, epoch))):
                raise ValueError("wrong types")
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise HandshakeError(f"the endpoint sent an unreadable identity ({exc})") from None
        return cls(runtime, role, island, host, epoch)

    def describe(self) -> str:
        """The endpoint in words."""
        if self.role == "rm":
            return "the resource manager"
        return f"host {self.host} of island {self.island} (epoch {self.epoch})"


def new_nonce() -> bytes:
    """Fresh random bytes for one handshake."""
    return os.urandom(NONCE_BYTES)


def _mac(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes, session: int) -> bytes:
    msg = label + server_nonce + client_nonce + session.to_bytes(8, "little") + identity
    return hmac.new(key, msg, hashlib.sha256).digest()


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes, session: int) -> bytes:
    """What the client proves: it holds session ``session``'s key, now, talking to this endpoint."""
    return _mac(key, b"pathways-client", server_nonce, client_nonce, identity, session)


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes, session: int) -> bytes:
    """What the endpoint proves back, so a client never talks to an impostor."""
    return _mac(key, b"pathways-server", server_nonce, client_nonce, identity, session)


def connection_key(key: bytes, server_nonce: bytes, client_nonce: bytes, identity: bytes, session: int) -> bytes:
    """The key of this connection alone, derived from the session key and the handshake: every frame's MAC uses
    it, so a frame is worth nothing on any other connection."""
    return _mac(key, b"pathways-connection", server_nonce, client_nonce, identity, session)


@dataclass(frozen=True)
class Proven:
    """What a client proved in an endpoint's handshake: its session (``ANONYMOUS``: none) and this connection's key
    (None on an anonymous connection), with what a later upgrade to a session derives its key from."""

    session: int
    key: bytes | None
    nonces: tuple[bytes, bytes, bytes]  # server nonce, client nonce, identity bytes


class Refused(HandshakeError):
    """The endpoint refused the client; ``reply`` is what it sends back before closing (empty: nothing)."""

    def __init__(self, reason: str, reply: bytes = b"") -> None:
        super().__init__(reason)
        self.reply = reply


class Accepting:
    """The endpoint's half of one handshake as a value that does no I/O: the ``greeting`` it sends first, the
    ``expect`` bytes it then waits for, and ``finish``, its verdict on them. One thread can so run many handshakes
    side by side (``resource_manager.doorway``) without giving a thread to a peer that has not proven anything.

    ``session_key(session)`` is the key of a session the client may prove (None: unknown); ``anonymous`` lets a
    client without a session in (the resource manager's, for credential-carrying requests)."""

    expect = CLIENT_HELLO.size

    def __init__(self, identity: Identity, session_key: Callable[[int], bytes | None], anonymous: bool) -> None:
        self._session_key, self._anonymous = session_key, anonymous
        self._nonce = new_nonce()
        self._id_bytes = identity.encode()
        self.greeting = SERVER_HELLO.pack(TAG, self._nonce, len(self._id_bytes)) + self._id_bytes

    def finish(self, answer: bytes) -> tuple[bytes, Proven]:
        """The reply to the client's ``expect`` bytes and what they proved; Refused (with the reply that says why,
        naming no one) or HandshakeError otherwise."""
        tag, client_nonce, session, proof = CLIENT_HELLO.unpack(answer)
        check_tag(tag)
        nonces = (self._nonce, client_nonce, self._id_bytes)
        if session == ANONYMOUS:
            if not self._anonymous:
                raise Refused("an anonymous client", refusal("this endpoint takes only sessions the resource manager "
                                                             "opened"))
            return OK + bytes(PROOF_BYTES), Proven(ANONYMOUS, None, nonces)
        key = self._session_key(session)
        if key is None or not hmac.compare_digest(proof, client_proof(key, *nonces, session)):
            raise Refused(f"a client failed to prove session {session}", refusal(
                "unknown or expired session (it was closed, reclaimed, or never opened here); call pw.init() again"))
        return OK + server_proof(key, *nonces, session), Proven(session, connection_key(key, *nonces, session), nonces)


def check_tag(tag: bytes) -> None:
    """HandshakeError unless ``tag`` is this protocol at this version."""
    if tag != TAG:
        if tag[:4] == TAG[:4]:
            raise HandshakeError("the other side speaks another version of the pathways protocol; run the same "
                                 "pathways release on the client and the cluster")
        raise HandshakeError("the other side does not speak the pathways protocol (is the address the one "
                             "`pathways up` printed?)")


def refusal(reason: str) -> bytes:
    """The server's refusal: the status byte, then the reason (which names no one)."""
    text = reason.encode()[:4096]
    return REFUSED + len(text).to_bytes(2, "little") + text


def refused_error(reason: str) -> TenantAccessError:
    """The client-side error for an endpoint's refusal."""
    return TenantAccessError(f"the runtime refused the connection: {reason}")
