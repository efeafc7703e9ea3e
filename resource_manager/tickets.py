"""Jobs' single-use tickets: how a job's process opens a session of its tenant without holding its credential.

The job runner asks for one per job and hands it to the job's process; the ticket opens one session, for that job
only, within ``TICKET_TTL_S``. Only each ticket's digest is kept. A ticket presented twice, or by another job, is
refused and the refusal recorded for the admin.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pathways import auth
from pathways.errors import TenantAccessError

TICKET_TTL_S = 600.0
KEEP_REFUSALS = 100
log = logging.getLogger(__name__)


@dataclass
class Ticket:
    """A job's single-use ticket, stored under its digest: the tenant it opens a session for, until ``expires``."""

    tenant: str
    job: str
    expires: float
    used: bool = False


class Tickets:
    """The tickets issued (by digest) and the refusals of misused ones, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}
        self._refusals: list[dict] = []

    def issue(self, tenant: str, job: str) -> str:
        """A single-use ticket for job ``job`` of ``tenant`` (the job runner hands it to the job's process)."""
        with self._lock:
            now = time.time()
            # used ones stay until they expire, so that a reuse is logged
            self._tickets = {d: t for d, t in self._tickets.items() if t.expires > now}
            ticket = auth.new_secret()
            self._tickets[auth.digest(ticket)] = Ticket(tenant, job, now + TICKET_TTL_S)
            return ticket

    def redeem(self, ticket: object, job: str) -> str:
        """The tenant ``ticket`` opens a session for, as job ``job``; the ticket is used up. TenantAccessError for
        an unknown, expired or used ticket, or one of another job."""
        with self._lock:
            record = self._tickets.get(auth.digest(ticket)) if isinstance(ticket, str) else None
            if record is None or record.expires < time.time():
                raise TenantAccessError("unknown or expired ticket; submit the job again with `pathways submit`")
            if record.used or record.job != job:
                self._refusals.append({"at": time.time(), "job": record.job, "by_job": job})
                self._refusals = self._refusals[-KEEP_REFUSALS:]
                log.warning("refused a ticket of job %s (presented by job %r, used before: %s)", record.job, job,
                            record.used)
                raise TenantAccessError(f"the ticket of job {record.job} was already used or belongs to another "
                                        "job; a ticket opens one session, for its own job")
            record.used = True
            return record.tenant

    def void(self, tenant: str) -> None:
        """``tenant``'s unused tickets stop working (its credential changed, or it was removed)."""
        with self._lock:
            for ticket in self._tickets.values():
                if ticket.tenant == tenant:
                    ticket.used = True

    def refusals(self) -> list[dict]:
        """The last refused tickets: when, whose job, presented by which job."""
        with self._lock:
            return list(self._refusals)
