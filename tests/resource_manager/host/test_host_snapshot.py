"""One host's part of a suspended cluster (``resource_manager.host.snapshot``) without Ray: everything a host's
tenants would lose is saved and comes back on a new host's real parts (``wiring.core``) on this process's CPU
devices, only for the sessions that were restored; any damage is refused before anything read is used."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pathways.errors import PathwaysError
from pathways.messages import CLIENT_ID_BITS
from pathways.ops import Limits, SliceDesc
from pathways.snapshot import Store, host_part
from resource_manager.host import snapshot, wiring
from resource_manager.host.buffers import Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.executables import content_hash
from resource_manager.host.transport.peers import Peers

LIMITS = Limits(0, 1, 1, 4, 1 << 32, 1 << 32)
DESC = SliceDesc("s1", (2,), ("x",), ((0, 0), (0, 1)))
A, B = 1 << CLIENT_ID_BITS, 2 << CLIENT_ID_BITS  # client 1 (tenant "a") and client 2 (tenant "b") ids


def host(*sessions: tuple[int, str]) -> wiring.Parts:
    parts = wiring.core(0, 0, 1, LIMITS, LocalDevices(0), Peers(0, 0, "node"), 5.0, 60.0, lambda report: None)
    for client, tenant in sessions:
        parts.grants.add_session(client, tenant, b"k" * 32)
    return parts


def executable() -> tuple[str, bytes]:
    exported = jax.export.export(jax.jit(lambda v: v + 1.0))(jax.ShapeDtypeStruct((4,), np.float32))
    blob = bytes(exported.serialize())
    return content_hash(blob), blob


@pytest.fixture(scope="module")
def exe() -> tuple[str, bytes]:
    return executable()


@pytest.fixture
def saved(tmp_path, exe):
    """A host holding two tenants' buffers, failures, uploads, executables and stream positions, saved."""
    parts = host((1, "a"), (2, "b"))
    sharded = jax.device_put(np.arange(8, dtype=np.float32), parts.devices.sharding(DESC, ("x",)))
    replicated = jax.device_put(np.full((2, 3), 7, np.int32), parts.devices.sharding(DESC, ()))
    parts.table.put(A + 1, "a", sharded)
    parts.table.put(A + 2, "a", replicated)
    parts.table.put(B + 1, "b", jax.device_put(np.ones(4, np.float32), parts.devices.sharding(DESC, ())))
    parts.table.put(A + 3, "a", Failure("ProgramError", "it failed"))
    parts.table.put(B + 3, "b", Failure("ProgramError", "b's failed"))
    parts.table.fail_range(A + 10, A + 20, "a", Failure("ResourceError", "refused"))
    parts.table.fail_range(B + 10, B + 20, "b", Failure("ResourceError", "b refused"))
    parts.uploads.reserve(A + 30, "a", 16, 1 << 20)
    parts.uploads.fill(A + 30, {((0, 4),): np.array([0, 0, 1, 1], np.float32)})
    parts.uploads.reserve(B + 30, "b", 16, 1 << 20)
    parts.uploads.fill(B + 30, {((0, 4),): np.zeros(4, np.float32)})
    parts.uploads.refuse(A + 31, "a", Failure("ResourceError", "over your parked_bytes budget"))
    exe_hash, blob = exe
    parts.exes.add("a", exe_hash, blob)
    parts.exes.add("b", exe_hash, blob)
    parts.admission.restore({1: 5, 2: 7})
    store = Store(str(tmp_path / "snap"))
    store.prepare()
    record = snapshot.save(parts, store, 0, 0)
    yield store, record, {"sharded": sharded, "replicated": replicated}
    parts.executor.stop()


@pytest.fixture
def fresh():
    """A new, empty host on which only client 1's session (tenant "a") was restored."""
    parts = host((1, "a"))
    yield parts
    parts.executor.stop()


def untouched(parts: wiring.Parts) -> bool:
    return (len(parts.table) == 0 and parts.table.failed_ranges() == [] and parts.uploads.saved() == ([], [])
            and parts.exes.blobs() == {} and parts.admission.positions() == {})


def test_the_saved_record_names_the_files_and_counts_what_they_hold(saved, exe):
    store, record, _ = saved
    data, index = host_part(0, 0)
    assert (record["data"], record["index"], record["island"], record["host"]) == (data, index, 0, 0)
    assert record["buffers"] == 3 and record["array_bytes"] == 8 * 4 + 6 * 4 + 4 * 4
    assert store.size(data) == record["data_bytes"]
    # each distinct shard once (a's halves, a's and b's replicated arrays), two uploads, each tenant's executable
    assert record["data_bytes"] == 8 * 4 + 6 * 4 + 4 * 4 + 16 + 16 + 2 * len(exe[1])
    written = store.read_json(index, record["index_crc"])
    by_id = {b["id"]: b for b in written["buffers"]}
    assert len(by_id[A + 1]["shards"]) == 2  # two devices, two distinct halves
    assert len(by_id[A + 2]["shards"]) == 1  # a replicated buffer's bytes are saved once
    assert by_id[A + 1]["spec"] == ["x"] and by_id[A + 1]["mesh"] == [[0, 0], [0, 1]]


def test_a_restored_host_has_back_what_its_restored_sessions_held_and_nothing_else(saved, fresh, exe):
    store, record, values = saved
    got = snapshot.restore(fresh, store, record, 0, 0)
    assert got == {"island": 0, "host": 0, "buffers": 2, "array_bytes": 8 * 4 + 6 * 4, "buffers_dropped": 1}
    for buffer_id, key in ((A + 1, "sharded"), (A + 2, "replicated")):
        value = fresh.table.lookup(buffer_id, "a").value
        np.testing.assert_array_equal(np.asarray(value), np.asarray(values[key]))
        assert value.dtype == values[key].dtype and value.sharding.spec == values[key].sharding.spec
        assert [fresh.devices.locate(d) for d in value.sharding.mesh.devices.flat] == [(0, 0), (0, 1)]
    assert np.asarray(fresh.table.lookup(A + 1, "a").value + 1).tolist() == list(range(1, 9))  # a usable array
    assert fresh.table.lookup(A + 3, "a").value == Failure("ProgramError", "it failed")
    assert fresh.table.lookup(A + 15, "a").value == Failure("ResourceError", "refused")
    assert B + 1 not in fresh.table and B + 3 not in fresh.table  # client 2's session was not restored
    assert [r[:3] for r in fresh.table.failed_ranges()] == [(A + 10, A + 20, "a")]
    pieces = fresh.uploads.take(A + 30, "a")
    np.testing.assert_array_equal(pieces[((0, 4),)], np.array([0, 0, 1, 1], np.float32))
    assert fresh.uploads.take(B + 30, "b") is None and fresh.uploads.held("b") == 0
    assert fresh.uploads.take(A + 31, "a") == Failure("ResourceError", "over your parked_bytes budget")
    assert fresh.exes.blobs() == {"a": {exe[0]: exe[1]}}
    assert fresh.admission.positions() == {1: 5}


def test_a_changed_byte_in_the_data_is_refused_and_nothing_is_used(saved, fresh):
    store, record, _ = saved
    path = store.path(record["data"])
    with open(path, "r+b") as f:
        f.seek(record["data_bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PathwaysError, match="does not match its checksum; the snapshot is damaged, and nothing of "
                                            "it is used"):
        snapshot.restore(fresh, store, record, 0, 0)
    assert untouched(fresh)


def test_a_data_file_of_another_size_is_refused(saved, fresh):
    store, record, _ = saved
    with open(store.path(record["data"]), "ab") as f:
        f.write(b"\0")
    with pytest.raises(PathwaysError, match=f"holds {record['data_bytes'] + 1} bytes; its index says "
                                            f"{record['data_bytes']}: the suspend that wrote it did not finish"):
        snapshot.restore(fresh, store, record, 0, 0)
    assert untouched(fresh)


def test_a_manifest_that_names_other_files_is_refused(saved, fresh):
    store, record, _ = saved
    with pytest.raises(PathwaysError, match="the manifest gives island 0 host 0 the files .*the snapshot is damaged"):
        snapshot.restore(fresh, store, {**record, "data": "../elsewhere"}, 0, 0)
    with pytest.raises(PathwaysError, match="the manifest gives island 0 host 1"):
        snapshot.restore(fresh, store, record, 0, 1)
    assert untouched(fresh)


def test_a_damaged_index_is_refused(saved, fresh):
    store, record, _ = saved
    with pytest.raises(PathwaysError, match="is damaged \\(its checksum differs from the manifest's\\)"):
        snapshot.restore(fresh, store, {**record, "index_crc": record["index_crc"] ^ 1}, 0, 0)
    assert untouched(fresh)


def rewrite_index(store: Store, record: dict, change) -> dict:
    """The index changed by ``change`` (as a damaged or forged one would be), with a manifest record to match."""
    index = store.read_json(record["index"])
    change(index)
    return {**record, "index_crc": store.write_json(record["index"], index)}


def test_an_index_of_another_host_or_format_is_refused(saved, fresh):
    store, record, _ = saved
    forged = rewrite_index(store, record, lambda index: index.update(host=1))
    with pytest.raises(PathwaysError, match="is not island 0 host 0's part in format"):
        snapshot.restore(fresh, store, forged, 0, 0)
    forged = rewrite_index(store, record, lambda index: index.update(host=0, format=999))
    with pytest.raises(PathwaysError, match="is not island 0 host 0's part in format 1"):
        snapshot.restore(fresh, store, forged, 0, 0)
    assert untouched(fresh)


@pytest.mark.parametrize("offset, nbytes", [(-1, 4), (0, 1 << 40), (1 << 40, 1)])
def test_a_chunk_outside_the_data_file_is_refused(saved, fresh, offset, nbytes):
    store, record, _ = saved

    def move(index: dict) -> None:
        index["buffers"][0]["shards"][0][1][:2] = [offset, nbytes]

    with pytest.raises(PathwaysError, match="lies outside the file .*the snapshot is damaged"):
        snapshot.restore(fresh, store, rewrite_index(store, record, move), 0, 0)
    assert untouched(fresh)


def test_a_buffer_missing_a_shard_is_refused_and_nothing_is_used(saved, fresh):
    store, record, _ = saved

    def drop_shard(index: dict) -> None:
        [sharded] = [b for b in index["buffers"] if b["id"] == A + 1]
        sharded["shards"].pop()

    with pytest.raises(PathwaysError, match=f"buffer {A + 1}: the snapshot has no data for the shard"):
        snapshot.restore(fresh, store, rewrite_index(store, record, drop_shard), 0, 0)
    assert untouched(fresh)


def test_a_buffer_a_snapshot_cannot_describe_is_refused_at_save(tmp_path):
    parts = host((1, "a"))
    try:
        parts.table.put(A + 1, "a", jax.device_put(jnp.ones(4), parts.devices.local[0]))  # no mesh, no spec
        store = Store(str(tmp_path / "snap"))
        store.prepare()
        with pytest.raises(PathwaysError, match="a buffer has a SingleDeviceSharding, which a snapshot cannot save"):
            snapshot.save(parts, store, 0, 0)
    finally:
        parts.executor.stop()


def test_an_empty_host_saves_and_restores_as_empty(tmp_path, fresh):
    parts = host()
    try:
        store = Store(str(tmp_path / "snap"))
        store.prepare()
        record = snapshot.save(parts, store, 0, 0)
        assert record["buffers"] == 0 and record["data_bytes"] == 0
        assert json.loads(Path(store.path(record["index"])).read_text())["buffers"] == []
        assert snapshot.restore(fresh, store, record, 0, 0)["buffers"] == 0
        assert untouched(fresh)
    finally:
        parts.executor.stop()
