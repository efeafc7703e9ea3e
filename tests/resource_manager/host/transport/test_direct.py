"""Same-node transfers: shards copied straight out of the sending host, and the buffers they land in."""

from __future__ import annotations

import gc
import os
import subprocess
import time

import jax
import numpy as np
import pytest
from conftest import host_stats
from jax.sharding import PartitionSpec as P

import pathways as pw
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.transfer import region
from resource_manager.host.transport import direct
from resource_manager.host.transport.direct import Lent

pytestmark = pytest.mark.skipif(direct._readv is None, reason="process_vm_readv is Linux only")


def blocks(shape: tuple[int, ...], cuts: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """The regions of ``shape`` cut into ``cuts[d]`` equal blocks along each dimension d."""
    grids = [[(k * n // c, (k + 1) * n // c) for k in range(c)] for n, c in zip(shape, cuts)]
    out = [()]
    for grid in grids:
        out = [r + (g,) for r in out for g in grid]
    return out


def lend_all(value: np.ndarray, cuts: list[int]) -> tuple[dict, list]:
    """``value`` cut into pieces that stay in this process, as a receiver would see them lent."""
    keep, pieces = [], {}
    for i, idx in enumerate(blocks(value.shape, cuts)):
        piece = np.ascontiguousarray(value[tuple(slice(a, b) for a, b in idx)])
        keep.append(piece)
        pieces[idx] = Lent(os.getpid(), piece.ctypes.data, idx, (0, 0), i, "")
    return pieces, keep


@pytest.mark.parametrize("shape,have,want", [
    ((64, 48), [4, 1], [1, 4]),        # row blocks in, column blocks out
    ((64, 48), [4, 1], [2, 1]),        # two pieces per region, whole rows: merged runs
    ((8, 6, 10), [2, 3, 1], [1, 2, 5]),
    ((1000,), [3], [7]),               # uneven 1-d cuts
    ((64, 48), [2, 1], [2, 1]),        # each region is one whole piece: one read each
    ((1536, 1024), [1, 1], [1, 1]),    # a piece larger than a read chunk: several reads
    ((), [], []),                      # a scalar
])
def test_copy_into_matches_numpy_slicing(shape, have, want):
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    pieces, keep = lend_all(value, have)
    for _ in range(2):  # the second time, the runs come from the cache
        lent: list = []
        outs = {idx: region(pieces, idx, value.dtype, lent=lent) for idx in blocks(shape, want)}
        copied = direct.copy_into(lent, value.itemsize)
        assert copied == value.nbytes
        for idx, out in outs.items():
            np.testing.assert_array_equal(out, value[tuple(slice(a, b) for a, b in idx)])


def test_copy_into_two_destinations_wanting_the_same_bytes():
    value = np.arange(4096, dtype=np.int32).reshape(64, 64)
    pieces, keep = lend_all(value, [2, 1])
    whole = ((0, 64), (0, 64))
    lent: list = []
    first, second = (region(pieces, whole, value.dtype, lent=lent) for _ in range(2))
    direct.copy_into(lent, value.itemsize)
    np.testing.assert_array_equal(first, value)
    np.testing.assert_array_equal(second, value)


def test_reading_a_dead_process_raises():
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    piece = Lent(proc.pid, 4096, ((0, 1024),), (0, 0), 1, "")
    out = np.empty(1024, np.float32)
    with pytest.raises(OSError, match=f"process {proc.pid}"):
        direct.copy_into([(piece, out, ((0, 1024),))], 4)
    assert not direct.can_read(proc.pid, 4096, direct.PROBE)


@pytest.mark.skipif(direct._helpers.count == 0, reason="one core: read_all reads on its caller alone")
def test_read_calls_are_shared_by_the_caller_and_a_read_thread(monkeypatch):
    """``read_all`` hands its calls over as one lot: the caller and a read thread take them in turn (each of the
    first two reads waits at a barrier for the other, so one thread alone would break it)."""
    import threading

    value = np.random.default_rng(2).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: several calls
    pieces, keep = lend_all(value, [8, 1])
    lent: list = []
    out = region(pieces, ((0, 2048), (0, 1024)), value.dtype, lent=lent)
    meet, readers = threading.Barrier(2, timeout=30), []
    real = direct._read

    def read(*call):
        readers.append(threading.current_thread().name)
        if len(readers) <= 2:
            meet.wait()
        real(*call)

    monkeypatch.setattr(direct, "_read", read)
    assert direct.copy_into(lent, value.itemsize) == value.nbytes
    np.testing.assert_array_equal(out, value)
    assert len(set(readers)) >= 2 and threading.current_thread().name in readers


def test_a_read_call_that_fails_fails_its_read_all_and_the_read_threads_serve_the_next():
    value = np.ones((1024, 1024), np.float32)  # 4 MiB in 1 MiB calls
    pieces, keep = lend_all(value, [4, 1])
    bad = dict(pieces)
    idx = next(iter(bad))
    bad[idx] = Lent(os.getpid(), 4096, idx, (0, 0), 99, "")  # an address this process does not map
    lent: list = []
    region(bad, ((0, 1024), (0, 1024)), value.dtype, lent=lent)
    with pytest.raises(OSError, match=f"process {os.getpid()}"):
        direct.copy_into(lent, value.itemsize)
    lent = []
    out = region(pieces, ((0, 1024), (0, 1024)), value.dtype, lent=lent)
    assert direct.copy_into(lent, value.itemsize) == value.nbytes
    np.testing.assert_array_equal(out, value)


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = BufferPool()
    a = pool.take((256, 256), np.float32)
    x = jax.device_put(a)  # adopts the aligned buffer without copying
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    del a
    gc.collect()
    b = pool.take((256, 256), np.float32)
    assert pool.reused == 0  # the jax.Array still holds the first buffer
    view = b[3:5]
    del b, x
    gc.collect()
    c = pool.take((256, 256), np.float32)
    assert pool.reused == 1  # the first buffer came back once the jax.Array was gone
    d = pool.take((256, 256), np.float32)
    assert pool.reused == 1 and view.base is not None  # the view keeps the second buffer out of the pool
    assert c.ctypes.data % 64 == 0 and d.ctypes.data % 64 == 0


def test_pool_keeps_at_most_its_limit():
    pool = BufferPool(limit=3 * 2**20)
    held = [pool.take((2**20,), np.uint8) for _ in range(8)]
    del held
    free = pool.stats()["pool_free_bytes"]
    assert 2 * 2**20 < free <= 3 * 2**20


def test_pool_finds_freed_buffers_while_every_take_is_served_from_its_free_list():
    """A take that finds a free buffer of its size does not scan the buffers in use, but every ``COLLECT_EVERY``
    takes one does: a large buffer freed meanwhile still comes back to the pool (and under its limit)."""
    from resource_manager.host.buffer_pool import COLLECT_EVERY

    pool = BufferPool()
    small = [pool.take((1024,), np.uint8) for _ in range(COLLECT_EVERY + 1)]
    del small
    pool.take((1024,), np.uint8)  # none known free yet: this take scans, and the rest are free
    large = pool.take((1 << 20,), np.uint8)
    del large
    before = pool.free_bytes
    for _ in range(COLLECT_EVERY):
        pool.take((1024,), np.uint8)  # each served from the free list
    assert pool.allocated == COLLECT_EVERY + 2 and pool.free_bytes > before + (1 << 20) - COLLECT_EVERY * 1100


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("src_spec,dst_spec", [(P("x", None), P("x", None)), (P("x", None), P(None, "x")),
                                               (P("x", None), P())])
def test_islands_on_one_node_transfer_directly(cluster, src_spec, dst_spec):
    value = np.random.default_rng(1).standard_normal((512, 256)).astype(np.float32)  # 512 KiB
    with pw.slice((4,), ("x",), island=0) as a, pw.slice((4,), ("x",), island=1) as b:
        ident = pw.jit(lambda v: v * 1.0, slice=b, in_specs=(dst_spec,), out_specs=dst_spec)
        move = pw.program(lambda v: ident(v))
        x = pw.put(value, a, src_spec)
        before = host_stats(cluster, 1)
        for _ in range(3):
            np.testing.assert_array_equal(move(x).fetch(timeout=60), value)
        after = host_stats(cluster, 1)
        assert after["bytes_in_direct"] - before["bytes_in_direct"] == 3 * value.nbytes
        assert after["frames_in"] - before["frames_in"] >= 3  # announced on the same-node channel
        assert wait_for(lambda: host_stats(cluster, 0)["lent_bytes"] == 0), "the sender kept lent shards"
        assert host_stats(cluster, 1)["pool_reused"] > 0


def test_small_transfers_travel_inside_the_frame(cluster):
    value = np.arange(16 * 16, dtype=np.int32).reshape(16, 16)
    with pw.slice((4,), ("x",), island=0) as a, pw.slice((2, 2), ("x", "y"), island=1) as b:
        ident = pw.jit(lambda v: v + 1, slice=b, in_specs=(P("y", "x"),), out_specs=P("y", "x"))
        before = host_stats(cluster, 1)
        np.testing.assert_array_equal(pw.program(lambda v: ident(v))(pw.put(value, a, P("x"))).fetch(timeout=60),
                                      value + 1)
        after = host_stats(cluster, 1)
        assert after["bytes_in_direct"] == before["bytes_in_direct"]
        assert after["frames_in"] > before["frames_in"]
