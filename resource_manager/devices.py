"""A host's view of its JAX devices, and the meshes of the virtual slices placed on them."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pathways.sharding import Index, device_indices


class LocalDevices:
    """Maps a slice's (host, local device) pairs to JAX devices and builds its Mesh once."""

    def __init__(self, host: int) -> None:
        self.host = host
        by_process: dict[int, list[jax.Device]] = {}
        for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        self._devices = by_process
        self._meshes: dict[tuple, Mesh] = {}

    def describe(self) -> list[str]:
        return [f"{d.platform}:{d.id}" for d in self._devices.get(self.host, [])]

    @staticmethod
    def key(desc: dict) -> tuple:
        return (tuple(desc["shape"]), tuple(desc["axes"]), tuple(map(tuple, desc["devices"])))

    def mesh(self, desc: dict) -> tuple[Mesh, tuple]:
        key = self.key(desc)
        mesh = self._meshes.get(key)
        if mesh is None:
            devs = [self._devices[h][i] for h, i in desc["devices"]]
            mesh = Mesh(np.array(devs, dtype=object).reshape(desc["shape"]), tuple(desc["axes"]))
            self._meshes[key] = mesh
        return mesh, key

    def sharding(self, desc: dict, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh(desc)[0], spec)

    def participates(self, desc: dict) -> bool:
        return any(h == self.host for h, _ in desc["devices"])

    def single_host(self, desc: dict) -> bool:
        return all(h == self.host for h, _ in desc["devices"])

    def wanted(self, desc: dict, shape: Sequence[int], spec: PartitionSpec) -> list[tuple[jax.Device, Index]]:
        """Each of this host's devices in the slice, with the region of the array it holds."""
        out = []
        for (h, i), index in zip(desc["devices"], device_indices(shape, desc, spec)):
            if h == self.host:
                out.append((self._devices[h][i], index))
        return out
