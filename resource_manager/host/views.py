"""What a host says about itself: a tenant's own view (for its client's requests) and the host's aggregates (for
the resource manager and the admin), read from the host's parts. Nothing here changes what the host runs."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from pathways.events import for_tenant
from resource_manager.host.scheduler import NAMED

SETTLE_S = 10.0  # a trace waits this long at most for a pass in progress (a long computation) to end

if TYPE_CHECKING:
    from resource_manager.host.wiring import Parts


class HostViews:
    """The views of host ``index`` of island ``island`` at restart ``epoch``, over ``parts``."""

    def __init__(self, island: int, index: int, epoch: int, parts: Parts) -> None:
        self.island, self.index, self.epoch = island, index, epoch
        self.parts = parts
        self.started = time.time()
        self._lock = threading.Lock()
        self._tracers: dict[int, int] = {}
        self.health_checks = 0  # answered: a client can wait for the resource manager to have counted what it holds

    # -- what a client may ask of its own ------------------------------------------------------------------
    def stalled(self, tenant: str) -> dict:
        """What this host's admitted fragments of ``tenant`` wait for, and how many messages it holds until an
        earlier sequence number arrives."""
        p = self.parts
        return {"island": self.island, "host": self.index, "held": p.inbox.held(), "runs": p.executor.stalled(tenant)}

    def usage(self, tenant: str, reset_peak: bool) -> dict:
        """``tenant``'s buffers, bytes, peak bytes (restarted with ``reset_peak``) and executables here."""
        p = self.parts
        out = p.table.tenant_usage(tenant)
        if reset_peak:
            p.table.reset_peak(tenant)
        return {**out, **p.exes.tenant_stats(tenant), "island": self.island, "host": self.index}

    def trace_start(self, client: int) -> int:
        """Start recording this host's events for client ``client``'s ``pw.trace``."""
        token = self.parts.events.start()
        with self._lock:
            self._tracers[client] = token
        return token

    def trace_stop(self, client: int, tenant: str) -> list:
        """The client's trace: its tenant's events by name, everyone else's as anonymous spans. The executor's pass
        in progress ends first, so every fragment whose output the client saw ready is in it."""
        self.parts.executor.settle(SETTLE_S)
        with self._lock:
            token = self._tracers.pop(client, None)
        return for_tenant(self.parts.events.stop(token), tenant)

    def schedule_stats(self, tenant: str | None) -> dict:
        """The island's share of time per tenant: ``tenant``'s by name and the others as one sum (every tenant
        by name for None, the admin's view)."""
        stats = self.parts.order.scheduler.stats()
        if tenant is None:
            return stats
        out = {k: v for k, v in stats.items() if k not in NAMED}
        for key in ("tenant_time_s", "tenant_time_recent_s"):
            times = stats[key]
            out[key] = {tenant: times.get(tenant, 0.0)}
            out[key.replace("tenant", "others")] = sum(v for t, v in times.items() if t != tenant)
        return out

    # -- health and aggregates (no tenant is named) -------------------------------------------------------
    @property
    def dead(self) -> str | None:
        """Why this host can no longer run (its executor died), or None."""
        return self.parts.executor.dead

    def quiet(self) -> dict:
        """Whether this host has finished everything it was given: nothing admitted but unfinished, no lent
        shard out; with how far its share of the island's order has come (``next_seq``) and, on host 0, how
        far the order goes (``sequenced``). The island is quiet when every host is and has caught up."""
        p = self.parts
        busy = p.executor.busy() + p.inbox.held()
        out = {"island": self.island, "host": self.index, "idle": busy == 0 and p.peers.lent_bytes == 0,
               "next_seq": p.inbox.next_seq, "busy": busy, "bytes": p.table.nbytes}
        scheduler = p.order.scheduler
        if scheduler is not None:
            stats = scheduler.stats()
            out["sequenced"] = stats["sequenced"]
            out["idle"] = out["idle"] and stats["queued"] == 0 and stats["inflight"] == 0
        return out

    def stats(self) -> dict:
        """Counters of the whole host, with no tenant's name in them."""
        p = self.parts
        out = {"island": self.island, "host": self.index, "pid": os.getpid(), "epoch": self.epoch,
               "buffers": len(p.table), "buffer_bytes": p.table.nbytes, "peak_buffer_bytes": p.table.peak_bytes,
               "tenants": len(p.table.by_tenant()), "compiles": p.exes.compiles, "cache_hits": p.exes.hits,
               "executables": len(p.exes), "evictions": p.exes.evictions, "next_seq": p.inbox.next_seq,
               "waiting": p.inbox.held(), "uptime_s": time.time() - self.started,
               "busy_fraction": p.metrics.busy_fraction if p.metrics is not None else 0.0,
               "dead": p.executor.dead or "", "health_checks": self.health_checks}
        out.update(p.executor.stats())
        out.update(p.pool.stats())
        out.update(p.peers.stats())
        if p.clients is not None:
            out.update(p.clients.stats())
        scheduler = p.order.scheduler
        if scheduler is not None:
            out["schedule"] = {k: v for k, v in scheduler.stats().items() if k not in NAMED}
            out["stream_gaps_waiting"] = p.order.admission.waiting()
        return out

    def census(self) -> dict:
        """Buffers and bytes per tenant: for the resource manager, to say what a restart lost."""
        return self.parts.table.by_tenant()

    def checked(self) -> dict:
        """The census a health check carries; counts the check (``health_checks`` in ``stats``)."""
        with self._lock:
            self.health_checks += 1
        return self.census()
