"""Host-to-host messages on one node over a Unix socket, instead of a Ray actor call per message.

Every transfer between islands costs one such message (the ``deliver`` that
announces lent or attached shards, and the lease coming back), so a pipeline
pays it on every stage hop. Hosts on the same node therefore keep one socket
per peer for these messages; hosts on other nodes, and any peer whose socket
fails, use Ray actor calls.

A frame is a header (the lengths of the two parts), a msgpack message, and the
raw bytes of any small arrays it carries. Both lengths have ceilings: a peer
that announces more is disconnected before anything is allocated. The socket
is a file in a directory only this user can enter, and a connection is served
only if the kernel's peer credentials (``SO_PEERCRED``) name one of the
runtime's own hosts on this node; the handler learns that peer's pid from the
kernel, never from the frame.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence

import numpy as np

HEADER = struct.Struct("<II")  # message bytes, data bytes
MAX_MESSAGE = 1 << 20  # a deliver message names at most a few thousand shards
MAX_DATA = 16 << 20  # frames carry only small arrays; large ones are lent
SEND_TIMEOUT_S = 10.0
_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid of the connecting process
log = logging.getLogger(__name__)

Handler = Callable[[bytes, memoryview, int], None]  # (message, data, peer pid)


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


class Channel:
    """This host's socket: serves frames from allowed peers to ``handle`` and sends frames to peers' sockets."""

    def __init__(self, handle: Handler, allowed: Callable[[int], bool]) -> None:
        self._dir = tempfile.mkdtemp(prefix="pathways-")  # mode 0700: only this user may reach the socket
        self.address = os.path.join(self._dir, "host.sock")
        self._handle = handle
        self._allowed = allowed
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        os.chmod(self.address, 0o600)
        self._server.listen(64)
        self._lock = threading.Lock()
        self._links: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self.frames_in = 0
        self.frames_out = 0
        self.refused = 0
        threading.Thread(target=self._accept, name="channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            pid, uid, _ = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              _CREDENTIALS.size))
            if uid != os.getuid() or not self._allowed(pid):
                self.refused += 1
                log.warning("refused a channel connection from pid %d (uid %d): not one of this runtime's hosts",
                            pid, uid)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, pid), name="channel-serve", daemon=True).start()

    def _serve(self, conn: socket.socket, pid: int) -> None:
        header = bytearray(HEADER.size)
        with conn:
            while _recv_exactly(conn, memoryview(header)):
                meta_len, data_len = HEADER.unpack(header)
                if meta_len > MAX_MESSAGE or data_len > MAX_DATA:
                    self.refused += 1
                    log.warning("disconnected pid %d: a frame announced %d + %d bytes, over the limits of %d + %d",
                                pid, meta_len, data_len, MAX_MESSAGE, MAX_DATA)
                    return
                meta, data = bytearray(meta_len), bytearray(data_len)
                if not (_recv_exactly(conn, memoryview(meta)) and _recv_exactly(conn, memoryview(data))):
                    return
                self.frames_in += 1
                try:
                    self._handle(bytes(meta), memoryview(data), pid)
                except Exception:  # a bad frame is refused; the link and the host carry on
                    self.refused += 1
                    log.exception("refused a frame from pid %d", pid)

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
        """Stop serving, close every link, and remove the socket file."""
        self._server.close()
        with self._lock:
            for conn, _ in self._links.values():
                conn.close()
            self._links.clear()
        try:
            os.unlink(self.address)
            os.rmdir(self._dir)
        except OSError:
            pass


def open_channel(handle: Handler, allowed: Callable[[int], bool]) -> Channel | None:
    """This host's channel, or None where Unix sockets with peer credentials do not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return Channel(handle, allowed)
    except OSError as exc:
        log.warning("no same-node channel (%s): peers on this node will use Ray actor calls", exc)
        return None
