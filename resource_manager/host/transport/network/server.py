"""A host's data server: authenticates peer hosts and lands the chunks they push straight into landing buffers.

One listening socket on the host's node IP (an ephemeral port, or one from a configured range so firewalls
can open just that range). A connection must first pass the client protocol's handshake (``frames.accepting``:
the runtime's secret, mutual), run on the ``Doorway``'s one thread with its bounds and deadline; only then does
it get a thread of its own, and at most ``MAX_CONNECTIONS`` are served at once. Then every frame is the client
protocol's (``pathways.protocol.frames``: its lengths are checked against ceilings, its sequence number and MAC
before its header is read), and every header is checked before a byte is allocated (``frames.decode_header``:
sizes must agree with the shard's region and stay under a hard ceiling, or the connection ends), and the piece
must be one the plan routes from that sender (``receives``), or the frame's bytes are read and dropped.

An accepted chunk of a receive registered with where it lands (its ``scatter.Target``) is read straight into
the devices' regions, cut into the runs each takes (``scatter``), and the piece reaches the receive side as
``Scattered``. Otherwise (its receive is not admitted here yet) it is received with ``recv_into`` into the
piece's landing buffer, taken from the host's buffer pool (64-byte aligned, so when the piece is exactly one
device's region the device adopts the buffer as is: ``transfer.Landed``). A connection that breaks mid-chunk
(the sending node died) drops the piece it was landing; ``drop`` releases every partial piece of a receive or
island that will never finish. Dropped buffers go back to the pool as soon as the last thread writing into them
lets go.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pathways.protocol import connection
from pathways.protocol.connection import Connection
from pathways.protocol.frames import FrameError
from pathways.protocol.handshake import Proven
from pathways.sharding import Index
from resource_manager.doorway import Doorway
from resource_manager.host.transport.network import frames
from resource_manager.host.transport.network.frames import Header, Identity, ProtocolError
from resource_manager.host.transport.network.receives import LATER, OK, Receives
from resource_manager.host.transport.network.scatter import LAYOUTS, Layout, Scattered, Target, iovecs, receive

log = logging.getLogger(__name__)

Alloc = Callable[[Sequence[int], np.dtype], np.ndarray]
MAX_CONNECTIONS = 256  # peer hosts' connections served at once (each sender keeps a few per peer)


def bind(ip: str, ports: range | None) -> socket.socket:
    """A listening socket on ``ip``: the first free port of ``ports``, else any free port."""
    for port in ports or (0,):
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((ip, port))
            sock.listen(128)
            return sock
        except OSError:
            sock.close()
    raise OSError(f"no free port for the data server on {ip} in {ports}")


@dataclass(eq=False)
class _Partial:
    """A piece being landed: its buffer (or, scattered, its receive's target and the shard's layout there), the
    byte ranges that arrived (sorted, disjoint: a piece is whole only when every byte was written once, so a
    landing buffer never hands back bytes it held before), and whether it counts as unclaimed."""

    array: np.ndarray | None
    view: memoryview | None
    total: int
    reserved: bool
    scatter: tuple[Target, Layout] | None = None
    received: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def claim(self, offset: int, length: int) -> None:
        """Note bytes ``offset:offset+length`` as arriving; ProtocolError if some of them already did."""
        k = bisect.bisect(self.ranges, (offset, offset + length))
        if (k and self.ranges[k - 1][1] > offset) or (k < len(self.ranges) and self.ranges[k][0] < offset + length):
            raise ProtocolError(f"bytes {offset}:{offset + length} of a piece arrived twice")
        self.ranges.insert(k, (offset, offset + length))


class DataServer:
    """Serves this host's data connections; pieces that arrive whole go to ``receives.landed``."""

    def __init__(self, identity: Identity, secret: bytes, ip: str, receives: Receives, alloc: Alloc,
                 ceiling: int, ports: range | None = None) -> None:
        if len(secret) < 16:
            raise ValueError("the data path's secret must be at least 16 bytes")
        self.identity = identity
        self._secret = secret
        self._receives = receives
        self._alloc = alloc
        self.ceiling = ceiling
        self._listener = bind(ip, ports)
        host, port = self._listener.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._lock = threading.Lock()
        self._partials: dict[tuple[Identity, int, Index], _Partial] = {}
        self._conns: set[Connection] = set()
        self._closed = False
        self.connections = 0
        self.refused = 0
        self.protocol_errors = 0
        self.broken = 0
        self.bytes_in = 0
        self.pieces_in = 0
        self.pieces_scattered = 0
        self.released_bytes = 0
        self.door = Doorway(self._listener, lambda: frames.accepting(secret, identity), self._admitted, "net")

    # -- connections ----------------------------------------------------------------------------------------
    def _admitted(self, sock: socket.socket, addr: tuple, proven: Proven) -> None:
        """A peer host that proved itself (on the doorway's thread): served on a thread of its own, within
        ``MAX_CONNECTIONS``."""
        peer = frames.host_of(proven.session)
        conn = connection.adopt(sock, proven, frames.MAX_HEADER_BYTES, self.ceiling)
        with self._lock:
            ok = not self._closed and len(self._conns) < MAX_CONNECTIONS
            if ok:
                self._conns.add(conn)
                self.connections += 1
            else:
                self.refused += 1
        if not ok:
            log.warning("data server %s refused host %d of island %d: %d connections are open", self.address, peer[1],
                        peer[0], MAX_CONNECTIONS)
            conn.close()
            return
        threading.Thread(target=self._serve, args=(conn, peer), name="net-serve", daemon=True).start()

    def _serve(self, conn: Connection, peer: Identity) -> None:
        try:
            self._frames(conn, peer)
        except (ProtocolError, FrameError) as exc:
            with self._lock:
                self.protocol_errors += 1
            log.warning("data server %s dropped host %d of island %d: %s", self.address, peer[1], peer[0], exc)
        except OSError as exc:  # reset, or closed mid-frame: the sender (or its node) died
            with self._lock:
                self.broken += 1
            log.info("connection from host %d of island %d broke: %s", peer[1], peer[0], exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _frames(self, conn: Connection, peer: Identity) -> None:
        while True:
            frame = conn.next()
            if frame is None:
                return  # closed between frames: a clean end
            header = frames.decode_header(frame.payload, self.ceiling)
            if isinstance(header, int):
                if frame.data != header:
                    raise ProtocolError(f"a probe of {header} bytes carries {frame.data}")
                self._probe(conn, header)
                continue
            if frame.data != header.length:
                raise ProtocolError(f"a header for {header.length} bytes on a frame of {frame.data}")
            self._land(conn, peer, header)

    # -- landing --------------------------------------------------------------------------------------------
    def _land(self, conn: Connection, peer: Identity, h: Header) -> None:
        slot = (peer, h.key, h.shard)
        verdict = self._receives.verdict(peer, h.key, h.shard, h.dtype)
        if verdict not in (OK, LATER):
            self._receives.refuse(peer, h.key, h.shard, verdict, h.length)
            with self._lock:  # a piece begun before its receive finished will never be whole
                piece = self._partials.get(slot)
            if piece is not None:
                self._release(slot, piece)
            conn.skip(h.length)
            return
        target = self._receives.target(h.key) if verdict == OK else None
        if target is not None and target.dtype != h.dtype:
            target = None  # (refused by the receive side once whole)
        with self._lock:
            piece = self._partials.get(slot)
            if piece is None:
                reserved = verdict == LATER
                if reserved and not self._receives.reserve(h.total):
                    raise ProtocolError(f"{h.total} more bytes for receive {h.key}, which this host has not admitted "
                                        f"yet, would pass the budget of {self._receives.unclaimed_limit} unclaimed "
                                        "bytes")
                if target is not None:  # straight into the devices' regions
                    piece = _Partial(None, None, h.total, reserved,
                                     (target, LAYOUTS.get(h.shard, target.regions, h.dtype.itemsize)))
                else:
                    array = self._alloc(h.shape, h.dtype)
                    piece = _Partial(array, frames.as_bytes(array), h.total, reserved)
                self._partials[slot] = piece
            elif piece.total != h.total:
                raise ProtocolError(f"shard {h.shard} of receive {h.key} was {piece.total} bytes, now {h.total}")
            piece.claim(h.offset, h.length)
        try:
            if piece.scatter is None:
                conn.read_into(piece.view[h.offset:h.offset + h.length])
            else:
                target, layout = piece.scatter
                receive(conn.sock, iovecs(layout, target.bases(self._alloc), h.offset, h.length))
        except BaseException:
            self._release(slot, piece)
            raise
        with self._lock:
            piece.received += h.length
            whole = piece.received >= piece.total and self._partials.get(slot) is piece
            if whole:
                del self._partials[slot]
                self.pieces_scattered += piece.scatter is not None
            self.bytes_in += h.length
            self.pieces_in += whole
        if whole:
            landed = piece.array if piece.scatter is None else Scattered(piece.scatter[0], h.shard, h.dtype,
                                                                          piece.scatter[1].nbytes)
            self._receives.landed(peer, h.key, h.shard, landed, piece.reserved)

    def _release(self, slot: tuple, piece: _Partial) -> None:
        with self._lock:
            if self._partials.get(slot) is not piece:
                return
            del self._partials[slot]
            self.released_bytes += piece.total
        if piece.reserved:
            self._receives.unreserve(piece.total)

    def _probe(self, conn: Connection, nbytes: int) -> None:
        """Land ``nbytes`` raw bytes in a pool buffer and acknowledge: the bare link, for a baseline."""
        buf = self._alloc((nbytes,), np.dtype(np.uint8))
        conn.read_into(memoryview(buf))
        conn.send(frames.ACK)

    def drop(self, key: int | None = None, island: int | None = None) -> int:
        """Release the partial pieces of receive ``key``, or from island ``island``; returns their bytes."""
        released = []
        with self._lock:
            for slot, piece in list(self._partials.items()):
                (src, _), k, _ = slot
                if (key is not None and k == key) or (island is not None and src == island):
                    del self._partials[slot]
                    released.append(piece)
            nbytes = sum(p.total for p in released)
            self.released_bytes += nbytes
        for piece in released:
            if piece.reserved:
                self._receives.unreserve(piece.total)
        return nbytes

    def stats(self) -> dict:
        """The server's counters: connections, refusals, protocol errors, broken connections, bytes and pieces landed,
        and bytes of partial or released pieces."""
        with self._lock:
            return {"net_connections": self.connections, "net_open_connections": len(self._conns),
                    "net_auth_refused": self.door.refused, "net_handshakes_evicted": self.door.evicted,
                    "net_handshakes_expired": self.door.expired, "net_refused": self.refused,
                    "net_protocol_errors": self.protocol_errors,
                    "net_broken": self.broken, "net_bytes_in": self.bytes_in, "net_pieces_in": self.pieces_in,
                    "net_pieces_scattered": self.pieces_scattered,
                    "net_partial_bytes": sum(p.total for p in self._partials.values()),
                    "net_released_bytes": self.released_bytes}

    def close(self) -> None:
        """Stop accepting and shut every open connection down."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self.door.close()
        self._listener.close()
        for conn in conns:
            conn.close()
