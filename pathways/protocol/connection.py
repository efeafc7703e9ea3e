"""A connection of the client protocol: a TCP socket that speaks the handshake, then frames.

Both sides use it: ``connect`` is the client's half of the handshake, ``accept`` the endpoint's. After it,
``send`` writes one frame (any thread; frames never interleave) and ``recv`` reads the next one (one reader
thread), checking its sequence number, lengths and MAC before the payload is returned; the frame's data is then
read by the caller straight into a buffer of its choosing (``read_into``) or dropped (``skip``), so array bytes
are copied once, from the socket into their destination.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways.errors import PathwaysError
from pathways.protocol import frames, handshake
from pathways.protocol.address import parse_address
from pathways.protocol.handshake import HandshakeError, Identity

CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 60.0  # a peer that takes no bytes for this long is gone: the send fails and the connection ends
SEND_CHUNK = 1 << 30  # sendmsg takes at most this many bytes per call


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the other side closed the connection")
        view = view[n:]


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``."""
    buf = bytearray(n)
    recv_exactly(sock, memoryview(buf))
    return bytes(buf)


def keepalive(sock: socket.socket) -> None:
    """Probe an idle connection, so one to a machine that vanished without a reset ends within a minute; send
    small frames at once; give up a send the peer does not take within ``SEND_TIMEOUT_S``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = int(SEND_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _bytes_view(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):  # any dtype, bfloat16 included, as its raw bytes (C-contiguous arrays only)
        if not buf.flags.c_contiguous:
            raise ValueError("only C-contiguous arrays go on the wire without a copy")
        return memoryview(buf.reshape(-1).view(np.uint8))
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True)
class Frame:
    """A frame whose head and payload passed their checks; ``data`` bytes follow it on the socket."""

    payload: bytes
    data: int


class Connection:
    """One authenticated connection (or an anonymous one to the resource manager, until a session upgrades it).

    ``outgoing``/``incoming`` are the directions of this side's frames (``frames.TO_SERVER`` or ``TO_CLIENT``);
    ``max_payload``/``max_data`` are the ceilings for what this side accepts.
    """

    def __init__(self, sock: socket.socket, key: bytes | None, outgoing: bytes, incoming: bytes, peer: Identity | None,
                 session: int, max_payload: int, max_data: int, nonces: tuple[bytes, bytes, bytes] = (b"", b"", b"")):
        self.sock = sock
        self._key = key
        self._out, self._in = outgoing, incoming
        self.peer = peer  # the endpoint (on the client side)
        self.session = session
        self.max_payload, self.max_data = max_payload, max_data
        self._nonces = nonces  # server nonce, client nonce, identity bytes: what an upgrade derives the key from
        self._send_lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self.closed = False

    @property
    def authenticated(self) -> bool:
        """Whether frames carry MACs under a session's key (False on an anonymous connection)."""
        return self._key is not None

    def upgrade(self, session: int, session_key: bytes) -> None:
        """Switch an anonymous connection to ``session``'s key: every later frame, both ways, is authenticated."""
        server_nonce, client_nonce, identity = self._nonces
        self._key = handshake.connection_key(session_key, server_nonce, client_nonce, identity, session)
        self.session = session

    # -- sending ------------------------------------------------------------------------------------------
    def send(self, payload: bytes, data: Sequence[Any] = ()) -> None:
        """Write one frame: ``payload`` (a wire message) and ``data`` (buffers, written back to back). Raises
        ConnectionError (OSError) when the connection is gone."""
        views = [_bytes_view(d) for d in data]
        nbytes = sum(len(v) for v in views)
        with self._send_lock:
            if self.closed:
                raise ConnectionError("the connection is closed")
            self._sent += 1
            buffers = [frames.head(self._key, self._out, self._sent, payload, nbytes), payload, *views]
            try:
                self._sendmsg(buffers)
            except BaseException:
                self.closed = True  # a frame cut short leaves the stream unreadable: nothing may follow it
                raise

    def _sendmsg(self, buffers: list) -> None:
        views = [memoryview(b) for b in buffers if len(b)]
        while views:
            batch, size = [], 0
            for v in views:
                if size + len(v) > SEND_CHUNK and batch:
                    break
                batch.append(v)
                size += len(v)
            sent = self.sock.sendmsg(batch)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # -- receiving ----------------------------------------------------------------------------------------
    def recv(self) -> Frame:
        """The next frame's payload, checked; its ``data`` bytes are still on the socket (``read_into``/``skip``).
        FrameError for a frame that fails a check, ConnectionError when the other side closed."""
        raw = recv_bytes(self.sock, frames.HEAD_BYTES)
        payload_len, data_len, prefix, got = frames.parse_head(raw, self._received + 1, self.max_payload,
                                                               self.max_data)
        payload = recv_bytes(self.sock, payload_len)
        frames.check_mac(self._key, self._in, prefix, payload, got)
        self._received += 1
        return Frame(payload, data_len)

    def read_into(self, view: memoryview) -> None:
        """Read the next ``len(view)`` data bytes into ``view``."""
        recv_exactly(self.sock, _bytes_view(view))

    def skip(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` data bytes (of a frame refused after its payload was read)."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            n = min(nbytes, len(scratch))
            recv_exactly(self.sock, scratch[:n])
            nbytes -= n

    def close(self) -> None:
        """Shut the connection down (idempotent); a reader blocked in ``recv`` gets ConnectionError."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- the client's half ------------------------------------------------------------------------------------

def connect(address: str, session: int, key: bytes | None, expect: Callable[[Identity], None], max_payload: int,
            max_data: int, timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """Connect to the endpoint at ``address`` as ``session`` (0 and no key: anonymous), check that its identity
    is the one ``expect`` accepts (it raises otherwise), and prove the session both ways.

    Raises PathwaysError when nothing answers there within ``timeout``, HandshakeError when the endpoint is not
    the one expected or not a pathways endpoint, TenantAccessError when it refuses the session."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise PathwaysError(f"nothing answers at {address} ({exc.strerror or exc}); is the runtime up? "
                            "(`pathways status`, or the address `pathways up` printed)") from None
    try:
        sock.settimeout(handshake.TIMEOUT_S)
        tag, server_nonce, id_len = handshake.SERVER_HELLO.unpack(recv_bytes(sock, handshake.SERVER_HELLO.size))
        handshake.check_tag(tag)
        if id_len > handshake.MAX_IDENTITY:
            raise HandshakeError(f"the endpoint sent an identity of {id_len} bytes")
        id_bytes = recv_bytes(sock, id_len)
        identity = Identity.decode(id_bytes)
        expect(identity)
        client_nonce = handshake.new_nonce()
        proof = bytes(handshake.PROOF_BYTES) if key is None else handshake.client_proof(
            key, server_nonce, client_nonce, id_bytes, session)
        sock.sendall(handshake.CLIENT_HELLO.pack(handshake.TAG, client_nonce, session, proof))
        status = recv_bytes(sock, 1)
        if status == handshake.REFUSED:
            reason = recv_bytes(sock, int.from_bytes(recv_bytes(sock, 2), "little")).decode(errors="replace")
            raise handshake.refused_error(reason)
        answer = recv_bytes(sock, handshake.PROOF_BYTES)
        conn_key = None
        if key is not None:
            if not hmac.compare_digest(answer, handshake.server_proof(key, server_nonce, client_nonce, id_bytes,
                                                                      session)):
                raise HandshakeError(f"{address} failed to prove it is {identity.describe()} of this runtime")
            conn_key = handshake.connection_key(key, server_nonce, client_nonce, id_bytes, session)
        sock.settimeout(None)
        keepalive(sock)
        return Connection(sock, conn_key, frames.TO_SERVER, frames.TO_CLIENT, identity, session, max_payload,
                          max_data, (server_nonce, client_nonce, id_bytes))
    except (OSError, ValueError) as exc:
        sock.close()
        raise PathwaysError(f"the handshake with {address} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise


# -- the endpoint's half ----------------------------------------------------------------------------------

def accept(sock: socket.socket, identity: Identity, session_key: Callable[[int], bytes | None], anonymous: bool,
           max_payload: int, max_data: int) -> Connection:
    """Run the endpoint's half of the handshake on a freshly accepted socket: a client must prove a session
    ``session_key`` knows (or come anonymously, where ``anonymous`` allows). Refuses with a reason that names
    no one; raises HandshakeError (or OSError) after refusing. The socket is left blocking, without a timeout."""
    sock.settimeout(handshake.TIMEOUT_S)
    server_nonce = handshake.new_nonce()
    id_bytes = identity.encode()
    sock.sendall(handshake.SERVER_HELLO.pack(handshake.TAG, server_nonce, len(id_bytes)) + id_bytes)
    tag, client_nonce, session, proof = handshake.CLIENT_HELLO.unpack(recv_bytes(sock, handshake.CLIENT_HELLO.size))
    handshake.check_tag(tag)
    if session == handshake.ANONYMOUS:
        if not anonymous:
            sock.sendall(handshake.refusal("this endpoint takes only sessions the resource manager opened"))
            raise HandshakeError("an anonymous client")
        sock.sendall(handshake.OK + bytes(handshake.PROOF_BYTES))
        conn_key = None
    else:
        key = session_key(session)
        if key is None or not hmac.compare_digest(proof, handshake.client_proof(key, server_nonce, client_nonce,
                                                                                  id_bytes, session)):
            sock.sendall(handshake.refusal("unknown or expired session (it was closed, reclaimed, or never opened "
                                           "here); call pw.init() again"))
            raise HandshakeError(f"a client failed to prove session {session}")
        sock.sendall(handshake.OK + handshake.server_proof(key, server_nonce, client_nonce, id_bytes, session))
        conn_key = handshake.connection_key(key, server_nonce, client_nonce, id_bytes, session)
    sock.settimeout(None)
    keepalive(sock)
    return Connection(sock, conn_key, frames.TO_CLIENT, frames.TO_SERVER, None, session, max_payload, max_data,
                      (server_nonce, client_nonce, id_bytes))
