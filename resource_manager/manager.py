"""The resource manager: a named, detached Ray actor that outlives clients.

It starts the islands, records hosts, devices, health, tenants, clients and
slice allocations, places virtual slices (within each tenant's device quota),
tells each island's scheduler which slices and clients belong to which
tenant, and reclaims everything a client held once its lease dies. Requests
and replies are msgpack control messages.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import ray

from pathways import wire
from pathways.errors import ResourceError, TenantAccessError, to_wire
from pathways.topology import Topology
from resource_manager.island import start_islands
from resource_manager.network.frames import new_secret
from resource_manager.placement import Allocation, Inventory, place

PING_TIMEOUT = 2.0
LEASE_PERIOD = 1.0
log = logging.getLogger(__name__)


def reply(fn):
    """Wrap a method so it answers a msgpack reply, with the error (if any) as (kind, message)."""

    def wrapper(self, payload: bytes = b"", *extra: Any) -> bytes:
        try:
            with self._lock:
                value = fn(self, payload, *extra)
            return wire.encode("reply", {"ok": True, "value": value})
        except Exception as exc:  # a bad request must never take the manager down
            return wire.encode("reply", {"ok": False, "value": list(to_wire(exc))})

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class ResourceManager:
    def __init__(self, topology: dict, namespace: str, op_timeout: float, start_timeout: float,
                 default_quota: int | None = None) -> None:
        self.topology = Topology.from_wire(topology)
        self.namespace = namespace
        self.started = time.time()
        # seam(identity): one secret per runtime for host-to-host authentication on the network data path;
        # the tenant-identity work may derive it from its own credentials instead
        self.islands = start_islands(self.topology, namespace, op_timeout, start_timeout, new_secret())
        self.inventory = Inventory(self.topology)
        self.clients: dict[int, dict] = {}
        self.leases: dict[int, Any] = {}
        self.tenants: dict[str, dict] = {}
        self.default_quota = default_quota
        self.reclaimed: list[dict] = []
        self._client_ids = itertools.count(1)
        self._slice_ids = itertools.count(1)
        self._lock = threading.RLock()
        threading.Thread(target=self._watch_leases, name="lease-watch", daemon=True).start()

    def _schedulers(self, method: str, *args: Any) -> None:
        """Tell every healthy island's scheduler (in its host 0); an island dying meanwhile is the health
        check's to report, not a reason to refuse the client."""
        refs = [getattr(i.scheduler, method).remote(*args) for i in self.islands
                if i.index not in self.inventory.unhealthy]
        for ref in refs:
            try:
                ray.get(ref, timeout=PING_TIMEOUT * 5)
            except Exception as exc:
                log.warning("an island's scheduler did not take %s: %s", method, exc)

    @reply
    def ready(self, payload: bytes) -> dict:
        return self._state()

    @reply
    def register(self, payload: bytes, lease: Any = None) -> dict:
        """A new client session: returns its id, the prefix of every buffer id it mints."""
        msg = wire.decode(payload, "register")
        client, tenant = next(self._client_ids), msg["tenant"]
        self.clients[client] = {"tenant": tenant, "pid": msg["pid"], "since": time.time()}
        self.leases[client] = lease
        info = self.tenants.setdefault(tenant, {"weight": msg["weight"], "quota": self.default_quota})
        info["weight"] = msg["weight"]
        self._schedulers("grant_client", client, tenant)
        self._schedulers("set_weight", tenant, msg["weight"])
        return {"client": client, "topology": self.topology.to_wire()}

    @reply
    def unregister(self, payload: bytes) -> None:
        self._forget(wire.decode(payload, "unregister")["client"], free_buffers=False)

    def _forget(self, client: int, free_buffers: bool) -> dict:
        info = self.clients.pop(client, None)
        self.leases.pop(client, None)
        keys = [k for k, a in self.inventory.allocations.items() if a.client == client]
        for key in keys:
            del self.inventory.allocations[key]
        self._schedulers("revoke", keys)
        if free_buffers and info is not None:
            message = wire.encode("free", {"tenant": info["tenant"], "client": client, "ids": [],
                                           "everything": True})
            self._schedulers("submit", message)  # queued before the client is revoked, or it would be refused
        self._schedulers("revoke_client", client)
        tenant = info["tenant"] if info else None
        info_t = self.tenants.get(tenant)
        if info_t is not None and info_t["quota"] is None and not any(
                c["tenant"] == tenant for c in self.clients.values()) and not any(
                a.tenant == tenant for a in self.inventory.allocations.values()):
            del self.tenants[tenant]  # nothing left to show or enforce for it
        return {"client": client, "tenant": info["tenant"] if info else None, "slices": keys}

    def _watch_leases(self) -> None:
        """Reclaim the slices and buffers of every client whose process is gone."""
        while True:
            time.sleep(LEASE_PERIOD)
            with self._lock:
                leases = {c: lease for c, lease in self.leases.items() if lease is not None}
            pings = {c: lease.ping.remote() for c, lease in leases.items()}
            ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_TIMEOUT)
            for client, ref in pings.items():
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception:  # the lease died with its client process
                    with self._lock:
                        if client in self.clients:
                            record = self._forget(client, free_buffers=True)
                            record["at"] = time.time()
                            self.reclaimed.append(record)
                            log.warning("reclaimed client %s of tenant %s", client, record["tenant"])

    @reply
    def allocate(self, payload: bytes) -> dict:
        msg = wire.decode(payload, "allocate")
        tenant, shape, axes = msg["tenant"], tuple(msg["shape"]), tuple(msg["axes"])
        if self.clients.get(msg["client"], {}).get("tenant") != tenant:
            raise TenantAccessError(f"client {msg['client']} is not registered for tenant {tenant!r}")
        island, devices = place(self.inventory, shape, axes, msg["island"])
        quota = self.tenants.get(tenant, {}).get("quota")
        held = sum(len(a.devices) for a in self.inventory.allocations.values() if a.tenant == tenant)
        if quota is not None and held + len(devices) > quota:
            raise ResourceError(f"tenant {tenant!r} asked for a slice of shape {shape} ({len(devices)} devices) "
                                f"but holds {held} of its quota of {quota} devices; release a slice first")
        alloc = Allocation(f"s{next(self._slice_ids)}", tenant, msg["client"], island, shape, axes, devices)
        wire_alloc = alloc.to_wire()
        ray.get(self.islands[island].scheduler.grant.remote(alloc.key, tenant, wire_alloc),
                timeout=PING_TIMEOUT * 5)
        self.inventory.allocations[alloc.key] = alloc
        return wire_alloc

    @reply
    def release(self, payload: bytes) -> None:
        msg = wire.decode(payload, "release")
        alloc = self.inventory.allocations.get(msg["slice"])
        if alloc is None:
            return
        if alloc.tenant != msg["tenant"]:
            raise TenantAccessError(f"slice {msg['slice']} is not owned by tenant {msg['tenant']!r}")
        del self.inventory.allocations[msg["slice"]]
        self.islands[alloc.island].scheduler.revoke.remote([msg["slice"]])

    @reply
    def set_quota(self, payload: bytes) -> None:
        msg = wire.decode(payload, "quota")
        self.tenants.setdefault(msg["tenant"], {"weight": 1.0, "quota": None})["quota"] = msg["devices"]

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
        devices: dict[str, int] = {}
        for a in self.inventory.allocations.values():
            devices[a.tenant] = devices.get(a.tenant, 0) + len(a.devices)
        tenants = {t: {**info, "devices": devices.get(t, 0),
                       "clients": sum(1 for c in self.clients.values() if c["tenant"] == t)}
                   for t, info in self.tenants.items()}
        return {
            "topology": self.topology.to_wire(),
            "started": self.started,
            "islands": [{"index": i.index, "healthy": i.index not in self.inventory.unhealthy,
                         "reason": self.inventory.unhealthy.get(i.index, ""), "hosts": i.host_info}
                        for i in self.islands],
            "allocations": [a.to_wire() for a in self.inventory.allocations.values()],
            "clients": {str(k): v for k, v in self.clients.items()},
            "tenants": tenants,
            "reclaimed": self.reclaimed[-20:],
        }
