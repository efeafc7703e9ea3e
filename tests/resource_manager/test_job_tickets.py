"""Jobs' single-use tickets: one session, for their own job, within their time; a misuse is refused and recorded."""

from __future__ import annotations

import pytest

from pathways import auth
from pathways.errors import TenantAccessError
from resource_manager import tickets as tickets_module
from resource_manager.tickets import Tickets


def test_a_ticket_opens_one_session_for_its_own_job_and_is_kept_only_as_a_digest():
    tickets = Tickets()
    ticket = tickets.issue("alice", "job-1")
    assert ticket not in repr(vars(tickets)) and auth.digest(ticket) in repr(vars(tickets))
    assert tickets.redeem(ticket, "job-1") == "alice"
    with pytest.raises(TenantAccessError, match="the ticket of job job-1 was already used or belongs to another job"):
        tickets.redeem(ticket, "job-1")
    assert [(r["job"], r["by_job"]) for r in tickets.refusals()] == [("job-1", "job-1")]


def test_another_jobs_ticket_is_refused_and_the_refusal_recorded():
    tickets = Tickets()
    ticket = tickets.issue("alice", "job-1")
    with pytest.raises(TenantAccessError, match="belongs to another job"):
        tickets.redeem(ticket, "job-2")
    assert tickets.refusals()[-1]["by_job"] == "job-2"
    assert tickets.redeem(ticket, "job-1") == "alice"  # its own job still opens its one session


@pytest.mark.parametrize("ticket", ["made-up", "", None, 5, b"bytes"])
def test_an_unknown_ticket_is_refused_alike(ticket):
    with pytest.raises(TenantAccessError, match="unknown or expired ticket"):
        Tickets().redeem(ticket, "job-1")


def test_an_expired_ticket_is_refused(monkeypatch):
    tickets = Tickets()
    ticket = tickets.issue("alice", "job-1")
    monkeypatch.setattr(tickets_module, "TICKET_TTL_S", -1.0)
    tickets.issue("alice", "job-2")  # issuing drops the expired ones; the first had its full time
    assert tickets.redeem(ticket, "job-1") == "alice"
    late = tickets.issue("alice", "job-3")  # expired as it was made
    with pytest.raises(TenantAccessError, match="unknown or expired ticket"):
        tickets.redeem(late, "job-3")


def test_voiding_a_tenant_stops_its_unused_tickets_only():
    tickets = Tickets()
    alice, bob = tickets.issue("alice", "a"), tickets.issue("bob", "b")
    tickets.void("alice")
    with pytest.raises(TenantAccessError, match="already used"):
        tickets.redeem(alice, "a")
    assert tickets.redeem(bob, "b") == "bob"


def test_refusals_are_bounded(monkeypatch):
    monkeypatch.setattr(tickets_module, "KEEP_REFUSALS", 3)
    tickets = Tickets()
    ticket = tickets.issue("alice", "job-1")
    for k in range(5):
        with pytest.raises(TenantAccessError):
            tickets.redeem(ticket, f"other-{k}")
    assert [r["by_job"] for r in tickets.refusals()] == ["other-2", "other-3", "other-4"]
