"""Landing pieces that arrived whole (over the network) as the devices' regions (resource_manager/host/transfer.py),
without Ray: resharded bitwise, a large landing gathered in slabs on several threads, a small one on the caller's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resource_manager.host import transfer
from resource_manager.host.transfer import Landed, Landing, assemble, index_of


def arrived(value: np.ndarray, mesh: Mesh, spec: P) -> dict:
    """``value``'s distinct shards under ``spec``, each in a landing buffer of its own (as the server lands them)."""
    pieces = {}
    for idx in NamedSharding(mesh, spec).devices_indices_map(value.shape).values():
        pieces.setdefault(index_of(idx, value.shape), np.ascontiguousarray(value[idx]).view(Landed))
    return pieces


@pytest.mark.parametrize("shape", [(512, 1024), (16, 64)])  # 2 MiB: slabs on the gather threads; 4 KiB: inline
def test_pieces_that_arrived_whole_are_regathered_bitwise(shape, monkeypatch):
    devices = np.array(jax.devices()[:4])
    square, wide = Mesh(devices.reshape(2, 2), ("data", "model")), Mesh(devices.reshape(1, 4), ("data", "model"))
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    pieces = arrived(value, square, P("data", "model"))
    sharding = NamedSharding(wide, P(None, "model"))
    wanted = [(d, index_of(idx, value.shape)) for d, idx in sharding.devices_indices_map(value.shape).items()]
    submitted = []
    submit = transfer._gatherers.submit
    monkeypatch.setattr(transfer._gatherers, "submit", lambda *a: submitted.append(a) or submit(*a))
    monkeypatch.setattr(transfer, "CHUNK", 128 << 10)  # slabs of 128 KiB: the 2 MiB landing makes sixteen
    array = assemble(Landing(shape, np.dtype(np.float32), sharding, wanted), pieces)
    assert np.asarray(array).tobytes() == value.tobytes()
    assert len(submitted) == (16 if value.nbytes > transfer.INLINE_BYTES else 0)
