"""Host-to-host messages on one node over a Unix socket: about 0.05 ms one way, where a Ray actor call
takes about 1 ms here.

Every transfer between islands costs one such message (the ``deliver`` that
announces lent or attached shards, and the lease coming back), so a pipeline
pays it on every stage hop. Hosts on the same node therefore keep one socket
per peer for these messages; hosts on other nodes, and any peer whose socket
fails, use Ray actor calls.

A frame is a header (the lengths of the two parts), a msgpack message, and the
raw bytes of any small arrays it carries. The socket lives in Linux's abstract
namespace (no file to clean up), and only processes of this user may connect.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

HEADER = struct.Struct("<II")  # message bytes, data bytes
SEND_TIMEOUT_S = 10.0
_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid of the connecting process
log = logging.getLogger(__name__)


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class Channel:
    """This host's socket: serves frames to ``handle(message, data)`` and sends frames to peers' sockets."""

    def __init__(self, name: str, handle: Callable[[bytes, memoryview], None]) -> None:
        self.address = f"\0{name}"
        self._handle = handle
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(64)
        self._lock = threading.Lock()
        self._links: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self.frames_in = 0
        self.frames_out = 0
        threading.Thread(target=self._accept, name="channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
            if _CREDENTIALS.unpack(creds)[1] != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="channel-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(HEADER.size)
        with conn:
            while _recv_exactly(conn, memoryview(header)):
                meta_len, data_len = HEADER.unpack(header)
                meta, data = bytearray(meta_len), bytearray(data_len)
                if not (_recv_exactly(conn, memoryview(meta)) and _recv_exactly(conn, memoryview(data))):
                    return
                self.frames_in += 1
                try:
                    self._handle(bytes(meta), memoryview(data))
                except Exception:  # a bad frame is refused; the link and the host carry on
                    log.exception("refused a frame from a peer host")

    def send(self, address: str, message: bytes, arrays: Sequence[np.ndarray] = ()) -> None:
        """One frame to the host at ``address``; raises OSError if the link is broken (then use Ray)."""
        conn, lock = self._link(address)
        views = [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
        with lock:
            try:
                conn.sendall(HEADER.pack(len(message), sum(v.nbytes for v in views)) + message)
                for view in views:
                    conn.sendall(view)
            except OSError:
                with self._lock:
                    self._links.pop(address, None)
                conn.close()
                raise
        self.frames_out += 1

    def _link(self, address: str) -> tuple[socket.socket, threading.Lock]:
        with self._lock:
            link = self._links.get(address)
            if link is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(SEND_TIMEOUT_S)  # a peer that stopped reading fails over to Ray
                conn.connect(address)
                link = self._links[address] = (conn, threading.Lock())
            return link

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for conn, _ in self._links.values():
                conn.close()
            self._links.clear()


def open_channel(name: str, handle: Callable[[bytes, memoryview], None]) -> Channel | None:
    """This host's channel, or None where abstract Unix sockets do not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return Channel(name, handle)
    except OSError as exc:
        log.warning("no same-node channel (%s): peers on this node will use Ray actor calls", exc)
        return None
