"""Every virtual slice placed, and the grants and revocations the islands hear of.

A slice is placed (``resource_manager.placement``) on healthy islands, within its tenant's device quota, and
granted to its tenant on host 0 of its island; released, it is revoked there. The resource manager numbers
slices itself: a name a client sends is only ever looked up among its own tenant's slices.
"""

from __future__ import annotations

import itertools
import threading

from pathways.errors import ResourceError
from pathways.messages import Grant, Revoke
from pathways.topology import Topology
from resource_manager.fleet import Fleet
from resource_manager.health import IslandHealth
from resource_manager.island import Island
from resource_manager.placement import Allocation, Inventory, place


class Slices:
    """The slices by key and the numbering of new ones, under one lock; it reads island health from ``health``
    and orders hosts through ``fleet``."""

    def __init__(self, topology: Topology, fleet: Fleet, health: IslandHealth) -> None:
        self._topology = topology
        self._fleet = fleet
        self._health = health
        self._lock = threading.Lock()
        self._slices: dict[str, Allocation] = {}
        self._ids = itertools.count(1)

    def allocate(self, tenant: str, client: int, quota: int | None, shape: tuple[int, ...], axes: tuple[str, ...],
                 island: int | None) -> Allocation:
        """A new slice of ``shape`` over ``axes`` for ``client`` of ``tenant`` (on ``island``, or where it fits
        best), within the tenant's device ``quota``; ResourceError saying what was asked and what exists."""
        with self._lock:
            where, devices = place(Inventory(self._topology, self._health.unhealthy(), self._slices), shape, axes,
                                   island)
            held = sum(len(a.devices) for a in self._slices.values() if a.tenant == tenant)
            if quota is not None and held + len(devices) > quota:
                raise ResourceError(f"tenant {tenant!r} asked for a slice of shape {shape} ({len(devices)} devices) "
                                    f"but holds {held} of its quota of {quota} devices; release a slice first")
            alloc = Allocation(f"s{next(self._ids)}", tenant, client, where, shape, axes, devices)
            self._grant(self._fleet.island(where), alloc)
            self._slices[alloc.key] = alloc
            return alloc

    def release(self, tenant: str, key: str) -> None:
        """Free ``tenant``'s slice ``key``; ResourceError if the tenant holds none of that key."""
        with self._lock:
            alloc = self._slices.get(key)
            if alloc is None or alloc.tenant != tenant:
                raise ResourceError(f"you hold no slice {key!r}")
            del self._slices[key]
            self._revoke(alloc)

    def drop_client(self, client: int) -> list[str]:
        """Free every slice of ``client`` (its session ended); their keys."""
        with self._lock:
            keys = [k for k, a in self._slices.items() if a.client == client]
            for key in keys:
                self._revoke(self._slices.pop(key))
            return keys

    def welcome(self, island: Island) -> None:
        """Grant the slices on ``island`` again, to its new hosts."""
        with self._lock:
            for alloc in self._slices.values():
                if alloc.island == island.index:
                    self._grant(island, alloc)

    def _grant(self, island: Island, alloc: Allocation) -> None:
        self._fleet.order(self._fleet.hosts([island])[:1], Grant(alloc.desc().to_wire(), alloc.tenant))

    def _revoke(self, alloc: Allocation) -> None:
        self._fleet.order(self._fleet.hosts([self._fleet.island(alloc.island)])[:1], Revoke([alloc.key]), wait=False)

    # -- what others read ---------------------------------------------------------------------------------
    def listing(self) -> list[Allocation]:
        """Every slice."""
        with self._lock:
            return list(self._slices.values())

    def to_wire(self) -> list[dict]:
        """Every slice: what a suspended cluster's manifest keeps."""
        with self._lock:
            return [a.to_wire() for a in self._slices.values()]

    # -- a resume -----------------------------------------------------------------------------------------
    def restore(self, saved: list[dict], clients: set[int]) -> None:
        """The saved slices of ``clients`` (a resume into a fresh cluster); new slices are numbered past them."""
        with self._lock:
            for a in saved:
                if int(a["client"]) in clients:
                    alloc = Allocation(str(a["key"]), str(a["tenant"]), int(a["client"]), int(a["island"]),
                                       tuple(a["shape"]), tuple(a["axes"]), [tuple(d) for d in a["devices"]])
                    self._slices[alloc.key] = alloc
            self._renumber()

    def _renumber(self) -> None:
        """Number new slices past every slice held (the lock held)."""
        top = max([0, *(int(k[1:]) for k in self._slices if k[1:].isdigit())])
        self._ids = itertools.count(max(next(self._ids), top + 1))

    def clear(self) -> None:
        """Forget every slice (a resume into a fresh cluster failed)."""
        with self._lock:
            self._slices.clear()
