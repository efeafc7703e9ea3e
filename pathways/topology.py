"""The shape of the cluster the runtime manages: islands of hosts of devices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """How many islands, hosts per island, and JAX devices per host to start.

    On CPU each host simulates ``devices_per_host`` devices; on GPU it owns
    that many real ones.
    """

    islands: int = 2
    hosts_per_island: int = 1
    devices_per_host: int = 4
    platform: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("islands", "hosts_per_island", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"Topology.platform must be 'cpu' or 'gpu', got {self.platform!r}")

    @property
    def devices_per_island(self) -> int:
        return self.hosts_per_island * self.devices_per_host

    def to_wire(self) -> dict:
        return {
            "islands": self.islands,
            "hosts_per_island": self.hosts_per_island,
            "devices_per_host": self.devices_per_host,
            "platform": self.platform,
        }

    @classmethod
    def from_wire(cls, d: dict) -> Topology:
        return cls(**d)

    def __str__(self) -> str:
        return (
            f"{self.islands} island(s) x {self.hosts_per_island} host(s) x "
            f"{self.devices_per_host} {self.platform} device(s)"
        )
