"""The cross-node data path without Ray: framing, chunking, the handshake, the plan check, faults, adoption.

Each test runs a real data server on 127.0.0.1 and real connections to it; what Ray would deliver to the
executor is collected by a fake ``deliver``. The same path between Ray nodes is exercised by
tests/resource_manager/test_multinode.py.
"""

from __future__ import annotations

import gc
import socket
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways.messages import Deliver
from pathways.ops import Aval, Recv, Route
from pathways.protocol import frames as pframes
from pathways.protocol import handshake
from pathways.protocol.connection import Connection, recv_bytes
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.transfer import Landed, Landing, assemble, index_of
from resource_manager.host.transport.network import frames
from resource_manager.host.transport.network.frames import Chunk, ProtocolError
from resource_manager.host.transport.network.links import Links, NetworkError, connect
from resource_manager.host.transport.network.path import NetworkConfig, NetworkPath, landing_alloc
from resource_manager.host.transport.network.receives import Expected, Receives, expected_from_op
from resource_manager.host.transport.network.scatter import Scattered, Target
from resource_manager.host.transport.network.server import DataServer

SECRET = b"s" * 32
SENDER, RECEIVER = (0, 0), (1, 0)


class Collected:
    """What the data path hands to the receive side: (key, source island, shard) -> array (the sending host is
    checked by the data path)."""

    def __init__(self) -> None:
        self.pieces: dict[tuple, np.ndarray] = {}
        self.cond = threading.Condition()

    def __call__(self, key: int, sender: tuple[int, int], shard: tuple, array: np.ndarray) -> None:
        with self.cond:
            self.pieces[(key, sender[0], shard)] = array
            self.cond.notify_all()

    def deliver(self, msg: Deliver, pieces: tuple, sender: tuple[int, int]) -> None:
        """The receive side's one way in (``transport.interface.Inbound``), as a network path uses it."""
        for shard, array in zip(msg.shards, pieces):
            self(msg.key, sender, shard, array)

    def wait(self, n: int, timeout: float = 10.0) -> dict:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.pieces) >= n, timeout), self.pieces.keys()
            return dict(self.pieces)


@pytest.fixture
def receiver():
    got = Collected()
    pool = BufferPool()
    receives = Receives(got, unclaimed_limit=64 << 20, stale_s=60.0)
    server = DataServer(RECEIVER, SECRET, "127.0.0.1", receives, landing_alloc(pool.take), ceiling=1 << 30)
    yield server, receives, got, pool
    server.close()


def rows(n: int, parts: int) -> list[tuple]:
    return [((k * n // parts, (k + 1) * n // parts), (0, 64)) for k in range(parts)]


def expect_rows(receives: Receives, key: int, n: int, parts: int, sender: int = 0) -> None:
    receives.expect(key, Expected(0, {sender: frozenset(rows(n, parts))}, np.dtype(np.float32), (n, 64)))


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- frames and chunking ---------------------------------------------------------------------------------------

def test_chunks_cover_every_byte_once_in_order():
    assert frames.chunks([10, 0, 25], 8) == [Chunk(0, 0, 8), Chunk(0, 8, 2), Chunk(2, 0, 8), Chunk(2, 8, 8),
                                             Chunk(2, 16, 8), Chunk(2, 24, 1)]
    assert frames.chunks([16], 16) == [Chunk(0, 0, 16)]
    with pytest.raises(ValueError):
        frames.chunks([1], 0)


def test_stream_count_grows_with_the_bytes_up_to_the_limit():
    assert frames.stream_count(1000, 4, 4 << 20) == 1
    assert frames.stream_count(9 << 20, 4, 4 << 20) == 2
    assert frames.stream_count(1 << 30, 4, 4 << 20) == 4


def test_header_round_trip_and_what_it_refuses():
    raw = frames.encode_header(7, ((0, 4), (2, 6)), "bfloat16", 32, 8, 16)
    header = frames.decode_header(raw, ceiling=1 << 20)
    assert (header.key, header.shard, header.dtype.name, header.total, header.offset, header.length) == (
        7, ((0, 4), (2, 6)), "bfloat16", 32, 8, 16)
    assert header.shape == (4, 4)
    bad = {
        "over the ceiling": frames.encode_header(1, ((0, 1 << 20),), "float32", 4 << 20, 0, 1),
        "disagrees with its shard": frames.encode_header(1, ((0, 4),), "float32", 17, 0, 1),
        "past the end": frames.encode_header(1, ((0, 4),), "float32", 16, 8, 9),
        "no such dtype": frames.encode_header(1, ((0, 4),), "float99", 16, 0, 1),
        "backwards range": frames.encode_header(1, ((4, 0),), "float32", 16, 0, 1),
    }
    for why, raw in bad.items():
        with pytest.raises(ProtocolError):
            frames.decode_header(raw, ceiling=1 << 20)
            pytest.fail(why)
    with pytest.raises(ProtocolError):
        frames.decode_header(b"\xc1garbage", ceiling=1 << 20)


def test_a_recv_op_accepts_only_the_shards_its_plan_routes_to_this_host():
    routes = (Route(0, 0, (((0, 4), (0, 4)),)), Route(0, 1, (((0, 4), (0, 4)),)), Route(1, 1, (((4, 8), (0, 4)),)))
    op = Recv(9, "s1", (), Aval((8, 4), "float32"), 3, routes)
    exp = expected_from_op(op, 1)
    assert exp.src_island == 3 and exp.senders == {0: frozenset({((0, 4), (0, 4))}), 1: frozenset({((4, 8), (0, 4))})}
    assert expected_from_op(op, 2) is None  # nothing of it lands on host 2
    receives = Receives(lambda *piece: None, unclaimed_limit=1 << 20, stale_s=60.0)
    f32 = np.dtype(np.float32)
    assert receives.verdict((3, 1), 5, ((4, 8), (0, 4)), f32) == "later"  # not admitted yet: it may wait
    receives.expect(5, exp)
    check = receives.verdict
    assert check((3, 1), 5, ((4, 8), (0, 4)), f32) == "ok"
    assert "not island 2" in check((2, 1), 5, ((4, 8), (0, 4)), f32)
    assert "does not route" in check((3, 0), 5, ((4, 8), (0, 4)), f32)
    assert "names no shards" in check((3, 7), 5, ((4, 8), (0, 4)), f32)
    assert "not float16" in check((3, 1), 5, ((4, 8), (0, 4)), np.dtype(np.float16))
    receives.finished(5)
    assert "already finished" in check((3, 1), 5, ((4, 8), (0, 4)), f32)


def test_config_from_the_environment():
    assert NetworkConfig.from_env({}) == NetworkConfig()
    cfg = NetworkConfig.from_env({"PATHWAYS_NETWORK": "off", "PATHWAYS_NETWORK_STREAMS": "4",
                                  "PATHWAYS_NETWORK_PORTS": "47000-47010", "PATHWAYS_NETWORK_MAX_RATE": "1e6"})
    assert (cfg.enabled, cfg.streams, cfg.ports, cfg.max_rate) == (False, 4, range(47000, 47011), 1e6)


# -- sending and landing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("streams,chunk", [(1, 8 << 20), (3, 64 << 10)])
def test_shards_arrive_whole_in_aligned_landing_buffers(receiver, streams, chunk):
    server, receives, got, pool = receiver
    value = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)
    expect_rows(receives, 11, 4096, 4)
    links = Links(SENDER, SECRET, streams=streams, chunk_bytes=chunk, min_stream_bytes=1)
    pieces = [(r, value[r[0][0]:r[0][1]]) for r in rows(4096, 4)]
    assert links.send(RECEIVER, server.address, 11, pieces) == value.nbytes
    landed = got.wait(4)
    for shard, data in pieces:
        array = landed[(11, 0, shard)]
        assert type(array) is Landed and array.ctypes.data % 64 == 0
        np.testing.assert_array_equal(array, data)
    assert 1 <= links.stats()["net_streams_opened"] <= streams  # helpers that find nothing left open none
    assert server.stats()["net_pieces_in"] == 4 and server.stats()["net_partial_bytes"] == 0
    links.close()


def test_a_large_send_spreads_over_several_connections(receiver):
    server, receives, got, _ = receiver
    expect_rows(receives, 12, 4096, 4)
    value = np.ones((4096, 64), np.float32)
    links = Links(SENDER, SECRET, streams=3, chunk_bytes=64 << 10, min_stream_bytes=1, rate=8e6)  # 130 ms
    links.send(RECEIVER, server.address, 12, [(r, value[r[0][0]:r[0][1]]) for r in rows(4096, 4)])
    assert len(got.wait(4)) == 4
    assert links.stats()["net_streams_opened"] == 3 and server.stats()["net_connections"] == 3
    links.close()


def test_many_sends_in_flight_share_the_connection_pool(receiver):
    server, receives, got, _ = receiver
    links = Links(SENDER, SECRET, streams=2, chunk_bytes=32 << 10, min_stream_bytes=1)
    values = {key: np.full((256, 64), key, np.float32) for key in range(20)}
    for key in values:
        expect_rows(receives, key, 256, 2)
    threads = [threading.Thread(target=links.send, args=(RECEIVER, server.address, key,
                                                         [(r, v[r[0][0]:r[0][1]]) for r in rows(256, 2)]))
               for key, v in values.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    landed = got.wait(40)
    assert all(np.all(landed[(key, 0, r)] == key) for key in values for r in rows(256, 2))
    assert links.stats()["net_streams_opened"] <= 2
    links.close()


def test_pieces_before_their_receive_is_admitted_wait_for_it(receiver):
    server, receives, got, _ = receiver
    links = Links(SENDER, SECRET)
    value = np.arange(512 * 64, dtype=np.float32).reshape(512, 64)
    links.send(RECEIVER, server.address, 5, [(r, value[r[0][0]:r[0][1]]) for r in rows(512, 2)])
    wait_for(lambda: receives.stats()["net_staged"] == 2)
    assert not got.pieces and receives.unclaimed_bytes == value.nbytes
    expect_rows(receives, 5, 512, 2)
    landed = got.wait(2)
    np.testing.assert_array_equal(landed[(5, 0, rows(512, 2)[1])], value[256:])
    assert receives.unclaimed_bytes == 0
    links.close()


def test_adopted_landing_buffers_become_device_memory_without_a_copy():
    pool = BufferPool()
    alloc = landing_alloc(pool.take)
    devices = jax.devices()[:4]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    value = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    pieces = {}
    for k, idx in enumerate(rows(64, 4)):
        idx = (idx[0], (0, 8))
        buf = alloc((16, 8), np.float32)
        buf[...] = value[16 * k:16 * (k + 1)]
        pieces[idx] = buf
    wanted = [(d, (r[0], (0, 8))) for d, r in zip(devices, rows(64, 4))]
    array = assemble(Landing((64, 8), np.dtype(np.float32), sharding, wanted), pieces, pool.take)
    np.testing.assert_array_equal(np.asarray(array), value)
    for shard in array.addressable_shards:
        assert shard.data.unsafe_buffer_pointer() == pieces[index_of(shard.index, array.shape)].ctypes.data
    del array, pieces, shard, buf
    gc.collect()
    assert pool.stats()["pool_free_bytes"] >= 4 * 16 * 8 * 4  # back in the pool once the array is gone


# -- scattered: straight into the devices' regions ---------------------------------------------------------------

def _column_blocks(n: int, cols: int, parts: int) -> tuple:
    return tuple(((0, n), (k * cols // parts, (k + 1) * cols // parts)) for k in range(parts))


def _quarters(n: int, cols: int) -> list:  # a (2, 2) layout: row halves by column halves
    return [((a, b), (c, d)) for a, b in ((0, n // 2), (n // 2, n)) for c, d in ((0, cols // 2), (cols // 2, cols))]


def _column_landing(n: int, cols: int) -> Landing:
    devices = jax.devices()[:4]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P(None, "x"))
    return Landing((n, cols), np.dtype(np.float32), sharding, list(zip(devices, _column_blocks(n, cols, 4))))


def expect_scattered(receives: Receives, key: int, shards: list, landing: Landing) -> None:
    receives.expect(key, Expected(0, {0: frozenset(shards)}, landing.dtype, landing.shape,
                                  Target(landing.regions, landing.dtype)))


@pytest.mark.parametrize("streams,chunk", [(1, 8 << 20), (3, 10_000)])
def test_a_resharded_receive_lands_straight_in_the_devices_regions(receiver, streams, chunk):
    """(2, 2) quarters land as (1, 4) column blocks: each chunk read into the blocks it feeds, no regather, and
    the devices adopt the blocks' buffers as they are."""
    server, receives, got, pool = receiver
    value = np.random.default_rng(3).standard_normal((512, 256)).astype(np.float32)
    landing = _column_landing(512, 256)
    shards = _quarters(512, 256)
    expect_scattered(receives, 21, shards, landing)
    links = Links(SENDER, SECRET, streams=streams, chunk_bytes=chunk, min_stream_bytes=1)
    links.send(RECEIVER, server.address, 21, [(r, np.ascontiguousarray(value[r[0][0]:r[0][1], r[1][0]:r[1][1]]))
                                              for r in shards])
    landed = got.wait(4)
    pieces = {shard: landed[(21, 0, shard)] for shard in shards}
    assert all(type(p) is Scattered and p.nbytes == value.nbytes // 4 for p in pieces.values())
    assert server.stats()["net_pieces_scattered"] == 4
    array = assemble(landing, pieces, pool.take)
    np.testing.assert_array_equal(np.asarray(array), value)
    buffers = {b.ctypes.data for b in _target_of(pieces).buffers(pool.take)}
    assert {shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards} == buffers  # adopted as is
    links.close()


def _target_of(pieces: dict) -> Target:
    return next(iter(pieces.values())).target


def test_a_shard_that_came_before_its_receive_joins_the_scattered_ones(receiver):
    """One quarter lands whole while its receive is not admitted yet; the rest, after, straight in the regions:
    the landing copies the early one into the same buffers."""
    server, receives, got, pool = receiver
    value = np.random.default_rng(4).standard_normal((256, 128)).astype(np.float32)
    landing = _column_landing(256, 128)
    shards = _quarters(256, 128)
    links = Links(SENDER, SECRET, streams=1)

    def send(rs: list) -> None:
        links.send(RECEIVER, server.address, 22, [(r, np.ascontiguousarray(value[r[0][0]:r[0][1], r[1][0]:r[1][1]]))
                                                  for r in rs])

    send(shards[:1])
    wait_for(lambda: receives.stats()["net_staged"] == 1)
    expect_scattered(receives, 22, shards, landing)
    send(shards[1:])
    landed = got.wait(4)
    pieces = {shard: landed[(22, 0, shard)] for shard in shards}
    assert [type(pieces[s]) for s in shards] == [Landed, Scattered, Scattered, Scattered]
    np.testing.assert_array_equal(np.asarray(assemble(landing, pieces, pool.take)), value)
    links.close()


def test_a_sender_dying_mid_chunk_of_a_scattered_shard_delivers_nothing(receiver):
    server, receives, got, pool = receiver
    landing = _column_landing(256, 128)
    shards = _quarters(256, 128)
    expect_scattered(receives, 23, shards, landing)
    conn = authenticated(server)
    nbytes = 128 * 64 * 4
    announce(conn, frames.encode_header(23, shards[0], "float32", nbytes, 0, nbytes), nbytes)
    conn.sock.sendall(bytes(10_000))
    wait_for(lambda: server.stats()["net_partial_bytes"] == nbytes)
    conn.close()
    wait_for(lambda: server.stats()["net_released_bytes"] == nbytes)
    assert not got.pieces and server.stats()["net_pieces_scattered"] == 0
    receives.finished(23)  # the receive fails: its regions' buffers go back to the pool
    gc.collect()
    assert pool.stats()["pool_free_bytes"] >= landing.nbytes


# -- only the expected peer --------------------------------------------------------------------------------------

def test_a_peer_without_the_secret_is_refused(receiver):
    server, receives, got, _ = receiver
    with pytest.raises((ProtocolError, ConnectionError)):
        connect(server.address, SENDER, RECEIVER, b"x" * 32, timeout=5.0)
    with socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1]))) as raw:
        _, _, id_len = handshake.SERVER_HELLO.unpack(recv_bytes(raw, handshake.SERVER_HELLO.size))
        recv_bytes(raw, id_len)
        raw.sendall(b"GET / HTTP/1.1\r\n" * 5)  # as long as a hello: read whole, closed cleanly
        assert raw.recv(1) == b""  # closed on us
    wait_for(lambda: server.stats()["net_auth_refused"] == 2)
    assert not got.pieces and server.stats()["net_connections"] == 0


def test_a_closed_server_takes_no_connection(receiver):
    server, _, _, _ = receiver
    time.sleep(0.05)  # its accept thread waits in accept()
    server.close()
    with pytest.raises(OSError):  # refused: nothing listens there any more (senders fall back at once)
        socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1])), timeout=2.0).close()


def test_a_sender_checks_the_server_is_the_host_it_meant(receiver):
    server, _, _, _ = receiver
    with pytest.raises(ProtocolError, match="is host"):
        connect(server.address, SENDER, (1, 1), SECRET, timeout=5.0)


def test_pieces_the_plan_does_not_name_are_refused_and_the_link_carries_on(receiver):
    server, receives, got, _ = receiver
    expect_rows(receives, 9, 256, 2, sender=0)
    value = np.ones((256, 64), np.float32)
    intruder = Links((0, 1), SECRET, streams=1)  # host 1 of island 0: not a sender of receive 9
    intruder.send(RECEIVER, server.address, 9, [(rows(256, 2)[0], value[:128])])
    wrong_island = Links((4, 0), SECRET, streams=1)
    wrong_island.send(RECEIVER, server.address, 9, [(rows(256, 2)[0], value[:128])])
    sender = Links(SENDER, SECRET, streams=1)
    sender.send(RECEIVER, server.address, 9, [(((0, 128), (0, 32)), value[:128, :32].copy())])  # not its shard
    wait_for(lambda: receives.stats()["net_refused"] == 3)
    sender.send(RECEIVER, server.address, 9, [(r, value[r[0][0]:r[0][1]]) for r in rows(256, 2)])
    assert len(got.wait(2)) == 2
    receives.finished(9)
    sender.send(RECEIVER, server.address, 9, [(rows(256, 2)[0], value[:128])])  # after it finished
    wait_for(lambda: receives.stats()["net_refused"] == 4)
    assert len(got.pieces) == 2 and server.stats()["net_protocol_errors"] == 0
    for links in (intruder, wrong_island, sender):
        links.close()


def authenticated(server: DataServer, me=SENDER) -> Connection:
    return connect(server.address, me, RECEIVER, SECRET, timeout=5.0)


def announce(conn: Connection, header: bytes, nbytes: int) -> None:
    """The next frame's head and header, announcing ``nbytes`` of data that the caller sends (or does not)."""
    conn._sent += 1
    conn.sock.sendall(pframes.head(conn._key, pframes.TO_SERVER, conn._sent, header, nbytes) + header)


def test_an_absurd_announced_size_ends_the_connection_before_any_allocation(receiver):
    server, receives, _, pool = receiver
    expect_rows(receives, 3, 256, 2)
    before = pool.stats()["pool_allocated"]
    for raw in (frames.encode_header(3, ((0, 1 << 30), (0, 64)), "float32", 1 << 38, 0, 1 << 20),  # > ceiling
                frames.encode_header(3, rows(256, 2)[0], "float32", 1 << 29, 0, 1 << 20)):  # != its shard
        conn = authenticated(server)
        announce(conn, raw, 1 << 20)
        assert conn.sock.recv(1) == b""  # dropped
        conn.close()
    conn = authenticated(server)
    announce(conn, frames.encode_header(3, rows(256, 2)[0], "float32", 256 * 64 * 2, 0, 256 * 64 * 2), 1 << 40)
    assert conn.sock.recv(1) == b""  # more data than the ceiling, announced in the frame's head: dropped
    conn.close()
    wait_for(lambda: server.stats()["net_protocol_errors"] == 3)
    assert pool.stats()["pool_allocated"] == before


def test_a_forged_or_replayed_frame_ends_the_connection_before_its_header_is_read(receiver):
    server, receives, got, pool = receiver
    expect_rows(receives, 3, 256, 2)
    before = pool.stats()["pool_allocated"]
    header = frames.encode_header(3, rows(256, 2)[0], "float32", 256 * 64 * 2, 0, 256 * 64 * 2)
    forged = authenticated(server)
    prefix = pframes.PREFIX.pack(len(header), 256 * 64 * 2, 1)
    forged.sock.sendall(prefix + pframes.mac(b"k" * 32, pframes.TO_SERVER, prefix, header) + header)
    assert forged.sock.recv(1) == b""
    replayed = authenticated(server)
    announce(replayed, header, 0)  # frame 1, carrying no data: refused for its length, after its MAC passed
    assert replayed.sock.recv(1) == b""
    again = authenticated(server)
    again.send(frames.encode_probe(4), (np.zeros(4, np.uint8),))
    assert again.recv().payload == frames.ACK
    again.sock.sendall(pframes.head(again._key, pframes.TO_SERVER, 1, header, 0) + header)  # frame 1 once more
    assert again.sock.recv(1) == b""
    wait_for(lambda: server.stats()["net_protocol_errors"] == 3)
    assert not got.pieces and pool.stats()["pool_allocated"] == before + 1  # the probe's buffer, nothing else


def test_unclaimed_pieces_stay_within_their_budget(receiver):
    server, receives, _, _ = receiver
    links = Links(SENDER, SECRET, streams=1)
    big = np.zeros((1 << 20, 16), np.float32)  # 64 MiB for a receive nobody admitted: over the 64 MiB budget
    links.send(RECEIVER, server.address, 77, [(((0, 1), (0, 16)), big[:1])])
    with pytest.raises(NetworkError):
        for _ in range(3):  # the server drops the link; the write that notices fails
            links.send(RECEIVER, server.address, 78, [(((0, 1 << 20), (0, 16)), big)])
    assert receives.unclaimed_bytes <= receives.unclaimed_limit
    links.close()


# -- faults ------------------------------------------------------------------------------------------------------

def test_a_sender_dying_mid_chunk_releases_the_partial_piece(receiver):
    server, receives, got, pool = receiver
    expect_rows(receives, 4, 4096, 1)
    conn = authenticated(server)
    announce(conn, frames.encode_header(4, rows(4096, 1)[0], "float32", 4096 * 64 * 4, 0, 4096 * 64 * 4),
             4096 * 64 * 4)
    conn.sock.sendall(bytes(100_000))
    wait_for(lambda: server.stats()["net_partial_bytes"] == 4096 * 64 * 4)
    conn.close()  # the sending process is gone
    wait_for(lambda: server.stats()["net_released_bytes"] == 4096 * 64 * 4)
    assert server.stats()["net_partial_bytes"] == 0 and not got.pieces
    gc.collect()
    assert pool.stats()["pool_free_bytes"] >= 4096 * 64 * 4  # the landing buffer is back in the pool


def test_a_failed_island_releases_what_was_landing_from_it(receiver):
    server, receives, _, _ = receiver
    expect_rows(receives, 6, 4096, 1)
    conn = authenticated(server)
    announce(conn, frames.encode_header(6, rows(4096, 1)[0], "float32", 4096 * 64 * 4, 0, 4096 * 64 * 4),
             4096 * 64 * 4)
    conn.sock.sendall(bytes(4096))
    wait_for(lambda: server.stats()["net_partial_bytes"] > 0)
    assert server.drop(island=0) == 4096 * 64 * 4
    conn.close()
    assert server.stats()["net_partial_bytes"] == 0


def test_a_receiver_dying_mid_transfer_fails_only_that_send():
    """Host (1, 0) dies while a transfer to it streams: that send fails, the one to (1, 1) lands whole. The sends are
    paced to take seconds, so host (1, 0) is gone long before its last chunk could go, however busy the machine."""
    got = [Collected(), Collected()]
    pools = [BufferPool(), BufferPool()]
    receives = [Receives(g, 1 << 30, 60.0) for g in got]
    servers = [DataServer((1, h), SECRET, "127.0.0.1", r, landing_alloc(p.take), 1 << 30)
               for h, r, p in zip((0, 1), receives, pools)]
    value = np.ones((1 << 16, 256), np.float32)  # 64 MiB to each, paced at 32 MB/s for both: about 4 s on the wire
    for r in receives:
        r.expect(1, Expected(0, {0: frozenset({((0, 1 << 16), (0, 256))})}, np.dtype(np.float32), value.shape))
    links = Links(SENDER, SECRET, streams=2, chunk_bytes=1 << 20, rate=32e6)
    errors: dict[int, BaseException | None] = {}

    def send(h: int) -> None:
        try:
            links.send((1, h), servers[h].address, 1, [(((0, 1 << 16), (0, 256)), value)])
            errors[h] = None
        except NetworkError as exc:
            errors[h] = exc

    threads = [threading.Thread(target=send, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    wait_for(lambda: servers[0].stats()["net_bytes_in"] > 0, timeout=60)
    servers[0].close()  # host (1, 0) dies while its transfer streams
    for t in threads:
        t.join(120)
    assert isinstance(errors.get(0), NetworkError), errors
    assert errors.get(1, "unfinished") is None, errors
    np.testing.assert_array_equal(got[1].wait(1, timeout=60)[(1, 0, ((0, 1 << 16), (0, 256)))], value)
    servers[1].close()
    links.close()


def test_a_restarted_island_is_sent_to_at_its_new_address_at_once(receiver):
    old, _, _, _ = receiver
    got = Collected()
    new_receives = Receives(got, 64 << 20, 60.0)
    new = DataServer(RECEIVER, SECRET, "127.0.0.1", new_receives, landing_alloc(BufferPool().take), 1 << 30)
    table = {RECEIVER: {"node": "the receiver's", "data": old.address}}
    path = NetworkPath(SENDER, "the sender's", "127.0.0.1", SECRET, NetworkConfig(streams=1), landing_alloc(
        BufferPool().take), Collected(), lambda: dict(table), stale_s=60.0)
    value = np.ones((64, 64), np.float32)
    shard = ((0, 64), (0, 64))
    try:
        old.close()  # the receiving island's host dies
        assert not path.push(*RECEIVER, 1, [shard], [value]) and path.fallbacks == 1  # the object store, for now
        table[RECEIVER] = {"node": "the receiver's", "data": new.address}  # it restarted with a new server
        path.island_restored(RECEIVER[0])
        new_receives.expect(2, Expected(0, {0: frozenset({shard})}, np.dtype(np.float32), value.shape))
        assert path.push(*RECEIVER, 2, [shard], [value])  # not left to the object store for RETRY_S
        np.testing.assert_array_equal(got.wait(1)[(2, 0, shard)], value)
    finally:
        path.close()
        new.close()
