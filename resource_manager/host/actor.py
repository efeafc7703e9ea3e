"""An island host as Ray sees it: a thin actor whose every method is one the runtime itself calls.

Ray lets any driver call every method an actor class defines, underscored ones included, so this class
defines only the runtime's own calls (the resource manager's orders and health checks, and what hosts send
each other), and each checks an HMAC under the runtime key over its arguments, bound to this host (island,
index). The host's logic lives in a plain ``Host`` that Ray cannot reach; tenants never talk to this actor
at all, only to the host's client endpoint. Health checks have a thread of their own, so nothing else a host
does can make it miss one.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import ray

from pathways import auth, wire
from pathways.errors import IslandFailedError, TenantAccessError
from pathways.messages import Returned
from resource_manager.host.host import Host
from resource_manager.host.rows import Landed, signed_parts

RUNTIME_ONLY = "refused: this method is for the runtime's own actors"
SCHEDULE = "schedule"  # orders and the island's order: one thread, in the order they arrive
HEALTH = "health"  # health checks: one thread nothing else uses
REPLAYS = 4096  # order numbers remembered, so a replayed order is refused
log = logging.getLogger(__name__)


class HostActor:
    """Host ``index`` of island ``island`` at restart ``epoch``; ``runtime_key`` signs every call to it."""

    def __init__(self, island: int, index: int, n_hosts: int, epoch: int, op_timeout: float, gap_timeout: float,
                 runtime_key: bytes, runtime_id: str) -> None:
        self._host = Host(island, index, n_hosts, epoch, op_timeout, gap_timeout)
        self._key, self._runtime_id = runtime_key, runtime_id
        self._orders: OrderedDict[int, None] = OrderedDict()

    def _check(self, mac: Any, purpose: str, *parts: Any) -> None:
        """Refuse unless ``mac`` is the runtime key's signature over these parts, addressed to this host."""
        try:
            ok = auth.verify(self._key, mac, purpose, self._host.island, self._host.index, *parts)
        except TypeError:  # parts of a kind no runtime actor sends
            ok = False
        if not ok:
            raise TenantAccessError(RUNTIME_ONLY)

    # -- start-up ---------------------------------------------------------------------------------------
    def coordinator(self, mac: bytes) -> str:
        """A free address for this island's jax.distributed coordinator (asked of host 0)."""
        self._check(mac, "coordinator")
        return Host.coordinator(ray.util.get_node_ip_address())

    def start(self, mac: bytes, coordinator: str | None, islands: int, platform: str) -> dict:
        """Bring up JAX and the data plane (once)."""
        self._check(mac, "start", coordinator or "", islands, platform)
        return self._host.start(self._key, self._runtime_id, coordinator, islands, platform,
                                ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    # -- the resource manager's orders --------------------------------------------------------------------
    @ray.method(concurrency_group=SCHEDULE)
    def control(self, payload: bytes, seq: int, mac: bytes, handles: list | None = None) -> None:
        """An order of the resource manager (``seq``: its number, which is never used twice)."""
        self._check(mac, "control", seq, payload)
        if seq in self._orders:
            raise TenantAccessError(RUNTIME_ONLY)
        self._orders[seq] = None
        while len(self._orders) > REPLAYS:
            self._orders.popitem(last=False)
        self._host.control(payload, handles)

    @ray.method(concurrency_group=HEALTH)
    def health(self, mac: bytes) -> dict:
        """``{"ok", "reason", "census"}``: not ok once the executor has died; ``census`` as ``census`` answers, so
        that one call a check keeps both the island's health and what a restart would lose."""
        self._check(mac, "health")
        dead = self._host.dead
        return {"ok": dead is None, "reason": dead or "", "census": self._host.parts.views.checked()}

    def stats(self, mac: bytes) -> dict:
        """The host's counters (no tenant named), for the admin's status."""
        self._check(mac, "stats")
        return self._host.parts.views.stats()

    def census(self, mac: bytes) -> dict:
        """Buffers and bytes per tenant: what a restart would lose."""
        self._check(mac, "census")
        return self._host.parts.views.census()

    def tenant_schedule(self, mac: bytes) -> dict:
        """Every tenant's island time, by name (host 0; the admin's view)."""
        self._check(mac, "tenant_schedule")
        return self._host.parts.views.schedule_stats(None)

    def quiesce(self, mac: bytes, on: int) -> None:
        """The cluster is being suspended (``on`` 1): host 0 takes no more client batches; or it goes on (0)."""
        self._check(mac, "quiesce", on)
        self._host.parts.order.quiescing = on == 1

    def quiet(self, mac: bytes) -> dict:
        """Whether this host has finished what it was given (``HostViews.quiet``)."""
        self._check(mac, "quiet")
        return self._host.parts.views.quiet()

    def save(self, mac: bytes, directory: str) -> dict:
        """Write this host's part of a suspended cluster into ``directory``."""
        self._check(mac, "save", directory)
        return self._host.save(directory)

    def restore(self, mac: bytes, directory: str, part: str) -> dict:
        """Read this host's part of a suspended cluster back (``part``: the manifest's record of it, as JSON)."""
        self._check(mac, "restore", directory, part)
        return self._host.restore(directory, json.loads(part))

    def probe_network(self, mac: bytes, island: int, host: int, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes to a peer over the bare network path (for benchmarks)."""
        self._check(mac, "probe_network", island, host, nbytes)
        return self._host.probe_network(island, host, nbytes)

    # -- what hosts send each other -------------------------------------------------------------------------
    @ray.method(concurrency_group=SCHEDULE)
    def landed(self, landed: Landed, mac: bytes) -> None:
        """A host of this island has the data of these parked receives (host 0 of a multi-host island)."""
        try:
            if type(landed) is not Landed:
                raise TypeError(type(landed).__name__)
            parts = landed.signed_parts()
        except (TypeError, ValueError):
            raise TenantAccessError(RUNTIME_ONLY) from None
        self._check(mac, "landed", *parts)
        self._host.parts.order.landed(landed)

    def enqueue_batch(self, rows: list[tuple], mac: bytes) -> None:
        """Host 0's ordered rows for this host (``rows.encode``)."""
        try:
            parts = signed_parts(rows)
        except Exception:  # not rows host 0 sends
            raise TenantAccessError(RUNTIME_ONLY) from None
        self._check(mac, "enqueue", *parts)
        self._host.parts.order.rows(rows)

    def deliver(self, meta: bytes, mac: bytes, *pieces: np.ndarray) -> None:
        """Shards sent by a host of another island through Ray (another node, or no channel)."""
        self._check(mac, "deliver", meta)
        self._host.parts.peers.transports["ray"].receive(meta, pieces)

    def probe_direct(self, mac: bytes, node: str, pid: int, addr: int, expected: bytes) -> str:
        """This host's channel address if it can copy lent shards out of runtime host ``pid``, else ""."""
        self._check(mac, "probe", node, pid, addr)
        return self._host.probe_direct(node, pid, addr, expected)

    def release_lent(self, payload: bytes, mac: bytes) -> None:
        """A receiver has copied these leases' shards: let go of them."""
        self._check(mac, "returned", payload)
        self._host.parts.peers.release(wire.parse(payload, Returned).leases)

    def ping(self, mac: bytes) -> float:
        """This host's wall clock; raises once the host can no longer run."""
        self._check(mac, "ping")
        if self._host.dead is not None:
            raise IslandFailedError(self._host.dead)
        import time

        return time.time()
