"""An island's order: host 0 admits clients' batches, orders them with its scheduler and hands every host its share.

On host 0 a client's batch comes in on its connection's thread (``submit``): admission checks each message, the
scheduler (``scheduler.Scheduler``) gives what may go its place in the island's order, and the released items go
to this host's inbox at once and, on a multi-host island, to the other hosts as one signed actor call per batch
(``Uplink.rows``). The executor's reports come back here (``report``): completions, blocks and landings go to the
scheduler, whose answer is released the same way. Hosts past 0 keep no order of their own: host 0's rows go to
their inbox (``rows``), and their executors' landings go up to host 0 (``Uplink.landed``). Nothing here calls
the layers above it, and nothing here waits: each call runs on its caller's thread.
"""

from __future__ import annotations

import time
from typing import Protocol

from pathways.errors import ClusterSuspendedError, PathwaysError
from pathways.messages import Free
from resource_manager.host.admission import Admission, Admitted
from resource_manager.host.grants import Session
from resource_manager.host.inbox import Inbox
from resource_manager.host.preemption import gc_cpu_s
from resource_manager.host.reports import Report
from resource_manager.host.rows import Landed, encode
from resource_manager.host.scheduler import Released, Scheduler


class Uplink(Protocol):
    """How the order reaches the island's other hosts (their actors, signed with the runtime key)."""

    def rows(self, rows: list[tuple]) -> None:
        """Host 0's ordered rows (``rows.encode``) to each other host of the island."""

    def landed(self, landed: Landed) -> None:
        """This host's landed receives to host 0."""


class IslandOrder:
    """Host ``index``'s end of island ``island``'s order (of ``n_hosts``): ``scheduler`` and ``admission`` on host 0
    only. ``uplink`` reaches the other hosts (None on a lone host); the released items go to the inbox ``feed``
    names (the executor that inbox feeds reports here, so the order is made first)."""

    def __init__(self, island: int, index: int, n_hosts: int, scheduler: Scheduler | None,
                 admission: Admission | None, uplink: Uplink | None = None) -> None:
        self.island, self.index, self.n_hosts = island, index, n_hosts
        self.scheduler, self.admission = scheduler, admission
        self.inbox: Inbox | None = None
        self._uplink = uplink if n_hosts > 1 else None
        self.quiescing = False  # the cluster is being suspended: host 0 takes no more batches

    def feed(self, inbox: Inbox) -> None:
        """Released items go to ``inbox`` (this host's)."""
        self.inbox = inbox

    # -- clients' streams (host 0) --------------------------------------------------------------------------
    def submit(self, session: Session, first: int, msgs: list[bytes]) -> None:
        """Messages ``first``, ... of ``session``'s stream: each admitted or refused alone (a refusal reaches
        its outputs), then ordered with every other client's and handed to the island's hosts."""
        admission, scheduler = self.admission, self.scheduler
        if admission is None:
            raise PathwaysError(f"host {self.index} of island {self.island} takes no client messages; host 0 does")
        if self.quiescing:
            raise ClusterSuspendedError("the cluster is being suspended by its admin; this batch was not taken, and "
                                        "the client sends it again once the cluster resumes")
        # checking the tenant's messages is the island's work for it: this thread's CPU time, garbage collection
        # aside (its wall time counts waits for the interpreter and for other processes, and a collection is the
        # host's work for everything it holds: no work of the tenant's), charged with the messages it let through
        start = time.thread_time() - gc_cpu_s()
        try:
            admitted = admission.accept(session.client, session.tenant, first, msgs)
        except BaseException:
            scheduler.charge(session.tenant, time.thread_time() - gc_cpu_s() - start)
            raise
        spent = time.thread_time() - gc_cpu_s() - start
        self.forward(scheduler.queue(admitted, session.tenant, spent, len(msgs)))

    def end_session(self, client: int, tenant: str, free: bool) -> None:
        """Client ``client``'s session ended: its stream is forgotten and, with ``free``, everything it holds is freed
        in the island's order, after everything it sent."""
        if self.admission is None:
            return
        self.admission.revoke(client)
        if free:
            message = Free((), everything=True)
            self.forward(self.scheduler.queue([Admitted(client, tenant, message.encode(), message)]))

    def expire(self) -> None:
        """Skip clients' stream gaps that waited too long (host 0)."""
        if self.admission is not None:
            expired = self.admission.expire()
            if expired:
                self.forward(self.scheduler.queue(expired))

    def release_due(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a throttled tenant's hold to end and release what then may go (host 0)."""
        self.forward(self.scheduler.wait_due(timeout))

    def forward(self, released: Released) -> None:
        """The scheduler's released items to every host of the island: this one's without an actor call."""
        if not released:
            return
        if self._uplink is not None:
            self._uplink.rows(encode(released))
        self.inbox.accept(released)

    # -- completion -----------------------------------------------------------------------------------------
    def report(self, report: Report) -> None:
        """The executor's report: to the scheduler on host 0 (which speaks for the island), else only landings, to
        host 0."""
        scheduler = self.scheduler
        if scheduler is not None:
            released: Released = []
            if report.blocked:
                released += scheduler.blocked(report.blocked)
            if report.done:
                released += scheduler.completed(report.done)
            if report.landed:
                released += scheduler.landed(0, report.landed)
            self.forward(released)
        elif report.landed and self._uplink is not None:
            self._uplink.landed(Landed(self.index, tuple((int(s), int(pc)) for s, pc in report.landed)))

    # -- what the other hosts send --------------------------------------------------------------------------
    def landed(self, landed: Landed) -> None:
        """Host ``landed.host`` has the data of these parked receives (host 0 of a multi-host island; verified)."""
        self.forward(self.scheduler.landed(landed.host, list(landed.pairs)))

    def rows(self, rows: list[tuple]) -> None:
        """Host 0's ordered rows (``rows.encode``) for this host (verified)."""
        self.inbox.accept_rows(rows)
