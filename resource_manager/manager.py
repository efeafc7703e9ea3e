"""The resource manager: a named, detached Ray actor that outlives clients.

It starts the islands, records hosts, devices, health, clients and slice
allocations, and places virtual slices. Every client of the cluster talks to
the same one, so a second process sees the same islands and allocations.
Requests and replies are msgpack control messages.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import ray

from pathways import wire
from pathways.errors import PathwaysError, ResourceError, to_wire
from pathways.topology import Topology
from resource_manager.island import start_islands
from resource_manager.placement import Allocation, Inventory, place

PING_TIMEOUT = 2.0


def reply(fn):
    """Wrap a method so it answers a msgpack reply, with the error (if any) as (kind, message)."""

    def wrapper(self, payload: bytes = b"") -> bytes:
        try:
            return wire.encode("reply", {"ok": True, "value": fn(self, payload)})
        except Exception as exc:  # a bad request must never take the manager down
            return wire.encode("reply", {"ok": False, "value": list(to_wire(exc))})

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class ResourceManager:
    def __init__(self, topology: dict, namespace: str, op_timeout: float, start_timeout: float) -> None:
        self.topology = Topology.from_wire(topology)
        self.namespace = namespace
        self.started = time.time()
        self.islands = start_islands(self.topology, namespace, op_timeout, start_timeout)
        self.inventory = Inventory(self.topology)
        self.clients: dict[int, dict] = {}
        self._client_ids = itertools.count(1)
        self._slice_ids = itertools.count(1)

    @reply
    def ready(self, payload: bytes) -> dict:
        return self._state()

    @reply
    def register(self, payload: bytes) -> dict:
        """A new client session: returns its id, the prefix of every buffer id it mints."""
        msg = wire.decode(payload, "register")
        client = next(self._client_ids)
        self.clients[client] = {"tenant": msg["tenant"], "pid": msg["pid"], "weight": msg["weight"],
                                "since": time.time()}
        return {"client": client, "topology": self.topology.to_wire()}

    @reply
    def unregister(self, payload: bytes) -> None:
        client = wire.decode(payload, "unregister")["client"]
        self.clients.pop(client, None)
        for key in [k for k, a in self.inventory.allocations.items() if a.client == client]:
            del self.inventory.allocations[key]

    @reply
    def allocate(self, payload: bytes) -> dict:
        msg = wire.decode(payload, "allocate")
        shape, axes = tuple(msg["shape"]), tuple(msg["axes"])
        island, devices = place(self.inventory, shape, axes, msg["island"])
        alloc = Allocation(f"s{next(self._slice_ids)}", msg["tenant"], msg["client"], island, shape, axes, devices)
        self.inventory.allocations[alloc.key] = alloc
        return alloc.to_wire()

    @reply
    def release(self, payload: bytes) -> None:
        msg = wire.decode(payload, "release")
        alloc = self.inventory.allocations.get(msg["slice"])
        if alloc is None:
            return
        if alloc.tenant != msg["tenant"]:
            raise PathwaysError(f"slice {msg['slice']} is not owned by tenant {msg['tenant']!r}")
        del self.inventory.allocations[msg["slice"]]

    @reply
    def mark_unhealthy(self, payload: bytes) -> None:
        msg = wire.decode(payload, "unhealthy")
        island, reason = msg["island"], msg["reason"]
        if not 0 <= island < self.topology.islands:
            raise ResourceError(f"no island {island!r}")
        self.inventory.unhealthy.setdefault(island, str(reason))

    @reply
    def state(self, payload: bytes) -> dict:
        self._refresh_health()
        return self._state()

    def _refresh_health(self) -> None:
        for island in self.islands:
            if island.index in self.inventory.unhealthy:
                continue
            pings = [h.ping.remote() for h in island.hosts]
            for k, ref in enumerate(pings):
                try:
                    ray.get(ref, timeout=PING_TIMEOUT)
                except Exception as exc:  # dead actor, or no answer in time
                    self.inventory.unhealthy[island.index] = f"host {k} unreachable: {type(exc).__name__}"
                    break

    def _state(self) -> dict[str, Any]:
        return {
            "topology": self.topology.to_wire(),
            "started": self.started,
            "islands": [{"index": i.index, "healthy": i.index not in self.inventory.unhealthy,
                         "reason": self.inventory.unhealthy.get(i.index, ""), "hosts": i.host_info}
                        for i in self.islands],
            "allocations": [a.to_wire() for a in self.inventory.allocations.values()],
            "clients": {str(k): v for k, v in self.clients.items()},
        }
