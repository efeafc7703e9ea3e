"""Placing a virtual slice onto physical devices of one island (pure; ``resource_manager.slices`` holds the slices).

Virtual devices map one-to-one onto distinct devices of a single island.
Slices may share devices (they are time-multiplexed by the island's
scheduler), so placement balances load: the least-loaded healthy island,
then one host when the slice fits on one, whole hosts only when it must.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from pathways.errors import ResourceError
from pathways.ops import SliceDesc
from pathways.topology import Topology


@dataclass
class Allocation:
    """A slice the resource manager placed: its key, owner (tenant and client), island, mesh and devices."""

    key: str
    tenant: str
    client: int
    island: int
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    devices: list[tuple[int, int]]  # (host, local device), mesh row-major

    def desc(self) -> SliceDesc:
        """The slice as islands see it."""
        return SliceDesc(self.key, self.shape, self.axes, tuple(tuple(d) for d in self.devices))

    def to_wire(self) -> dict:
        """The allocation's msgpack form, as ``pw.slice`` receives it."""
        return {"key": self.key, "shape": list(self.shape), "axes": list(self.axes),
                "devices": [list(d) for d in self.devices], "island": self.island, "tenant": self.tenant,
                "client": self.client}


@dataclass
class Inventory:
    """What placement works from: the topology, the islands out of service (and why), and every allocation."""

    topology: Topology
    unhealthy: dict[int, str] = field(default_factory=dict)
    allocations: dict[str, Allocation] = field(default_factory=dict)

    def load(self) -> Counter:
        """How many slices use each (island, host, device)."""
        return Counter((a.island, h, d) for a in self.allocations.values() for h, d in a.devices)

    def describe(self) -> str:
        """The cluster's size and healthy islands, for error messages."""
        t = self.topology
        healthy = [i for i in range(t.islands) if i not in self.unhealthy]
        return (f"the cluster has {t.islands} island(s) (healthy: {healthy}), each of {t.hosts_per_island} "
                f"host(s) x {t.devices_per_host} device(s) = {t.devices_per_island} devices")


def validate_request(shape: tuple[int, ...], axes: tuple[str, ...]) -> None:
    """ResourceError unless ``shape`` is a non-empty tuple of positive ints with one distinct, non-empty axis name
    per dimension."""
    if len(shape) != len(axes):
        raise ResourceError(f"slice shape {shape} has {len(shape)} dimension(s) but axis names {axes} has "
                            f"{len(axes)}; give one name per dimension")
    if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
        raise ResourceError(f"slice shape {shape} must be a non-empty tuple of positive ints")
    if len(set(axes)) != len(axes) or not all(isinstance(a, str) and a for a in axes):
        raise ResourceError(f"axis names {axes} must be distinct non-empty strings")


def place(inv: Inventory, shape: tuple[int, ...], axes: tuple[str, ...], island: int | None
          ) -> tuple[int, list[tuple[int, int]]]:
    """(island, devices) for a new slice, or ResourceError saying what was asked and what exists."""
    validate_request(shape, axes)
    t = inv.topology
    n = math.prod(shape)
    asked = f"asked for a slice of shape {shape} over {axes} ({n} devices)"
    if island is not None:
        if not isinstance(island, int) or not 0 <= island < t.islands:
            raise ResourceError(f"{asked} on island {island}, which does not exist; {inv.describe()}")
        if island in inv.unhealthy:
            raise ResourceError(f"{asked} on island {island}, which is unhealthy ({inv.unhealthy[island]}); "
                                f"{inv.describe()}")
        candidates = [island]
    else:
        candidates = [i for i in range(t.islands) if i not in inv.unhealthy]
        if not candidates:
            raise ResourceError(f"{asked}, but no island is healthy; {inv.describe()}")
    if n > t.devices_per_island:
        raise ResourceError(f"{asked}, but the largest island has {t.devices_per_island} devices; {inv.describe()}")
    load = inv.load()

    def island_load(i: int) -> int:
        return sum(c for (isl, _, _), c in load.items() if isl == i)

    chosen = min(candidates, key=lambda i: (island_load(i), i))
    return chosen, _pick_devices(t, load, chosen, n)


def _pick_devices(t: Topology, load: Counter, island: int, n: int) -> list[tuple[int, int]]:
    def host_load(h: int) -> int:
        return sum(load[(island, h, d)] for d in range(t.devices_per_host))

    if n <= t.devices_per_host:
        host = min(range(t.hosts_per_island), key=lambda h: (host_load(h), h))
        devices = sorted(range(t.devices_per_host), key=lambda d: (load[(island, host, d)], d))[:n]
        return [(host, d) for d in sorted(devices)]
    hosts_needed = math.ceil(n / t.devices_per_host)
    hosts = sorted(sorted(range(t.hosts_per_island), key=lambda h: (host_load(h), h))[:hosts_needed])
    every = [(h, d) for h in hosts for d in range(t.devices_per_host)]
    return every[:n]
