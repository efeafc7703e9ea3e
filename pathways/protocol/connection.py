"""A connection of the client protocol: a TCP socket that speaks the handshake, then frames.

Both sides use it: ``connect`` is the client's half of the handshake; ``adopt`` takes over a socket whose client
proved itself in the endpoint's half (``handshake.Accepting``, run by ``resource_manager.doorway``). After it,
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pathways.errors import PathwaysError
from pathways.protocol import frames, handshake
from pathways.protocol.address import parse_address
from pathways.protocol.handshake import HandshakeError, Identity, Proven

CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 60.0  # a peer that takes no bytes for this long is gone: the send fails and the connection ends
SEND_CHUNK = 1 << 30  # sendmsg takes at most this many bytes per call
ANONYMOUS_PAYLOAD = 64 << 10  # a message on a connection without a session (a credential-carrying request)
METERED = 64 << 10  # a message over this many bytes is read within its tenant's frame_bytes budget
READ_CHUNK = 1 << 20  # a large message is taken in pieces of this size as its bytes arrive, never all at once


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the other side closed the connection")
        view = view[n:]


def recv_bytes(sock: socket.socket, n: int) -> bytes | bytearray:
    """Exactly ``n`` bytes from ``sock``. A large ``n`` is taken into a buffer that grows (at most twice) ahead of
    the bytes that arrived, so memory follows what a peer really sent, not the length it announced; the buffer is
    one block, handed back to the system whole when it is dropped."""
    if n <= READ_CHUNK:
        buf = bytearray(n)
        recv_exactly(sock, memoryview(buf))
        return bytes(buf)
    buf, got = bytearray(READ_CHUNK), 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n, 2 * got) - got))
        view = memoryview(buf)[got:]
        k = sock.recv_into(view)
        view.release()
        if k == 0:
            raise ConnectionError("the other side closed the connection")
        got += k
    return buf


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


class Meter(Protocol):
    """Where a connection's large messages are counted while they are read (its tenant's ``frame_bytes``)."""

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` more; FrameError (an ``OverBudget``) if that is over the budget."""

    def give(self, nbytes: int) -> None:
        """``nbytes`` were read (or given up): they no longer count."""


@dataclass(frozen=True)
class Frame:
    """A frame whose head and payload passed their checks; ``data`` bytes follow it on the socket."""

    payload: bytes | bytearray
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
        self.meter: Meter | None = None  # set by an endpoint, for the tenant the connection belongs to
        self.active = time.monotonic()  # when the last message arrived (the least recently active gives way first)
        self.busy = False  # a message was read and its reader has not asked for the next one yet

    @property
    def authenticated(self) -> bool:
        """Whether frames carry MACs under a session's key (False on an anonymous connection)."""
        return self._key is not None

    def upgrade(self, session: int, session_key: bytes, max_payload: int | None = None) -> None:
        """Switch an anonymous connection to ``session``'s key: every later frame, both ways, is authenticated (and
        the endpoint's side may then take messages of up to ``max_payload`` bytes)."""
        server_nonce, client_nonce, identity = self._nonces
        self._key = handshake.connection_key(session_key, server_nonce, client_nonce, identity, session)
        self.session = session
        if max_payload is not None:
            self.max_payload = max_payload

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
                total = frames.HEAD_BYTES + len(payload) + nbytes
                sent = self.sock.sendmsg(buffers) if total <= SEND_CHUNK else 0  # the usual frame: one call, whole
                if sent != total:
                    self._sendmsg(buffers, sent)
            except BaseException:
                self.closed = True  # a frame cut short leaves the stream unreadable: nothing may follow it
                raise

    def _sendmsg(self, buffers: list, done: int) -> None:
        """Write what is left of ``buffers`` after their first ``done`` bytes, in calls of at most ``SEND_CHUNK``."""
        views = [memoryview(b) for b in buffers if len(b)]
        while True:
            while done:
                if done >= len(views[0]):
                    done -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][done:]
                    done = 0
            if not views:
                return
            batch, size = [], 0
            for v in views:
                if size + len(v) > SEND_CHUNK and batch:
                    break
                batch.append(v)
                size += len(v)
            done = self.sock.sendmsg(batch)

    # -- receiving ----------------------------------------------------------------------------------------
    def recv(self) -> Frame:
        """The next frame's payload, checked; its ``data`` bytes are still on the socket (``read_into``/``skip``).
        FrameError for a frame that fails a check, ConnectionError when the other side closed."""
        frame = self.next()
        if frame is None:
            raise ConnectionError("the other side closed the connection")
        return frame

    def next(self) -> Frame | None:
        """As ``recv``, but None when the other side closed the connection between frames (a clean end; closing
        within a frame is ConnectionError)."""
        self.busy = False
        head = bytearray(frames.HEAD_BYTES)
        view = memoryview(head)
        first = self.sock.recv_into(view)
        if first == 0:
            return None
        recv_exactly(self.sock, view[first:])
        view.release()
        payload_len, data_len, prefix, got = frames.parse_head(bytes(head), self._received + 1, self.max_payload,
                                                               self.max_data)
        meter = self.meter if payload_len > METERED else None
        if meter is None:
            payload = recv_bytes(self.sock, payload_len)
        else:
            meter.take(payload_len)
            try:
                payload = recv_bytes(self.sock, payload_len)
            finally:
                meter.give(payload_len)
        frames.check_mac(self._key, self._in, prefix, payload, got)
        self._received += 1
        self.active = time.monotonic()
        self.busy = True
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

def adopt(sock: socket.socket, proven: Proven, max_payload: int, max_data: int) -> Connection:
    """The connection on ``sock``, whose client proved ``proven`` in the endpoint's handshake
    (``handshake.Accepting``). An anonymous one reads messages of at most ``ANONYMOUS_PAYLOAD`` bytes until a
    session upgrades it."""
    sock.setblocking(True)
    keepalive(sock)
    conn = Connection(sock, proven.key, frames.TO_CLIENT, frames.TO_SERVER, None, proven.session, max_payload,
                      max_data, proven.nonces)
    if proven.key is None:
        conn.max_payload = min(max_payload, ANONYMOUS_PAYLOAD)
    return conn
