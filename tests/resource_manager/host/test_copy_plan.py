"""Copy plans of lent pieces (resource_manager/host/copy_plan.py), without Ray: planned once per pair of shardings,
bitwise the array resharded, each replicated region read once, gaps and overlaps refused, the cache bounded."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.copy_plan import Plans, make
from resource_manager.host.transfer import Landing, assemble, index_of
from resource_manager.host.transport import direct
from resource_manager.host.transport.direct import Lent

pytestmark = pytest.mark.skipif(direct._readv is None, reason="process_vm_readv is Linux only")


def lend(value: np.ndarray, mesh: Mesh, spec: P) -> tuple[dict, list]:
    """``value``'s distinct shards under ``spec``, lent from this process as a sender on the same node lends them."""
    pieces, keep = {}, []
    for k, idx in enumerate(NamedSharding(mesh, spec).devices_indices_map(value.shape).values()):
        region = index_of(idx, value.shape)
        if region not in pieces:
            keep.append(np.ascontiguousarray(value[idx]))
            pieces[region] = Lent(os.getpid(), keep[-1].ctypes.data, region, (0, 0), k, "")
    return pieces, keep


def landing(shape: tuple[int, ...], dtype: np.dtype, mesh: Mesh, spec: P) -> Landing:
    sharding = NamedSharding(mesh, spec)
    wanted = [(d, index_of(idx, shape)) for d, idx in sharding.devices_indices_map(shape).items()]
    return Landing(shape, np.dtype(dtype), sharding, wanted)


def meshes() -> tuple[Mesh, Mesh, Mesh]:
    devices = np.array(jax.devices()[:4])
    return (Mesh(devices.reshape(2, 2), ("data", "model")), Mesh(devices.reshape(1, 4), ("data", "model")),
            Mesh(devices.reshape(4), ("x",)))


@pytest.mark.parametrize("case", ["fsdp_to_model", "rows_to_columns", "to_replicated", "matching", "3d", "int8"])
def test_a_landing_by_plan_is_bitwise_the_resharded_array_and_planned_once(case):
    square, wide, line = meshes()
    shape, dtype, src, dst = {
        "fsdp_to_model": ((64, 96), np.float32, (square, P("data", "model")), (wide, P(None, "model"))),
        "rows_to_columns": ((128, 64), np.float32, (line, P("x")), (line, P(None, "x"))),
        "to_replicated": ((32, 16), np.float32, (square, P("model", "data")), (square, P())),
        "matching": ((64, 32), np.float32, (line, P("x")), (line, P("x"))),
        "3d": ((8, 12, 16), np.float32, (square, P("model", None, "data")), (wide, P("model"))),
        "int8": ((40, 24), np.int8, (square, P("data", "model")), (square, P(None, "data"))),
    }[case]
    value = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    pieces, keep = lend(value, *src)
    where = landing(shape, dtype, *dst)
    plans = Plans()
    pool = BufferPool()
    for step in range(3):
        order = tuple(sorted(pieces))
        plan = plans.get(tuple(idx for _, idx in where.wanted), order, value.itemsize)
        buffers = [pool.take([b - a for a, b in r], value.dtype) for r in plan.regions]
        direct.read_all(plan.reads([pieces[k] for k in order], buffers))
        assert plan.nbytes == sum(b.nbytes for b in buffers)
        for region, buffer in zip(plan.regions, buffers):
            assert buffer.tobytes() == value[tuple(slice(a, b) for a, b in region)].tobytes()
        assert plans.stats()["copy_plans_made"] == 1 and plans.stats()["copy_plans_reused"] == step
    array = assemble(where, pieces, pool.take)  # the host's path: the same plan, replicas copied locally
    assert np.asarray(array).tobytes() == value.tobytes()
    for shard in array.addressable_shards:
        assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes()


def test_a_replicated_region_is_read_once_and_each_device_gets_a_buffer_of_its_own():
    square, _, _ = meshes()
    value = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    pieces, keep = lend(value, square, P("data"))
    where = landing(value.shape, value.dtype, square, P(None, "model"))  # each column block on two devices
    plan = make(tuple(idx for _, idx in where.wanted), tuple(sorted(pieces)), 4)
    assert len(plan.regions) == 2 and sorted(plan.slots) == [0, 0, 1, 1]
    assert plan.nbytes == value.nbytes  # read once, not once per device
    array = assemble(where, pieces)
    pointers = {shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards}
    assert len(pointers) == 4  # no two devices share a buffer (a donation on one must not change another)
    np.testing.assert_array_equal(np.asarray(array), value)


def test_pieces_that_leave_a_gap_or_overlap_are_refused():
    whole = (((0, 8), (0, 4)),)
    with pytest.raises(ValueError, match="cover only part of"):
        make(whole, (((0, 4), (0, 4)),), 4)
    with pytest.raises(ValueError, match="overlap within"):
        make(whole, (((0, 6), (0, 4)), ((4, 8), (0, 4))), 4)


def test_the_cache_of_plans_keeps_within_its_bytes():
    plans = Plans(limit=4 << 10)
    for rows in range(8, 72, 8):  # eight shapes, each a plan of row-by-row runs
        wanted = (((0, rows), (0, 64)),)
        pieces = (((0, rows), (0, 32)), ((0, rows), (32, 64)))
        plans.get(wanted, pieces, 4)
        plans.get(wanted, pieces, 4)
    stats = plans.stats()
    assert stats["copy_plans_made"] == 8 and stats["copy_plans_reused"] == 8
    assert 0 < stats["copy_plan_bytes"] <= 4 << 10 and 0 < stats["copy_plans"] < 8  # the oldest went first
