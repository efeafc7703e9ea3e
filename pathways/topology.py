"""The shape of the cluster the runtime manages: islands of hosts of devices, and where islands may run."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Per-island pins, normalized so a Topology stays hashable and compares equal after a wire round trip:
# ((island, ((key, value), ...)), ...), both levels sorted.
Pins = tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]

# The share of a GPU's memory XLA takes at start when nothing else is said (JAX's own default): a host that
# holds a share of a GPU takes that share of it.
GPU_MEMORY_FRACTION = 0.75


@dataclass(frozen=True)
class Topology:
    """How many islands, hosts per island, and JAX devices per host to start.

    On CPU each host simulates ``devices_per_host`` devices; on GPU it owns
    that many real ones. On GPU, ``gpu_share`` below 1 lets hosts share a GPU
    (Ray's fractional GPUs): with 0.5, the hosts of two one-device islands run
    on one GPU. Each host's XLA client then takes ``gpu_memory_fraction`` of
    the GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``; default: JAX's 0.75
    times the share), so the hosts sharing it fit side by side.

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
    gpu_share: float = 1.0
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("islands", "hosts_per_island", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"Topology.platform must be 'cpu' or 'gpu', got {self.platform!r}")
        self._check_gpu()
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

    def _check_gpu(self) -> None:
        share, fraction = self.gpu_share, self.gpu_memory_fraction
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"Topology.gpu_share must be a number in (0, 1], got {share!r}")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= share):
            raise ValueError(f"Topology.gpu_memory_fraction must be a number in (0, gpu_share={share:g}]: the hosts "
                             f"that share a GPU must fit in its memory together; got {fraction!r}")
        if self.platform != "gpu" and (share != 1 or fraction is not None):
            raise ValueError("Topology.gpu_share and gpu_memory_fraction are for platform='gpu'")
        if share < 1 and self.devices_per_host != 1:
            raise ValueError(f"Topology.gpu_share={share:g} shares one GPU between hosts, so each host has one "
                             f"device; got devices_per_host={self.devices_per_host}")
        object.__setattr__(self, "gpu_share", float(share))

    @property
    def jax_platform(self) -> str:
        """JAX's name for the islands' platform: what their hosts run (``JAX_PLATFORMS``) and what the client
        exports computations for (a client on CPU exports for CUDA islands without a GPU of its own)."""
        return "cuda" if self.platform == "gpu" else "cpu"

    @property
    def gpus_per_host(self) -> float:
        """The GPUs each host reserves from Ray (0 on CPU; a fraction where hosts share a GPU)."""
        if self.platform != "gpu":
            return 0
        return self.gpu_share if self.gpu_share < 1 else self.devices_per_host

    @property
    def host_memory_fraction(self) -> float | None:
        """The share of a GPU's memory each host's XLA client takes (None: JAX's default, on CPU too)."""
        if self.gpu_memory_fraction is not None:
            return float(self.gpu_memory_fraction)
        return GPU_MEMORY_FRACTION * self.gpu_share if self.gpu_share < 1 else None

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
        if self.gpu_share != 1:  # the GPU options too: a whole-GPU topology keeps its form
            out["gpu_share"] = self.gpu_share
        if self.gpu_memory_fraction is not None:
            out["gpu_memory_fraction"] = self.gpu_memory_fraction
        return out

    @classmethod
    def from_wire(cls, d: dict) -> Topology:
        """A topology from its msgpack form, validated as on construction."""
        return cls(**d)

    def __str__(self) -> str:
        text = (f"{self.islands} island(s) x {self.hosts_per_island} host(s) x "
                f"{self.devices_per_host} {self.platform} device(s)")
        if self.gpu_share < 1:
            text += f" ({self.gpu_share:g} of a GPU each)"
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
