"""Host-to-host messages on one node over a Unix socket, instead of a Ray actor call per message.

Every transfer between islands costs one such message (the ``deliver`` that
announces lent or attached shards, and the lease coming back), so a pipeline
pays it on every stage hop. Hosts on the same node therefore keep one socket
per peer for these messages (``ChannelTransport``, the first transport of every
route); hosts on other nodes, and any peer whose socket fails, use the next
transport of the route. A peer on this node that passed a probe (it can read
this process) gets small shards inside the frame and large ones lent
(``direct``): kept alive here until their lease comes back.

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
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pathways import auth, wire
from pathways.errors import TenantAccessError, WireFormatError
from pathways.messages import Deliver, Lending, Returned
from resource_manager.host.transport.direct import PROBE, Lent, readable
from resource_manager.host.transport.interface import Inbound, LeasePool, Peer, Sent, Transport

if TYPE_CHECKING:
    from resource_manager.host.transport.peers import PeerInfo

HEADER = struct.Struct("<II")  # message bytes, data bytes
MAX_MESSAGE = 1 << 20  # a deliver message names at most a few thousand shards
MAX_DATA = 16 << 20  # frames carry only small arrays; large ones are lent
MIN_LENT = 100 * 1024  # below this a peer gets the shards inside the frame: cheaper than a lease
SEND_TIMEOUT_S = 10.0
SOCKET_DIR = "pathways-host-"  # + the host's pid + "-": a host killed before it closed its channel is swept by the next
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


def sweep(tmp: str) -> int:
    """Remove the socket folders in ``tmp`` that this user's hosts left when they were killed (a killed actor never
    closes its channel): each names its host's pid, which no longer runs. Returns how many went."""
    gone = 0
    for name in os.listdir(tmp):
        if not name.startswith(SOCKET_DIR):
            continue
        folder = os.path.join(tmp, name)
        try:
            pid = int(name[len(SOCKET_DIR):].split("-", 1)[0])
            st = os.lstat(folder)
            if st.st_uid != os.getuid() or not os.path.isdir(folder) or os.path.islink(folder):
                continue
            os.kill(pid, 0)
        except ProcessLookupError:  # its host is gone: so is whatever listened on its socket
            try:
                for entry in os.listdir(folder):
                    os.unlink(os.path.join(folder, entry))
                os.rmdir(folder)
                gone += 1
            except OSError:
                pass
        except (ValueError, OSError):  # not a name of ours, or a process of someone else's
            continue
    return gone


class Channel:
    """This host's socket: serves frames from allowed peers to ``handle`` and sends frames to peers' sockets."""

    def __init__(self, handle: Handler, allowed: Callable[[int], bool]) -> None:
        tmp = tempfile.gettempdir()
        sweep(tmp)
        # mode 0700: only this user may reach the socket
        self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR}{os.getpid()}-", dir=tmp)
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


class Directory(Protocol):
    """The runtime's hosts as the channel needs them: who is where."""

    def info(self, island: int, host: int) -> PeerInfo | None:
        """Host ``(island, host)`` as the resource manager started it, or None."""

    def on_this_node(self, pid: int) -> PeerInfo | None:
        """The runtime host with process id ``pid`` on this node."""


class ChannelTransport(Transport):
    """Deliveries to same-node peers over ``channel``, large shards lent from ``leases``; what arrives goes to
    ``inbound``, leases that come back to ``leases``. ``directory`` says which process is which runtime host."""

    name = "channel"

    def __init__(self, key: bytes, node: str, directory: Directory, leases: LeasePool, inbound: Inbound) -> None:
        self._key, self.node, self.pid = key, node, os.getpid()
        self._directory, self._leases, self._inbound = directory, leases, inbound
        self._links: dict[Peer, str] = {}
        self._probe = np.frombuffer(PROBE, np.uint8).copy()
        self.channel = Channel(self._frame, lambda pid: directory.on_this_node(pid) is not None)
        self.address = self.channel.address

    # -- sending ------------------------------------------------------------------------------------------
    def link(self, peer: Peer, timeout: float) -> str:
        """The channel address of ``peer`` if it is on this node and can read this process, else "": asked once
        per peer, then remembered."""
        known = self._links.get(peer)
        if known is None:
            known = ""
            info = self._directory.info(*peer)
            if info is not None and info.node == self.node and readable():
                import ray

                addr = self._probe.ctypes.data
                mac = auth.sign(self._key, "probe", peer[0], peer[1], self.node, self.pid, addr)
                try:
                    known = ray.get(info.handle.probe_direct.remote(mac, self.node, self.pid, addr, PROBE),
                                    timeout=timeout) or ""
                except Exception:  # an unreachable peer fails its transfer on the next transport instead
                    known = ""
            self._links[peer] = known
        return known

    def linked(self, island: int, hosts: Sequence[int]) -> bool:
        """Whether every one of these peers is known to take frames on the channel."""
        return all(self._links.get((island, host)) for host in hosts)

    def forget(self, peer: Peer) -> None:
        """``peer`` was replaced (its island restarted): probe it anew."""
        self._links.pop(peer, None)

    def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
        link = self.link(peer, timeout)
        if not link:
            return Sent.PASSED
        if sum(a.nbytes for a in arrays) >= MIN_LENT:
            arrays = [np.ascontiguousarray(a) for a in arrays]
            lease = self._leases.keep(arrays, peer[0])
            lending = Lending(lease, tuple(a.ctypes.data for a in arrays), self.address)
            frame, attached, sent = Deliver(msg.key, msg.src, msg.host, msg.shards, None, lending, None), [], Sent.LENT
        else:
            frame = Deliver(msg.key, msg.src, msg.host, msg.shards, msg.failure, None,
                            arrays[0].dtype.name if arrays else None)
            attached, sent, lease = arrays, Sent.SENT, None
        try:
            self.channel.send(link, frame.encode(), attached)
            return sent
        except OSError:  # the peer's socket is gone: the next transport says whether the peer is
            if lease is not None:
                self._leases.release([lease])
            return Sent.PASSED

    def give_back(self, peer: Peer, reply: str, leases: list[int]) -> bool:
        if not reply:
            return False
        try:
            self.channel.send(reply, Returned(tuple(leases)).encode())
            return True
        except OSError:
            return False

    # -- receiving ----------------------------------------------------------------------------------------
    def _frame(self, meta: bytes, data: memoryview, pid: int) -> None:
        """A frame from a runtime host on this node (its pid from the socket): shards lent or carried in ``data``,
        or leases coming back."""
        peer = self._directory.on_this_node(pid)
        if peer is None:
            raise TenantAccessError(f"a frame from pid {pid}, which is not one of this runtime's hosts")
        decoded = wire.decode(meta, "deliver", Returned.KIND)
        if decoded["kind"] == Returned.KIND:
            self._leases.release(decoded["leases"])
            return
        msg = Deliver.from_wire(decoded)
        if (msg.src, msg.host) != (peer.island, peer.host):
            raise TenantAccessError(f"pid {pid} is island {peer.island} host {peer.host} but its frame claims "
                                    f"island {msg.src} host {msg.host}")
        src = (peer.island, peer.host)
        self._inbound.deliver(msg, pieces_of(msg, data, pid, src), src)

    def stats(self) -> dict:
        return {"frames_in": self.channel.frames_in, "frames_out": self.channel.frames_out,
                "channel_refused": self.channel.refused}

    def close(self) -> None:
        self.channel.close()


def pieces_of(msg: Deliver, data: memoryview, pid: int, src: Peer) -> tuple:
    """The pieces a channel frame carries: lent shards (copied out of process ``pid`` when they land), or small
    shards back to back in ``data``. WireFormatError when the frame and its message disagree."""
    pieces: tuple = ()
    if msg.direct is not None:
        if len(msg.direct.addrs) != len(msg.shards):
            raise WireFormatError("deliver: lent addresses and shard indices differ in number")
        pieces = tuple(Lent(pid, addr, shard, src, msg.direct.lease, msg.direct.channel)
                       for addr, shard in zip(msg.direct.addrs, msg.shards))
    elif msg.dtype is not None:  # small shards, back to back in the frame
        dtype, offset, out = np.dtype(msg.dtype), 0, []
        for shard in msg.shards:
            shape = [b - a for a, b in shard]
            count = int(np.prod(shape, dtype=np.int64))
            if offset + count * dtype.itemsize > len(data):
                raise WireFormatError("deliver: the shards take more bytes than the frame carries")
            out.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
            offset += count * dtype.itemsize
        if offset != len(data):
            raise WireFormatError(f"deliver: the shards take {offset} bytes but the frame carries {len(data)}")
        pieces = tuple(out)
    if len(pieces) != len(msg.shards):
        raise WireFormatError(f"deliver: {len(msg.shards)} shard indices but {len(pieces)} arrays")
    return pieces


def open_channel(key: bytes, node: str, directory: Directory, leases: LeasePool,
                 inbound: Inbound) -> ChannelTransport | None:
    """This host's channel transport, or None where Unix sockets with peer credentials do not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ChannelTransport(key, node, directory, leases, inbound)
    except OSError as exc:
        log.warning("no same-node channel (%s): peers on this node will use Ray actor calls", exc)
        return None
