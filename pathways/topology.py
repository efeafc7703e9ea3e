"""The shape of the cluster the runtime manages: islands of hosts of devices, and where islands may run."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Per-island pins, normalized so a Topology stays hashable and compares equal after a wire round trip:
# ((island, ((key, value), ...)), ...), both levels sorted.
Pins = tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]


@dataclass(frozen=True)
class Topology:
    """How many islands, hosts per island, and JAX devices per host to start.

    On CPU each host simulates ``devices_per_host`` devices; on GPU it owns
    that many real ones.

    By default the hosts of an island share one Ray node and islands spread
    over the alive nodes. Two optional pins, keyed by island index, narrow that:
    ``node_labels={1: {"zone": "b"}}`` puts island 1 on nodes with those Ray
    node labels (``ray start --labels``; values in Ray's selector syntax:
    ``"b"``, ``"!b"``, ``"in(a,b)"``, ``"!in(a,b)"``), and
    ``host_resources={0: {"pod_a": 1}}`` makes each host of island 0 reserve
    that much of a custom resource (``ray start --resources``).
    """

    islands: int = 2
    hosts_per_island: int = 1
    devices_per_host: int = 4
    platform: str = "cpu"
    node_labels: Mapping[int, Mapping[str, str]] | Pins = ()
    host_resources: Mapping[int, Mapping[str, float]] | Pins = ()

    def __post_init__(self) -> None:
        for name in ("islands", "hosts_per_island", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"Topology.platform must be 'cpu' or 'gpu', got {self.platform!r}")
        object.__setattr__(self, "node_labels", self._pins("node_labels", _check_label))
        object.__setattr__(self, "host_resources", self._pins("host_resources", _check_resource))

    def _pins(self, name: str, check: Any) -> Pins:
        raw = getattr(self, name)
        items = raw.items() if isinstance(raw, Mapping) else raw
        out = []
        for island, pins in items:
            if not isinstance(island, int) or isinstance(island, bool) or not 0 <= island < self.islands:
                raise ValueError(f"Topology.{name}: no island {island!r} in a topology of {self.islands} island(s)")
            pairs = pins.items() if isinstance(pins, Mapping) else pins
            for key, value in pairs:
                check(name, island, key, value)
            normalized = tuple(sorted((k, v) for k, v in pairs))
            if normalized:
                out.append((island, normalized))
        if len({island for island, _ in out}) != len(out):
            raise ValueError(f"Topology.{name}: an island appears twice")
        return tuple(sorted(out))

    @property
    def devices_per_island(self) -> int:
        """Devices per island: hosts per island times devices per host."""
        return self.hosts_per_island * self.devices_per_host

    def labels_of(self, island: int) -> dict[str, str]:
        """The Ray node label selector island ``island`` is pinned to (empty: any node)."""
        return dict(dict(self.node_labels).get(island, ()))

    def resources_of(self, island: int) -> dict[str, float]:
        """Custom resources each host of island ``island`` reserves on its node (empty: none)."""
        return dict(dict(self.host_resources).get(island, ()))

    def to_wire(self) -> dict:
        """The topology's msgpack form; pins appear only when set."""
        out: dict[str, Any] = {
            "islands": self.islands,
            "hosts_per_island": self.hosts_per_island,
            "devices_per_host": self.devices_per_host,
            "platform": self.platform,
        }
        for name in ("node_labels", "host_resources"):  # only when set, so unpinned topologies keep their form
            pins = getattr(self, name)
            if pins:
                out[name] = [[island, dict(pairs)] for island, pairs in pins]
        return out

    @classmethod
    def from_wire(cls, d: dict) -> Topology:
        """A topology from its msgpack form, validated as on construction."""
        return cls(**d)

    def __str__(self) -> str:
        text = (f"{self.islands} island(s) x {self.hosts_per_island} host(s) x "
                f"{self.devices_per_host} {self.platform} device(s)")
        pins = [f"island {i} on nodes " + ",".join(f"{k}={v}" for k, v in self.labels_of(i).items())
                for i, _ in self.node_labels]
        pins += [f"island {i} hosts take " + ",".join(f"{k}:{v:g}" for k, v in self.resources_of(i).items())
                 for i, _ in self.host_resources]
        return text + (f" ({'; '.join(pins)})" if pins else "")


def _check_label(name: str, island: int, key: Any, value: Any) -> None:
    if not isinstance(key, str) or not key or not isinstance(value, str):
        raise ValueError(f"Topology.{name}[{island}]: labels map non-empty str keys to str values, "
                         f"got {key!r}: {value!r}")


def _check_resource(name: str, island: int, key: Any, value: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"Topology.{name}[{island}]: resource names are non-empty str, got {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Topology.{name}[{island}][{key!r}] must be a positive number, got {value!r}")
