"""The scattered receive's arithmetic and reads: a shard's bytes, read off a real socket in any chunking, land at
their places in the devices' regions, bytes no region wants go nowhere, and short reads resume where they stopped."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pathways.sharding import Index, device_indices, intersection
from resource_manager.host.buffer_pool import aligned_empty
from resource_manager.host.transport.network import scatter
from resource_manager.host.transport.network.scatter import SCRATCH, Layouts, Target, iovecs, receive


class Mesh:
    """What ``device_indices`` needs of a slice."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str, ...]) -> None:
        self.shape, self.axes = shape, axes


def _slices(region: Index, within: Index) -> tuple[slice, ...]:
    return tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(region, within))


def _land(full: np.ndarray, shard: Index, regions: tuple[Index, ...], cuts: list[int], dribble: int = 0
          ) -> list[np.ndarray]:
    """Send ``full``'s ``shard`` over a socket pair in chunks ending at ``cuts`` (``dribble``: in writes of that
    many bytes, so reads come back short) and scatter it into ``regions``' buffers, poisoned with NaN first."""
    target = Target(regions, full.dtype)
    for buf in target.buffers(aligned_empty):
        buf[...] = np.nan
    layout = Layouts().get(shard, regions, full.dtype.itemsize)
    data = np.ascontiguousarray(full[_slices(shard, tuple((0, n) for n in full.shape))]).tobytes()
    a, b = socket.socketpair()

    def send() -> None:
        step = dribble or len(data)
        for k in range(0, len(data), step):
            a.sendall(data[k:k + step])

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        for lo, hi in zip([0, *cuts], [*cuts, len(data)]):
            iov = iovecs(layout, target.bases(aligned_empty), lo, hi - lo)
            assert int(iov[:, 1].sum()) == hi - lo  # every byte of the stretch has a place, scratch included
            assert (iov[:, 1] > 0).all() and (iov[:, 1] <= max(SCRATCH, int(layout.lengths.max(initial=0)))).all()
            receive(b, iov)
    finally:
        sender.join(timeout=10)
        a.close()
        b.close()
    return target.buffers(aligned_empty)


def _check(full: np.ndarray, shard: Index, regions: tuple[Index, ...], buffers: list[np.ndarray]) -> None:
    everything = tuple((0, n) for n in full.shape)
    for region, buf in zip(regions, buffers):
        shared = intersection(shard, region)
        mask = np.ones(buf.shape, bool)
        if shared is not None:
            np.testing.assert_array_equal(buf[_slices(shared, region)], full[_slices(shared, everything)])
            mask[_slices(shared, region)] = False
        assert np.isnan(buf[mask]).all()  # nothing outside the shard's part was written


@pytest.mark.parametrize("chunk", [8 << 20, 4096, 1000, 7])
def test_a_column_block_reshard_lands_every_byte_at_its_place(chunk):
    full = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    shard = device_indices(full.shape, Mesh((2, 2), ("data", "model")), P("data", "model"))[1]
    assert shard == ((0, 128), (256, 512))
    regions = tuple(((0, 256), (k * 128, (k + 1) * 128)) for k in range(4))  # (1, 4): column blocks
    nbytes = len(np.ascontiguousarray(full[0:128, 256:512]).tobytes())
    buffers = _land(full, shard, regions, list(range(chunk, nbytes, chunk)))
    _check(full, shard, regions, buffers)


def test_bytes_no_local_device_wants_go_to_scratch_even_in_long_gaps():
    full = np.random.default_rng(1).standard_normal((64, 4096)).astype(np.float32)
    shard = ((0, 64), (0, 4096))
    regions = (((0, 64), (100, 103)), ((20, 30), (4000, 4096)))  # small parts: most of the shard is unwanted
    layout = Layouts().get(shard, regions, 4)
    assert not layout.whole and layout.nbytes == (64 * 3 + 10 * 96) * 4
    whole_stretch = iovecs(layout, np.zeros(2, np.int64), 0, full.nbytes)
    assert int(whole_stretch[:, 1].sum()) == full.nbytes and whole_stretch[:, 1].max() <= SCRATCH
    _check(full, shard, regions, _land(full, shard, regions, [5000, 5001, 300_000]))


def test_a_shard_that_overlaps_no_region_is_read_and_dropped():
    full = np.arange(1000, dtype=np.float64).reshape(10, 100)
    regions = (((0, 5), (0, 100)),)
    buffers = _land(full, ((5, 10), (0, 100)), regions, [333])
    assert np.isnan(buffers[0]).all()


@pytest.mark.parametrize("dribble", [1, 333, 4096])
def test_a_shard_arriving_in_small_writes_lands_whole(dribble):
    full = np.random.default_rng(2).standard_normal((32, 16, 8)).astype(np.float32)
    shard = ((0, 16), (0, 16), (0, 8))
    regions = (((0, 32), (0, 4), (0, 8)), ((0, 32), (4, 8), (0, 8)), ((0, 32), (8, 12), (0, 8)),
               ((0, 32), (12, 16), (0, 8)))  # runs of 128 bytes, four regions in turn
    _check(full, shard, regions, _land(full, shard, regions, [4096, 4100], dribble=dribble))


def test_a_read_cut_short_resumes_inside_the_segment_it_stopped_in(monkeypatch):
    """A read that returns early (here its socket's receive timeout; a signal does the same) goes on from the
    byte where it stopped: the sender holds the rest until the first read has returned."""
    full = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    shard = ((0, 64), (0, 64))
    regions = (((0, 64), (0, 32)), ((0, 64), (32, 64)))
    target = Target(regions, full.dtype)
    layout = Layouts().get(shard, regions, 4)
    data = full.tobytes()
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
    first_returned = threading.Event()
    returns = []
    real = scatter._recvmsg

    def recvmsg(fd, msg, flags):
        got = real(fd, msg, flags)
        returns.append(got)
        first_returned.set()
        return got

    monkeypatch.setattr(scatter, "_recvmsg", recvmsg)
    split = 1000  # inside the eighth 128-byte run
    a.sendall(data[:split])

    def rest() -> None:
        assert first_returned.wait(10)
        a.sendall(data[split:])

    sender = threading.Thread(target=rest, daemon=True)
    sender.start()
    receive(b, iovecs(layout, target.bases(aligned_empty), 0, len(data)))
    sender.join(10)
    assert returns[0] == split and sum(returns) == len(data)
    np.testing.assert_array_equal(np.concatenate(target.buffers(aligned_empty), axis=1), full)
    a.close()
    b.close()


def test_a_peer_closing_mid_stretch_is_an_error_not_a_hang():
    target = Target((((0, 1024),),), np.dtype(np.uint8))
    layout = Layouts().get(((0, 1024),), target.regions, 1)
    a, b = socket.socketpair()
    a.sendall(bytes(100))
    a.close()
    with pytest.raises(ConnectionError):
        receive(b, iovecs(layout, target.bases(aligned_empty), 0, 1024))
    b.close()


def test_layouts_are_kept_within_their_byte_limit():
    layouts = Layouts(limit=20_000)
    for k in range(1, 40):
        layouts.get(((0, 64 * k), (0, 64)), (((0, 64 * k), (0, 32)), ((0, 64 * k), (32, 64))), 4)
        assert layouts.nbytes <= layouts.limit
    first = layouts.get(((0, 64), (0, 64)), (((0, 64), (0, 32)),), 4)
    assert layouts.get(((0, 64), (0, 64)), (((0, 64), (0, 32)),), 4) is first  # kept: made once


def test_target_buffers_are_taken_once_on_first_use():
    taken = []

    def alloc(shape, dtype):
        taken.append(shape)
        return aligned_empty(shape, dtype)

    target = Target((((0, 4), (0, 8)), ((4, 8), (0, 8))), np.dtype(np.float32))
    assert not taken  # registered, but no data came yet: no memory held
    first = target.buffers(alloc)
    assert target.buffers(alloc) is first and taken == [(4, 8), (4, 8)]
    assert all(b.ctypes.data % 64 == 0 for b in first)
