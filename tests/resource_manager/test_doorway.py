"""Nothing before login holds a shared resource for long: what anyone who reaches a port can do to the runtime's
endpoints, tried as an attacker would, on real sockets (no Ray): slow and silent handshakes, crowds of idle
anonymous connections, floods from one address, unauthenticated connections to a data server, and a tenant's
message announcing a gigabyte."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import psutil
import pytest

import pathways as pw
from pathways import wire
from pathways.errors import from_wire
from pathways.protocol import frames, handshake
from pathways.protocol.address import parse_address
from pathways.protocol.connection import Connection, connect
from pathways.protocol.handshake import Identity
from pathways.requests import Answer
from resource_manager import doorway
from resource_manager.endpoint import MAX_ANONYMOUS, MAX_ANONYMOUS_PER_SOURCE, Caller, Endpoint, refuse_frame
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.transport.network.path import landing_alloc
from resource_manager.host.transport.network.receives import Receives
from resource_manager.host.transport.network.server import DataServer

ME = Identity("runtime-1", "rm")
KEY = b"k" * 32
SESSION = 42


class Echo:
    """An endpoint whose connections echo each message back; ``hold`` keeps a message's answer until released."""

    def __init__(self, frame_bytes: int = 1 << 30, max_payload: int = 1 << 20) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.endpoint = Endpoint(ME, "127.0.0.1", self._caller, self._serve, anonymous=True,
                                 max_payload=max_payload, max_data=0, name="test")
        self.frame_bytes = frame_bytes
        self.port = parse_address(self.endpoint.address)[1]

    def _caller(self, session: int) -> Caller | None:
        return Caller(KEY, "alice", 64, self.frame_bytes) if session == SESSION else None

    def _serve(self, conn: Connection, caller: Caller | None) -> None:
        try:
            while True:
                frame = conn.recv()
                if frame.payload == b"wait":
                    assert self.hold.wait(30)
                conn.send(frame.payload)
        except frames.OverBudget as exc:
            refuse_frame(conn, exc)
        except (ConnectionError, OSError, frames.FrameError):
            pass

    def client(self, session: int = 0, key: bytes | None = None) -> Connection:
        return connect(self.endpoint.address, session, key, lambda i: None, 1 << 20, 0, timeout=10)

    def close(self) -> None:
        self.endpoint.close()


@pytest.fixture
def echo():
    server = Echo()
    yield server
    server.close()


def raw(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_crowd_of_slow_handshakes_never_locks_an_honest_client_out(echo):
    slow = [raw(echo.port) for _ in range(3 * doorway.MAX_PENDING)]
    for sock in slow:
        sock.sendall(b"P")  # one byte of a hello that never finishes
    assert wait_for(lambda: echo.endpoint.door.evicted >= len(slow) - doorway.MAX_PENDING)
    assert echo.endpoint.door.pending <= doorway.MAX_PENDING
    for _ in range(3):  # the admin, and clients about to log in, get in at once, again and again
        conn = echo.client()
        conn.send(b"hello")
        assert conn.recv().payload == b"hello"
        conn.close()
    for sock in slow:
        sock.close()


def test_a_handshake_has_one_deadline_however_slowly_its_bytes_come():
    listener = socket.create_server(("127.0.0.1", 0))
    admitted = []
    door = doorway.Doorway(listener, lambda: handshake.Accepting(ME, {}.get, True),
                           lambda s, a, p: admitted.append(s), "test", deadline=1.0)
    sock = socket.create_connection(listener.getsockname(), timeout=10)
    sock.recv(4096)  # the greeting
    started, closed = time.monotonic(), False
    for _ in range(handshake.Accepting.expect - 1):  # a byte every 0.2 s: no single read waits long
        try:
            sock.sendall(b"P")
            time.sleep(0.2)
        except OSError:
            closed = True
            break
        if door.expired:
            closed = True
            break
    took = time.monotonic() - started
    assert closed and door.expired == 1 and not admitted, (took, door.expired)
    assert took < 8.0  # the whole handshake's deadline (1 s here), not the 16 s the trickle would take
    sock.close()
    door.close()
    listener.close()


def test_one_address_holds_only_its_share_of_the_handshakes(echo):
    flood = [raw(echo.port, "127.0.0.2") for _ in range(4 * doorway.MAX_PER_SOURCE)]
    assert wait_for(lambda: echo.endpoint.door.evicted >= len(flood) - doorway.MAX_PER_SOURCE)
    assert echo.endpoint.door.pending <= doorway.MAX_PER_SOURCE
    others = [raw(echo.port, "127.0.0.3") for _ in range(doorway.MAX_PER_SOURCE)]
    assert wait_for(lambda: echo.endpoint.door.pending == 2 * doorway.MAX_PER_SOURCE)
    evicted = echo.endpoint.door.evicted
    conn = echo.client()  # from 127.0.0.1: nobody else's half-open connections give way for it
    conn.send(b"hi")
    assert conn.recv().payload == b"hi"
    assert echo.endpoint.door.evicted == evicted
    for sock in flood + others:
        sock.close()
    conn.close()


def test_idle_anonymous_connections_give_way_and_a_busy_one_is_kept(echo):
    echo.hold.clear()
    busy = echo.client()
    busy.send(b"wait")  # a request being served: its connection must not be taken away
    assert wait_for(lambda: any(c.busy for c in list(echo.endpoint._anonymous_from)))
    idle = []
    for _ in range(2 * MAX_ANONYMOUS):
        idle.append(echo.client())
    stats = echo.endpoint.stats()
    assert stats["anonymous_connections"] <= MAX_ANONYMOUS and stats["anonymous_evicted"] >= MAX_ANONYMOUS, stats
    fresh = echo.client()
    fresh.send(b"still in")
    assert fresh.recv().payload == b"still in"
    echo.hold.set()
    assert busy.recv().payload == b"wait"
    for conn in idle:
        conn.close()


def test_one_address_holds_only_its_share_of_the_anonymous_connections(echo):
    crowd = []
    for _ in range(2 * MAX_ANONYMOUS_PER_SOURCE):
        sock = raw(echo.port, "127.0.0.2")
        sock.settimeout(10)
        crowd.append(sock)
        hello = b""
        while len(hello) < handshake.SERVER_HELLO.size:
            hello += sock.recv(4096)
        tag, nonce, _ = handshake.SERVER_HELLO.unpack(hello[:handshake.SERVER_HELLO.size])
        sock.sendall(handshake.CLIENT_HELLO.pack(tag, b"n" * 32, 0, bytes(32)))
        assert sock.recv(33)[:1] == handshake.OK
    assert wait_for(lambda: echo.endpoint.stats()["anonymous_connections"] <= MAX_ANONYMOUS_PER_SOURCE)
    for sock in crowd:
        sock.close()


def test_a_data_server_gives_no_thread_to_a_connection_that_has_not_proven_itself():
    pool = BufferPool()
    receives = Receives(lambda *a: None, unclaimed_limit=1 << 20, stale_s=60.0)
    server = DataServer((1, 0), b"s" * 32, "127.0.0.1", receives, landing_alloc(pool.take), ceiling=1 << 30)
    port = int(server.address.rpartition(":")[2])
    before = threading.active_count()
    socks = [raw(port) for _ in range(300)]
    assert wait_for(lambda: server.door.evicted >= 300 - doorway.MAX_PER_SOURCE)
    assert threading.active_count() - before < 5
    for sock in socks:
        sock.close()
    server.close()


def test_a_message_is_read_within_its_tenants_frame_budget_and_memory_grows_with_what_really_came():
    echo = Echo(frame_bytes=64 << 20, max_payload=4 << 30)
    conn = echo.client(SESSION, KEY)
    rss = psutil.Process().memory_info().rss
    prefix = frames.PREFIX.pack(1 << 30, 0, 1)  # announces a gigabyte, over the tenant's 64 MiB
    conn.sock.sendall(prefix + frames.mac(conn._key, frames.TO_SERVER, prefix, b""))
    answer = wire.parse(conn.recv().payload, Answer)
    assert answer.rid == -1 and not answer.ok
    error = from_wire(*answer.value)
    assert isinstance(error, pw.ResourceError) and "frame_bytes" in str(error), error
    with pytest.raises((ConnectionError, OSError, frames.FrameError)):
        conn.recv()  # then the connection ends: the rest of that message is never read
    assert psutil.Process().memory_info().rss - rss < 32 << 20
    conn = echo.client(SESSION, KEY)  # within the budget, a slow sender holds only what it sent
    prefix = frames.PREFIX.pack(60 << 20, 0, 1)
    conn.sock.sendall(prefix + frames.mac(conn._key, frames.TO_SERVER, prefix, b"") + b"x" * (1 << 20))
    assert wait_for(lambda: echo.endpoint.reading.held("alice") == 60 << 20)
    assert psutil.Process().memory_info().rss - rss < 32 << 20
    conn.close()
    assert wait_for(lambda: echo.endpoint.reading.held("alice") == 0)
    echo.close()


def test_garbage_and_silence_cost_the_door_nothing_that_lasts(echo):
    for junk in (b"GET / HTTP/1.0\r\n\r\n" + b"x" * 200, msgpack.packb({"a": 1}) * 10, b""):
        sock = raw(echo.port)
        sock.sendall(junk)
        sock.close()
    assert wait_for(lambda: echo.endpoint.door.pending == 0)
    conn = echo.client()
    conn.send(b"fine")
    assert conn.recv().payload == b"fine"
