"""A host's view of its JAX devices, and the meshes of the virtual slices placed on them."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pathways.ops import SliceDesc, WireSpec
from pathways.sharding import Index, device_indices, spec_from_wire


class LocalDevices:
    """Maps a slice's (host, local device) pairs to JAX devices and builds its Mesh once."""

    def __init__(self, host: int) -> None:
        self.host = host
        by_process: dict[int, list[jax.Device]] = {}
        for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        self._devices = by_process
        self._meshes: dict[tuple, Mesh] = {}

    @property
    def local(self) -> list[jax.Device]:
        """This host's JAX devices, in id order."""
        return self._devices.get(self.host, [])

    def device(self, host: int, local: int) -> jax.Device:
        """Device ``local`` of host ``host`` of the island (KeyError or IndexError if it has none)."""
        return self._devices[host][local]

    def locate(self, device: jax.Device) -> tuple[int, int]:
        """The (host, local index) of one of the island's devices."""
        return device.process_index, self._devices[device.process_index].index(device)

    def describe(self) -> list[str]:
        """This host's devices as 'platform:id', with the device's kind after a space where it says more than the
        platform ('gpu:0 NVIDIA H100 80GB HBM3': what a datasheet peak is looked up by)."""
        return [f"{d.platform}:{d.id}" + (f" {d.device_kind}" if d.platform != "cpu" else "") for d in self.local]

    def mesh(self, desc: SliceDesc) -> Mesh:
        """The Mesh of a slice over the island's devices (cached by its shape, axes and devices)."""
        key = (desc.shape, desc.axes, desc.devices)
        mesh = self._meshes.get(key)
        if mesh is None:
            devs = [self._devices[h][i] for h, i in desc.devices]
            mesh = Mesh(np.array(devs, dtype=object).reshape(desc.shape), desc.axes)
            self._meshes[key] = mesh
        return mesh

    def sharding(self, desc: SliceDesc, spec: WireSpec) -> NamedSharding:
        """A NamedSharding of ``spec`` on a slice's mesh."""
        return NamedSharding(self.mesh(desc), spec_from_wire(spec))

    def participates(self, desc: SliceDesc) -> bool:
        """Whether any of the slice's devices is on this host."""
        return any(h == self.host for h, _ in desc.devices)

    def wanted(self, desc: SliceDesc, shape: Sequence[int], spec: WireSpec) -> list[tuple[jax.Device, Index]]:
        """Each of this host's devices in the slice, with the region of the array it holds."""
        out = []
        for (h, i), index in zip(desc.devices, device_indices(shape, desc, spec_from_wire(spec))):
            if h == self.host:
                out.append((self._devices[h][i], index))
        return out
