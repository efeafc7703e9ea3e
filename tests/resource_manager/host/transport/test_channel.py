"""A host's same-node channel (resource_manager/channel.py): frames from allowed peers reach the handler with
the pid the kernel names, a connection from any other process is refused, and a frame announcing more than
the ceilings disconnects its peer before anything is allocated."""

from __future__ import annotations

import os
import queue
import socket
import stat
import sys
import time

import numpy as np
import pytest

from resource_manager.host.transport import channel as channel_module
from resource_manager.host.transport.channel import HEADER, MAX_DATA, MAX_MESSAGE, Channel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED is Linux only")


class Server:
    """A channel whose handler puts every frame on a queue."""

    def __init__(self, allowed=lambda pid: True, fail_on: bytes | None = None) -> None:
        self.frames: queue.Queue = queue.Queue()
        self.fail_on = fail_on
        self.allowed_asked: list[int] = []

        def allowed_pid(pid: int) -> bool:
            self.allowed_asked.append(pid)
            return allowed(pid)

        self.channel = Channel(self.handle, allowed_pid)

    def handle(self, message: bytes, data: memoryview, pid: int) -> None:
        if message == self.fail_on:
            raise ValueError("a frame this handler refuses")
        self.frames.put((message, bytes(data), pid))

    def next(self, timeout: float = 5.0):
        return self.frames.get(timeout=timeout)

    def nothing(self, wait: float = 0.2) -> bool:
        try:
            self.frames.get(timeout=wait)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def server():
    s = Server()
    yield s
    s.channel.close()


@pytest.fixture
def client():
    c = Channel(lambda message, data, pid: None, lambda pid: False)
    yield c
    c.close()


def raw(address: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(address)
    return conn


def closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_frame_reaches_the_handler_with_the_pid_the_kernel_names(server, client):
    arrays = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.int64)]
    client.send(server.channel.address, b"hello", arrays)
    client.send(server.channel.address, b"again")
    message, data, pid = server.next()
    assert message == b"hello" and pid == os.getpid() and server.allowed_asked == [os.getpid()]
    assert data == arrays[0].tobytes() + arrays[1].tobytes()
    assert server.next() == (b"again", b"", os.getpid())  # the same link, frames in order
    assert (server.channel.frames_in, client.frames_out) == (2, 2)


def test_the_socket_is_reachable_by_its_owner_only(server):
    path = server.channel.address
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_a_connection_from_a_process_the_host_does_not_allow_is_refused(client):
    server = Server(allowed=lambda pid: False)
    try:
        conn = raw(server.channel.address)
        try:
            conn.sendall(HEADER.pack(5, 0) + b"hello")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before this process wrote anything: the server closed it at accept
        else:
            assert closed_by_peer(conn)
        assert wait_for(lambda: server.channel.refused == 1)
        assert server.nothing() and server.allowed_asked == [os.getpid()]
        conn.close()
    finally:
        server.channel.close()


@pytest.mark.parametrize("meta, data", [(MAX_MESSAGE + 1, 0), (0, MAX_DATA + 1), (2**32 - 1, 2**32 - 1)])
def test_a_frame_announcing_more_than_the_ceilings_disconnects_before_any_allocation(server, monkeypatch, meta,
                                                                                         data):
    allocated: list[int] = []

    def recording_bytearray(n=0):
        allocated.append(n)
        return bytearray(n)

    monkeypatch.setattr(channel_module, "bytearray", recording_bytearray, raising=False)
    conn = raw(server.channel.address)
    conn.sendall(HEADER.pack(meta, data))
    assert closed_by_peer(conn)
    assert wait_for(lambda: server.channel.refused == 1)
    assert allocated == [HEADER.size], f"allocated {allocated} for a frame announcing {meta} + {data} bytes"
    assert server.nothing()
    conn.close()


def test_a_frame_at_the_ceilings_is_served(server):
    conn = raw(server.channel.address)
    message, data = b"m" * MAX_MESSAGE, b"d" * MAX_DATA
    conn.sendall(HEADER.pack(len(message), len(data)) + message + data)
    got_message, got_data, _ = server.next(timeout=20)
    assert (len(got_message), len(got_data)) == (MAX_MESSAGE, MAX_DATA) and server.channel.refused == 0
    conn.close()


def test_a_frame_the_handler_refuses_fails_alone_and_the_link_carries_on(client):
    server = Server(fail_on=b"bad")
    try:
        for message in (b"first", b"bad", b"after"):
            client.send(server.channel.address, message)
        assert [server.next()[0] for _ in range(2)] == [b"first", b"after"]
        assert server.channel.refused == 1
    finally:
        server.channel.close()


def test_a_peer_that_stops_mid_frame_delivers_nothing(server):
    conn = raw(server.channel.address)
    conn.sendall(HEADER.pack(10, 0) + b"short")
    conn.close()
    assert server.nothing()


def test_sending_to_a_closed_peer_raises_so_the_caller_uses_ray(client):
    server = Server()
    address = server.channel.address
    server.channel.close()
    with pytest.raises(OSError):
        client.send(address, b"hello")


def test_the_socket_folders_of_killed_hosts_are_swept_and_no_other(tmp_path):
    """A killed host never closes its channel: the next channel made on the machine removes the folder of each host
    that no longer runs, and leaves a running host's, a folder of another name, and a link alone."""
    import subprocess

    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    prefix = channel_module.SOCKET_DIR
    killed, running = tmp_path / f"{prefix}{dead.pid}-a1", tmp_path / f"{prefix}{os.getpid()}-b2"
    other, link = tmp_path / f"{prefix}x-c3", tmp_path / f"{prefix}{dead.pid}-d4"
    for folder in (killed, running, other):
        folder.mkdir()
        (folder / "host.sock").touch()
    link.symlink_to(running)
    assert channel_module.sweep(str(tmp_path)) == 1
    assert not killed.exists() and (running / "host.sock").exists() and other.exists() and link.is_symlink()
    server = Server()
    folder = os.path.dirname(server.channel.address)
    assert os.path.basename(folder).startswith(f"{prefix}{os.getpid()}-")
    server.channel.close()
    assert not os.path.exists(folder)
