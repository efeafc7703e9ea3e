"""Island health: which islands are out of service and why, found by checking every host's health.

A host that misses ``STRIKES`` health checks in a row, dies, or says its executor died fails its island. A
failed island leaves placement and every host hears of it (receives from it stop waiting); the resource manager
restarts it (``resource_manager.manager``) and, once its new hosts know every session and slice, it is back in
service. Each health check also counts what the island holds per tenant (each host's answer carries its count),
so that a restart says what was lost. The admin may also take an island out of placement, or put it back.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from pathways.errors import ResourceError
from pathways.messages import IslandFailed
from resource_manager.fleet import Fleet
from resource_manager.island import Island
from resource_manager.phase import RUNNING, SUSPENDING, ClusterPhase

PING_TIMEOUT = 2.0  # how long a health check or a census waits for a host
STRIKES = 3  # health checks in a row without an answer before a host counts as failed
KEEP_RESTARTS = 100
log = logging.getLogger(__name__)
Failure = tuple[Island, str, dict]  # (the island that failed, why, what it held per tenant)


class IslandHealth:
    """The islands out of service (and why), hosts' missed checks, each island's census, the islands restarting
    now and the restarts so far, under one lock; it orders hosts through ``fleet`` and reads ``phase``."""

    def __init__(self, fleet: Fleet, phase: ClusterPhase) -> None:
        self._fleet = fleet
        self._phase = phase
        self._lock = threading.Lock()
        self._unhealthy: dict[int, str] = {}
        self._strikes: dict[tuple[int, int], int] = {}
        self._census: dict[int, dict[str, tuple[int, int]]] = {}
        self._restarting: set[int] = set()
        self._restarts: list[dict] = []

    # -- what others read ---------------------------------------------------------------------------------
    def unhealthy(self) -> dict[int, str]:
        """The islands out of service, with why."""
        with self._lock:
            return dict(self._unhealthy)

    def healthy(self) -> list[Island]:
        """The islands in service."""
        with self._lock:
            return [i for i in self._fleet.islands() if i.index not in self._unhealthy]

    def restarting(self) -> set[int]:
        """The islands restarting after a failure now."""
        with self._lock:
            return set(self._restarting)

    def restarts(self) -> list[dict]:
        """The last restarts: island, epoch, when, why, and what each tenant lost."""
        with self._lock:
            return list(self._restarts)

    def public(self) -> list[dict]:
        """Each island's index, epoch, health and hosts: what clients are told."""
        unhealthy = self.unhealthy()
        return [{"index": i.index, "epoch": i.epoch, "healthy": i.index not in unhealthy,
                 "reason": unhealthy.get(i.index, ""),
                 "hosts": [{k: h[k] for k in ("island", "host", "node", "ip", "devices", "node_labels",
                                              "memory_bytes", "device_bytes", "channel", "data", "client")}
                           for h in i.host_info]}
                for i in self._fleet.islands()]

    # -- the admin ----------------------------------------------------------------------------------------
    def mark(self, island: int, healthy: bool, reason: str) -> None:
        """Take ``island`` out of placement (saying ``reason``) or put it back; ResourceError for no such island."""
        if not 0 <= island < len(self._fleet.islands()):
            raise ResourceError(f"no island {island!r}")
        with self._lock:
            if healthy:
                self._unhealthy.pop(island, None)
            else:
                self._unhealthy[island] = reason or "marked unhealthy by the admin"

    # -- checks -------------------------------------------------------------------------------------------
    def check(self, only: int | None = None) -> list[Failure]:
        """Check every host's health (or only island ``only``'s); the islands that failed now, each taken out of
        service once (every host hears of it), to be restarted by the caller."""
        if self._phase.now not in (RUNNING, SUSPENDING):  # no islands, or new ones starting
            return []
        with self._lock:
            islands = [i for i in self._fleet.islands() if i.index not in self._restarting and only in (None, i.index)]
        failures = []
        for island in islands:
            reason = self._ping(island)
            if reason is not None:
                lost = self._failed(island, reason)
                if lost is not None:
                    failures.append((island, reason, lost))
        return failures

    def _ping(self, island: Island) -> str | None:
        """Why ``island`` failed, or None while its hosts answer. Keeps the census their answers carry (``_count``)."""
        refs = [h.health.remote(self._fleet.sign(island.index, k, "health")) for k, h in enumerate(island.hosts)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT)
        reason, counts = None, []
        for k, ref in enumerate(refs):
            with self._lock:
                if ref not in ready:
                    strikes = self._strikes[(island.index, k)] = self._strikes.get((island.index, k), 0) + 1
                    if strikes >= STRIKES:
                        reason = f"host {k} did not answer {STRIKES} health checks in a row"
                    continue
                self._strikes.pop((island.index, k), None)
            try:
                health = ray.get(ref, timeout=0)
            except Exception as exc:  # the actor (or its node) is gone
                return f"host {k} died ({type(exc).__name__})"
            if not health["ok"]:
                return health["reason"]
            counts.append(health["census"])
        if len(counts) == len(refs):
            self._count(island, counts)
        return reason

    def _failed(self, island: Island, reason: str) -> dict | None:
        """Take a failed island out of service; what it held per tenant, or None if it is restarting already or
        was replaced meanwhile."""
        with self._lock:
            if island.index in self._restarting or self._fleet.island(island.index) is not island:
                return None
            self._restarting.add(island.index)
            self._unhealthy[island.index] = reason
            lost = self._census.pop(island.index, {})
            log.error("island %d failed: %s; restarting it", island.index, reason)
            healthy = [i for i in self._fleet.islands() if i.index not in self._unhealthy]
            self._fleet.order(self._fleet.hosts(healthy), IslandFailed(island.index), wait=False)
            return lost

    def retrying(self, island: int, why: str) -> None:
        """Island ``island`` could not restart yet (``why``): it stays out of service, saying so."""
        with self._lock:
            self._unhealthy[island] = why

    def restored(self, new: Island, reason: str, lost: dict) -> None:
        """The restarted island ``new`` is back in service (its hosts know every session and slice by now)."""
        with self._lock:
            self._unhealthy.pop(new.index, None)
            self._restarting.discard(new.index)
            self._restarts.append({"island": new.index, "epoch": new.epoch, "at": time.time(), "reason": reason,
                                   "lost": {t: list(v) for t, v in lost.items()}})
            self._restarts = self._restarts[-KEEP_RESTARTS:]
        log.warning("island %d restarted (epoch %d) after: %s", new.index, new.epoch, reason)

    def reset(self) -> None:
        """Every island was replaced (a resume): all in service, no strikes, no census."""
        with self._lock:
            self._unhealthy.clear()
            self._strikes.clear()
            self._census.clear()

    # -- what each island holds ---------------------------------------------------------------------------
    def take_census(self) -> None:
        """Count what each healthy island holds per tenant now (health checks count it too, each time)."""
        if self._phase.now != RUNNING:
            return
        for island in self.healthy():
            refs = [h.census.remote(self._fleet.sign(island.index, k, "census")) for k, h in enumerate(island.hosts)]
            try:
                counts = ray.get(refs, timeout=PING_TIMEOUT)
            except Exception:  # the health check handles a host that does not answer
                continue
            self._count(island, counts)

    def _count(self, island: Island, counts: list[dict]) -> None:
        """Keep ``island``'s census: its hosts' counts (buffers, bytes) per tenant, summed."""
        total: dict[str, tuple[int, int]] = {}
        for by_tenant in counts:
            for tenant, (n, b) in by_tenant.items():
                old = total.get(tenant, (0, 0))
                total[tenant] = (old[0] + n, old[1] + b)
        with self._lock:
            if self._fleet.island(island.index) is island and island.index not in self._restarting:
                self._census[island.index] = total

    def census(self) -> dict[int, dict[str, tuple[int, int]]]:
        """The last count of what each island holds per tenant."""
        with self._lock:
            return {i: dict(c) for i, c in self._census.items()}
