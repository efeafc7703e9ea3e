"""One host's part of a suspended cluster: saved from a quiet host, restored on a new one of the same topology.

A host saves what its tenants would lose with it: every buffer (each distinct shard of it that this host
holds, once, with the mesh and partition spec it had), the failures that stand for buffers, uploads waiting
for their put, the executables tenants sent, and (host 0) where each client's stream stands. The bytes go
into one data file in that order, each chunk with its CRC-32; the index, written after them, says where each
chunk is. Restoring checks every chunk's checksum before anything it read is used, and keeps only what
belongs to a session the resource manager restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pathways.errors import PathwaysError
from pathways.messages import client_of
from pathways.sharding import dtype_from_wire, spec_from_wire, spec_to_wire
from pathways.snapshot import CHUNK, FORMAT, Store, checksum, host_part
from resource_manager.host.buffers import Failure

Chunk = list  # [offset, nbytes, crc] in the data file


class _Out:
    """The data file being written: each chunk's place and checksum."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self.offset = f, 0

    def write(self, data: Any) -> Chunk:
        view = memoryview(data).cast("B")
        crc = 0
        for start in range(0, len(view), CHUNK):
            part = view[start:start + CHUNK]
            self._f.write(part)
            crc = checksum(part, crc)
        chunk = [self.offset, len(view), crc]
        self.offset += len(view)
        return chunk


class _In:
    """The data file being read: each chunk checked against its checksum before it is used."""

    def __init__(self, f: IO[bytes], name: str, size: int) -> None:
        self._f, self._name, self._size = f, name, size

    def read(self, chunk: Chunk) -> bytearray:
        offset, nbytes, crc = (int(x) for x in chunk)
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise PathwaysError(f"{self._name}: a chunk at {offset} of {nbytes} bytes lies outside the file "
                                f"({self._size} bytes); the snapshot is damaged")
        self._f.seek(offset)
        out = bytearray(nbytes)
        view, got = memoryview(out), 0
        while got < nbytes:
            n = self._f.readinto(view[got:got + CHUNK])
            if not n:
                raise PathwaysError(f"{self._name} ends early; the snapshot is damaged")
            got += n
        if checksum(out) != crc:
            raise PathwaysError(f"{self._name}: the chunk at {offset} does not match its checksum; the snapshot is "
                                "damaged, and nothing of it is used")
        return out


def _region(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    return [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(index, shape)]


def _save_array(out: _Out, value: jax.Array, locate: Callable[[Any], tuple[int, int]]) -> dict:
    sharding = value.sharding
    if not isinstance(sharding, NamedSharding):
        raise PathwaysError(f"a buffer has a {type(sharding).__name__}, which a snapshot cannot save yet")
    mesh = sharding.mesh
    shape = tuple(value.shape)
    shards: dict[tuple, Chunk] = {}
    devices = []
    for shard in value.addressable_shards:
        region = _region(shard.index, shape)
        key = tuple(map(tuple, region))
        if key not in shards:
            shards[key] = out.write(np.ascontiguousarray(np.asarray(shard.data)))
        devices.append([*locate(shard.device), region])
    return {"shape": list(shape), "dtype": np.dtype(value.dtype).name,
            "mesh": [list(locate(d)) for d in mesh.devices.flat], "mesh_shape": list(mesh.devices.shape),
            "axes": list(mesh.axis_names), "spec": spec_to_wire(sharding.spec),
            "shards": [[list(map(list, k)), c] for k, c in shards.items()]}


def save(parts: Any, store: Store, island: int, host: int) -> dict:
    """Write this host's part into ``store``; returns what the resource manager's manifest records of it."""
    data_name, index_name = host_part(island, host)
    buffers, failures = [], []
    uploads_done, refused = parts.uploads.saved()
    with store.open(data_name, "wb") as f:
        out = _Out(f)
        for buffer_id, tenant, value in parts.table.items():
            if isinstance(value, Failure):
                failures.append([buffer_id, tenant, value.kind, value.message])
            else:
                buffers.append({"id": buffer_id, "tenant": tenant, **_save_array(out, value, parts.devices.locate)})
        uploads = [{"id": i, "tenant": t, "pieces": [[list(map(list, region)), np.dtype(a.dtype).name, list(a.shape),
                                                      out.write(np.ascontiguousarray(a))]
                                                     for region, a in pieces.items()]}
                   for i, t, pieces in uploads_done]
        exes = [[tenant, h, out.write(blob)] for tenant, blobs in parts.exes.blobs().items()
                for h, blob in blobs.items()]
        size = out.offset
    index = {"format": FORMAT, "island": island, "host": host, "data": data_name, "data_bytes": size,
             "buffers": buffers, "failures": failures,
             "failed_ranges": [[lo, hi, t, f.kind, f.message] for lo, hi, t, f in parts.table.failed_ranges()],
             "uploads": uploads, "refused_uploads": [[i, t, f.kind, f.message] for i, t, f in refused],
             "executables": exes,
             "positions": ({str(c): n for c, n in parts.admission.positions().items()}
                           if parts.admission is not None else {})}
    crc = store.write_json(index_name, index)
    return {"island": island, "host": host, "data": data_name, "data_bytes": size, "index": index_name,
            "index_crc": crc, "buffers": len(buffers), "array_bytes": sum(_nbytes(b) for b in buffers)}


def _nbytes(buffer: dict) -> int:
    return int(np.prod(buffer["shape"], dtype=np.int64)) * dtype_from_wire(buffer["dtype"]).itemsize


def restore(parts: Any, store: Store, part: dict, island: int, host: int) -> dict:
    """Read this host's part from ``store`` (``part``: the manifest's record of it) into an empty host; keeps
    what belongs to the sessions this host knows (the resource manager opened them first). Raises
    PathwaysError, having used nothing, on any damage."""
    data_name, index_name = host_part(island, host)
    if (part.get("data"), part.get("index")) != (data_name, index_name):
        raise PathwaysError(f"the manifest gives island {island} host {host} the files {part.get('data')!r} and "
                            f"{part.get('index')!r}; the snapshot is damaged")
    index = store.read_json(index_name, part.get("index_crc"))
    if index.get("format") != FORMAT or (index.get("island"), index.get("host")) != (island, host):
        raise PathwaysError(f"{index_name} is not island {island} host {host}'s part in format {FORMAT}")
    size = store.size(data_name)
    if size != index["data_bytes"] or size != part.get("data_bytes"):
        raise PathwaysError(f"{data_name} holds {size} bytes; its index says {index['data_bytes']}: the suspend "
                            "that wrote it did not finish, or the file was changed")

    def alive(buffer_id: int) -> bool:
        return parts.grants.session(client_of(buffer_id)) is not None

    arrays, uploads, exes = [], [], []
    with store.open(data_name, "rb") as f:  # every chunk is read and checked before anything is used
        data = _In(f, data_name, size)
        for b in index["buffers"]:
            if alive(b["id"]):
                arrays.append((b, {tuple(map(tuple, r)): data.read(c) for r, c in b["shards"]}))
        for u in index["uploads"]:
            if alive(u["id"]):
                uploads.append((u, [(tuple(map(tuple, r)), dtype_from_wire(d), tuple(s), data.read(c))
                                    for r, d, s, c in u["pieces"]]))
        for tenant, h, c in index["executables"]:
            if tenant in parts.grants.tenants():
                exes.append((tenant, h, bytes(data.read(c))))
    values = [(b["id"], b["tenant"], _restore_array(b, chunks, parts.devices)) for b, chunks in arrays]
    for tenant, h, blob in exes:
        parts.exes.add(tenant, h, blob)
    for buffer_id, tenant, value in values:
        parts.table.put(buffer_id, tenant, value)
    for buffer_id, tenant, kind, message in index["failures"]:
        if alive(buffer_id):
            parts.table.put(buffer_id, tenant, Failure(kind, message))
    for lo, hi, tenant, kind, message in index["failed_ranges"]:
        if alive(lo):
            parts.table.fail_range(lo, hi, tenant, Failure(kind, message))
    for u, pieces in uploads:
        parts.uploads.restore(u["id"], u["tenant"], {r: np.frombuffer(buf, d).reshape(s) for r, d, s, buf in pieces})
    for buffer_id, tenant, kind, message in index["refused_uploads"]:
        if alive(buffer_id):
            parts.uploads.refuse(buffer_id, tenant, Failure(kind, message))
    if parts.admission is not None:
        parts.admission.restore({int(c): int(n) for c, n in index["positions"].items()
                                 if parts.grants.session(int(c)) is not None})
    return {"island": island, "host": host, "buffers": len(values), "array_bytes": sum(_nbytes(b) for b, _ in arrays),
            "buffers_dropped": len(index["buffers"]) - len(arrays)}  # their sessions ended since the suspend


def _restore_array(b: dict, chunks: dict[tuple, bytearray], devices: Any) -> jax.Array:
    shape, dtype = tuple(b["shape"]), dtype_from_wire(b["dtype"])
    mesh_devices = np.array([devices.device(h, i) for h, i in b["mesh"]], dtype=object).reshape(b["mesh_shape"])
    sharding = NamedSharding(Mesh(mesh_devices, tuple(b["axes"])), spec_from_wire(b["spec"]))
    singles = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        region = tuple(map(tuple, _region(index, shape)))
        buf = chunks.get(region)
        if buf is None:
            raise PathwaysError(f"buffer {b['id']}: the snapshot has no data for the shard {region} of device "
                                f"{device}; the snapshot is damaged")
        local = np.frombuffer(buf, dtype).reshape([hi - lo for lo, hi in region])
        singles.append(jax.device_put(local, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, singles)
