"""The client protocol without Ray: the handshake proves the session both ways and names the endpoint, every
frame is bound to its connection, direction and place in the stream, and a frame that fails a check ends the
connection before anything is read into memory. Two real sockets on this machine, no mocks."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

import pathways as pw
from pathways.protocol import frames, handshake
from pathways.protocol.address import format_address, parse_address
from pathways.protocol.connection import Connection, adopt, connect
from pathways.protocol.handshake import Identity
from resource_manager.doorway import Doorway

KEY = b"k" * 32
SESSION = 42
ME = Identity("runtime-1", "host", 0, 1, 3)


class Endpoint:
    """The endpoint's half of the handshake run by a real ``Doorway``; the test reads what it accepted or refused."""

    def __init__(self, identity: Identity = ME, anonymous: bool = False, keys: dict | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = format_address("127.0.0.1", self.listener.getsockname()[1])
        self.identity, self.anonymous = identity, anonymous
        self.keys = {SESSION: KEY} if keys is None else keys
        self.accepted: list[Connection] = []
        self.errors: list[Exception] = []
        self.ready = threading.Event()
        self.door = Doorway(self.listener, self._handshake, self._admit, "test")

    def _handshake(self) -> Recording:
        return Recording(handshake.Accepting(self.identity, self.keys.get, self.anonymous), self)

    def _admit(self, sock: socket.socket, addr: tuple, proven: handshake.Proven) -> None:
        self.accepted.append(adopt(sock, proven, 1 << 20, 1 << 20))
        self.ready.set()

    def connection(self) -> Connection:
        assert self.ready.wait(10)
        self.ready.clear()
        return self.accepted[-1]

    def close(self) -> None:
        self.door.close()
        self.listener.close()


class Recording:
    """A handshake that notes its refusal for the test, then refuses as the real one does."""

    def __init__(self, inner: handshake.Accepting, endpoint: Endpoint) -> None:
        self.inner, self.endpoint = inner, endpoint
        self.greeting, self.expect = inner.greeting, inner.expect

    def finish(self, answer: bytes) -> tuple[bytes, handshake.Proven]:
        try:
            return self.inner.finish(answer)
        except Exception as exc:
            self.endpoint.errors.append(exc)
            self.endpoint.ready.set()
            raise


def test_addresses_are_pathways_urls():
    assert parse_address("pathways://10.0.0.1:7100") == ("10.0.0.1", 7100) == parse_address("10.0.0.1:7100")
    assert parse_address(format_address("::1", 7)) == ("::1", 7)
    for bad in ("http://h:1", "pathways://h", "pathways://h:0", "pathways://:7100", "h:port"):
        with pytest.raises(pw.PathwaysError, match="not a pathways address"):
            parse_address(bad)


def test_a_session_is_proven_both_ways_and_frames_flow_with_their_data():
    ep = Endpoint()
    client = connect(ep.address, SESSION, KEY, lambda i: None, 1 << 20, 1 << 20)
    server = ep.connection()
    assert client.peer == ME and server.session == SESSION and client.authenticated and server.authenticated
    data = np.arange(10, dtype=np.float32)
    client.send(b"first", [data])
    frame = server.recv()
    assert frame.payload == b"first" and frame.data == data.nbytes
    got = np.empty(10, np.float32)
    server.read_into(memoryview(got))
    np.testing.assert_array_equal(got, data)
    server.send(b"answer")
    assert client.recv().payload == b"answer"  # the other direction has a sequence of its own
    ep.close()


def test_a_wrong_key_an_unknown_session_or_an_anonymous_client_is_refused():
    ep = Endpoint()
    for session, key, words in ((SESSION, b"x" * 32, "unknown or expired session"),
                                (7, KEY, "unknown or expired session"), (0, None, "takes only sessions")):
        with pytest.raises(pw.TenantAccessError, match=words):
            connect(ep.address, session, key, lambda i: None, 1 << 20, 1 << 20)
        assert ep.ready.wait(10)
        ep.ready.clear()
    assert len(ep.errors) == 3 and not ep.accepted
    ep.close()


def test_a_client_refuses_an_endpoint_that_is_not_the_one_it_meant():
    ep = Endpoint(identity=Identity("runtime-1", "host", 0, 1, 4))  # the island restarted: another epoch

    def expect(identity: Identity) -> None:
        if identity.epoch != 3:
            raise handshake.HandshakeError(f"wanted epoch 3, reached {identity.describe()}")

    with pytest.raises(handshake.HandshakeError, match=r"wanted epoch 3, reached host 1 of island 0 \(epoch 4\)"):
        connect(ep.address, SESSION, KEY, expect, 1 << 20, 1 << 20)
    impostor = Endpoint(keys={SESSION: b"y" * 32})  # does not hold the session's key: its proof fails
    with pytest.raises(pw.PathwaysError):
        connect(impostor.address, SESSION, KEY, lambda i: None, 1 << 20, 1 << 20)
    ep.close()
    impostor.close()


def pair() -> tuple[Connection, Connection, Endpoint]:
    ep = Endpoint()
    client = connect(ep.address, SESSION, KEY, lambda i: None, 1 << 20, 1 << 20)
    return client, ep.connection(), ep


def test_a_replayed_frame_is_refused_on_its_own_connection_and_on_any_other():
    client, server, ep = pair()
    recorded = frames.head(client._key, frames.TO_SERVER, 1, b"pay me", 0) + b"pay me"
    client.send(b"pay me")
    assert server.recv().payload == b"pay me"
    client.sock.sendall(recorded)  # the same bytes again: an old sequence number
    with pytest.raises(frames.FrameError, match="frame 1 where frame 2 was due"):
        server.recv()
    other, other_server, _ = pair()  # the same session on a new connection: another key
    other.sock.sendall(recorded)
    with pytest.raises(frames.FrameError, match="failed its MAC"):
        other_server.recv()
    ep.close()


def test_a_frame_reflected_back_or_altered_is_refused():
    client, server, ep = pair()
    server.send(b"from the endpoint")
    raw = frames.head(server._key, frames.TO_CLIENT, 1, b"from the endpoint", 0) + b"from the endpoint"
    assert client.recv().payload == b"from the endpoint"
    client.sock.sendall(raw)  # the endpoint's own frame sent back to it: the direction is in the MAC
    with pytest.raises(frames.FrameError, match="failed its MAC"):
        server.recv()
    client2, server2, _ = pair()
    raw = bytearray(frames.head(client2._key, frames.TO_SERVER, 1, b"transfer 10", 0) + b"transfer 10")
    raw[-2:] = b"99"  # one byte changed on the way
    client2.sock.sendall(bytes(raw))
    with pytest.raises(frames.FrameError, match="failed its MAC"):
        server2.recv()
    ep.close()


def test_a_huge_announced_size_ends_the_connection_before_anything_is_allocated():
    client, server, ep = pair()
    server.max_data = 1024
    huge = frames.PREFIX.pack(5, 1 << 40, 1)
    client.sock.sendall(huge + frames.mac(client._key, frames.TO_SERVER, huge, b"hello") + b"hello")
    with pytest.raises(frames.FrameError, match="over this endpoint's limit"):
        server.recv()
    ep.close()


def test_an_anonymous_connection_upgrades_to_the_session_it_opened():
    ep = Endpoint(anonymous=True)
    client = connect(ep.address, 0, None, lambda i: None, 1 << 20, 1 << 20)
    server = ep.connection()
    assert not client.authenticated and not server.authenticated
    client.send(b"open, with my credential")
    assert server.recv().payload == b"open, with my credential"
    server.send(b"your session is 42")
    client.recv()
    server.upgrade(SESSION, KEY, 1 << 20)
    client.upgrade(SESSION, KEY)
    client.send(b"now signed")
    assert server.recv().payload == b"now signed" and server.authenticated
    forged = frames.head(None, frames.TO_SERVER, 3, b"unsigned", 0) + b"unsigned"  # what a process without the key
    client.sock.sendall(forged)
    with pytest.raises(frames.FrameError, match="failed its MAC"):
        server.recv()
    ep.close()


def test_garbage_instead_of_a_handshake_is_refused_and_the_endpoint_keeps_accepting():
    ep = Endpoint()
    with socket.create_connection(("127.0.0.1", parse_address(ep.address)[1]), timeout=10) as raw:
        raw.recv(4096)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 200)
    assert ep.ready.wait(10)
    ep.ready.clear()
    assert isinstance(ep.errors[-1], handshake.HandshakeError)
    client = connect(ep.address, SESSION, KEY, lambda i: None, 1 << 20, 1 << 20)
    client.send(b"still here")
    assert ep.connection().recv().payload == b"still here"
    ep.close()
