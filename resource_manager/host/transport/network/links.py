"""The sending side of the data path: a pool of authenticated connections per peer host, and chunked sends.

A send cuts its pieces into chunks and streams them over up to ``streams`` connections to the peer at once
(several flows fill a link one flow cannot; ``benchmarks/transfer_nodes.py --streams-sweep`` measures how
much each adds). Chunks go straight from the
pieces' memory (for a CPU ``jax.Array`` shard, ``np.asarray`` is the device buffer itself) to the socket:
no copy, no serialization. Connections are the client protocol's (``pathways.protocol.connection``), opened on
demand, authenticated (``frames``: the peer must prove it holds the runtime's secret too), and kept for the next
send; many sends may be in flight to one peer, each taking a free connection per stream.

A send that fails (connection refused or reset, peer not reading within ``send_timeout``) raises
``NetworkError`` after closing the connections it used, and leaves every other send alone; the caller then
falls back to Ray's object store.
"""

from __future__ import annotations

import queue
import select
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pathways.errors import PathwaysError
from pathways.protocol import connection
from pathways.protocol.connection import Connection
from pathways.protocol.frames import FrameError
from pathways.protocol.handshake import HandshakeError
from pathways.protocol.handshake import Identity as Endpoint
from pathways.sharding import Index
from resource_manager.host.transport.network import frames
from resource_manager.host.transport.network.frames import Identity, ProtocolError

CONNECT_TIMEOUT_S = 5.0  # a peer behind a firewall that drops packets fails over to Ray this fast


class NetworkError(OSError):
    """A send over the data path failed; the caller falls back to the object store."""


def connect(address: str, own: Identity, peer: Identity, secret: bytes, timeout: float,
            connect_timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """An authenticated connection to ``peer``'s data server at ``address`` (both sides prove the secret);
    ``timeout`` then bounds each write. ProtocolError when the other side is not that host or refuses this one,
    OSError when nothing answers."""

    def expect(identity: Endpoint) -> None:
        if (identity.role, identity.island, identity.host) != (frames.ROLE, *peer):
            raise HandshakeError(f"{address} is {identity.describe()} ({identity.role}), not the data server of "
                                 f"host {peer[1]} of island {peer[0]}")

    try:
        conn = connection.connect(address, frames.session_of(own), frames.host_key(secret, own), expect,
                                  frames.MAX_HEADER_BYTES, 0, timeout=connect_timeout)
    except PathwaysError as exc:
        if isinstance(exc, HandshakeError) or exc.__class__ is not PathwaysError:
            raise ProtocolError(str(exc)) from None
        raise ConnectionError(str(exc)) from None  # nothing answers there, or the handshake was cut
    conn.sock.settimeout(timeout)
    return conn


def _alive(conn: Connection) -> bool:
    """Whether an idle connection is still open: a server never writes on it, so anything readable means it
    closed (or reset), and the next write would be lost."""
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class Pace:
    """An optional cap on this host's outgoing bytes per second, shared by all its sends (0: none)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, nbytes: int) -> None:
        """Wait for this chunk's turn: chunks start ``nbytes / rate`` apart, whichever stream sends them."""
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now)
            self._free_at = start + nbytes / self.rate
        time.sleep(start - now)


class Link:
    """Up to ``streams`` connections to one peer: idle ones are reused, new ones opened while fewer exist."""

    def __init__(self, address: str, own: Identity, peer: Identity, secret: bytes, streams: int,
                 timeout: float) -> None:
        self.address, self.own, self.peer = address, own, peer
        self._secret = secret
        self.streams = streams
        self.timeout = timeout
        self._cond = threading.Condition()
        self._idle: list[Connection] = []
        self._open = 0
        self.opened = 0

    def acquire(self) -> Connection:
        """A connection to the peer: an idle one that is still open, else a new one while fewer than ``streams``
        exist; waits at most ``timeout`` for one to come free (then NetworkError)."""
        with self._cond:
            while not self._idle and self._open >= self.streams:
                if not self._cond.wait(timeout=self.timeout):
                    raise NetworkError(f"no free connection to {self.address} within {self.timeout:.0f}s")
            while self._idle:
                conn = self._idle.pop()
                if _alive(conn):
                    return conn
                self._open -= 1
                conn.close()
            self._open += 1
        try:
            conn = connect(self.address, self.own, self.peer, self._secret, self.timeout)
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise
        with self._cond:
            self.opened += 1
        return conn

    def release(self, conn: Connection, healthy: bool) -> None:
        """Give a connection back: kept for the next send if ``healthy``, else closed."""
        with self._cond:
            if healthy:
                self._idle.append(conn)
            else:
                self._open -= 1
            self._cond.notify()
        if not healthy:
            conn.close()

    def close(self) -> None:
        """Close the idle connections (those in use close when released unhealthy, or stay with their send)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.close()


class Links:
    """This host's connections to its peers, and sends over them.

    ``streams`` connections per peer at most; a send uses one more per ``min_stream_bytes`` it carries, up to
    that; chunks are ``chunk_bytes``. ``send_timeout`` bounds each chunk's write (a peer that stops reading).
    """

    def __init__(self, own: Identity, secret: bytes, streams: int = 4, chunk_bytes: int = 8 << 20,
                 min_stream_bytes: int = 4 << 20, send_timeout: float = 60.0, rate: float = 0.0) -> None:
        self.own = own
        self._secret = secret
        self.streams, self.chunk_bytes, self.min_stream_bytes = streams, chunk_bytes, min_stream_bytes
        self.send_timeout = send_timeout
        self.pace = Pace(rate)
        self._lock = threading.Lock()
        self._links: dict[Identity, Link] = {}
        self._workers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="net-send")
        self.bytes_out = 0
        self.sends = 0
        self.failed = 0

    def link(self, peer: Identity, address: str) -> Link:
        """The link to ``peer`` at ``address`` (a new one when the peer's address changed)."""
        with self._lock:
            link = self._links.get(peer)
            if link is None or link.address != address:
                if link is not None:
                    link.close()
                link = self._links[peer] = Link(address, self.own, peer, self._secret, self.streams,
                                                self.send_timeout)
            return link

    def send(self, peer: Identity, address: str, key: int, pieces: Sequence[tuple[Index, np.ndarray]]) -> int:
        """Push ``pieces`` (shard region, C-contiguous array) for receive ``key`` to ``peer``; returns the bytes
        sent. Raises NetworkError if any chunk could not be written."""
        link = self.link(peer, address)
        views = [frames.as_bytes(a) for _, a in pieces]
        dtypes = [a.dtype.name for _, a in pieces]
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for chunk in frames.chunks([v.nbytes for v in views], self.chunk_bytes):
            todo.put(chunk)
        total = sum(v.nbytes for v in views)
        failed: list[BaseException] = []

        def stream() -> None:
            if failed:
                return
            try:
                conn = link.acquire()
            except (OSError, ProtocolError, PathwaysError) as exc:
                failed.append(exc)
                return
            healthy = False
            try:
                while not failed:
                    try:
                        chunk = todo.get_nowait()
                    except queue.Empty:
                        break
                    shard, view = pieces[chunk.piece][0], views[chunk.piece]
                    self.pace.take(chunk.length)
                    conn.send(frames.encode_header(key, shard, dtypes[chunk.piece], view.nbytes, chunk.offset,
                                                   chunk.length), (view[chunk.offset:chunk.offset + chunk.length],))
                healthy = True
            except OSError as exc:
                failed.append(exc)
            finally:
                link.release(conn, healthy and not failed)

        helpers = [self._workers.submit(stream)
                   for _ in range(frames.stream_count(total, self.streams, self.min_stream_bytes) - 1)]
        stream()
        for helper in helpers:
            helper.result()
        with self._lock:
            self.sends += 1
            if failed:
                self.failed += 1
            else:
                self.bytes_out += total
        if failed:
            raise NetworkError(f"sending {total} bytes to host {peer[1]} of island {peer[0]} at {address} failed: "
                               f"{failed[0]}") from failed[0]
        return total

    def probe(self, peer: Identity, address: str, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes over one fresh connection and have them landed and acknowledged:
        the bare link, no chunking, no headers beyond one."""
        payload = np.ones(nbytes, np.uint8)
        conn = connect(address, self.own, peer, self._secret, self.send_timeout)
        try:
            start = time.perf_counter()
            conn.send(frames.encode_probe(nbytes), (payload,))
            try:
                answer = conn.recv()
            except FrameError as exc:
                raise ProtocolError(f"the probe's answer is not a frame of this connection: {exc}") from None
            if answer.payload != frames.ACK or answer.data:
                raise ProtocolError("the probe was not acknowledged")
            return time.perf_counter() - start
        finally:
            conn.close()

    def drop_peer(self, peer: Identity) -> None:
        """Close and forget the connections to ``peer`` (its island failed)."""
        with self._lock:
            link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    def stats(self) -> dict:
        """The sending side's counters: bytes sent, sends, failed sends, connections opened."""
        with self._lock:
            return {"net_bytes_out": self.bytes_out, "net_sends": self.sends, "net_sends_failed": self.failed,
                    "net_streams_opened": sum(link.opened for link in self._links.values())}

    def close(self) -> None:
        """Close every connection and stop the sender threads."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
