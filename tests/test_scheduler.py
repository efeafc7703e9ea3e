"""An island's scheduler (resource_manager/scheduler.py): one total order, a window of fragments in flight,
weighted fair share between tenants, blocked fragments leaving the window, and a parked fragment resumed
ahead of new work once every host has its data."""

from __future__ import annotations

import pytest

from pathways.messages import CLIENT_ID_BITS, Call
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.scheduler import Resume, Scheduler


def admitted(client: int, tenant: str, k: int) -> Admitted:
    """Message ``k`` of a client: a call (it runs computations, so it counts against the tenant's share)."""
    call = Call(b"", (client << CLIENT_ID_BITS) + k, (), {}, ())
    return Admitted(client, tenant, call.encode(), call)


def refused(client: int, tenant: str) -> Admitted:
    """A message admission refused: it takes a place in the order but runs nothing."""
    return Admitted(client, tenant, b"", None, refusal=Failure("ProgramError", "refused"))


def seqs(released) -> list[int]:
    return [seq for seq, _ in released]


def tenants_of(released) -> list[str]:
    return [item.tenant for _, item in released]


def run_to_the_end(scheduler: Scheduler, released: list, total: int, busy: float = 1e-3) -> list:
    """The island runs everything in flight, ``busy`` seconds each, and reports it at once, until ``total``
    fragments were released."""
    done = 0
    while done < total:
        pending = released[done:]
        assert pending, f"nothing in flight after {done} of {total}: the scheduler stalled"
        done = len(released)
        released += scheduler.completed([[seq, busy] for seq, _ in pending])
    return released


def test_the_scheduler_keeps_one_order_and_shares_by_weight():
    scheduler = Scheduler(0, 1, window=8, eager=2)
    released = []
    for client, (tenant, weight) in enumerate({"light": 1.0, "heavy": 3.0}.items(), start=1):
        scheduler.set_weight(tenant, weight)
        for k in range(200):
            released += scheduler.queue([admitted(client, tenant, k)])
    assert 0 < len(released) <= 8, "the window bounds what is in flight"
    done = 0
    while done < 400:  # the island runs everything in flight, 1 ms each, and reports it at once
        pending = released[done:]
        assert 0 < len(pending) <= 8
        done = len(released)
        released += scheduler.completed([[seq, 1e-3] for seq, _ in pending])
    assert seqs(released) == list(range(400))
    tenants = tenants_of(released[8:200])  # after the first window, sent before heavy arrived
    assert 2.7 < tenants.count("heavy") / tenants.count("light") < 3.3  # weights 3:1
    for tenant in ("light", "heavy"):  # each client's messages keep their order
        bases = [item.request.base for _, item in released if item.tenant == tenant]
        assert bases == sorted(bases)


def test_equal_weights_alternate_and_every_message_is_released_once_in_sequence():
    scheduler = Scheduler(0, 1, window=4, eager=4)
    released = scheduler.queue([admitted(1, "a", k) for k in range(50)] + [admitted(2, "b", k) for k in range(50)])
    released = run_to_the_end(scheduler, released, 100)
    assert seqs(released) == list(range(100))
    assert sorted((item.client, item.request.base) for _, item in released) == sorted(
        (c, (c << CLIENT_ID_BITS) + k) for c in (1, 2) for k in range(50))
    middle = tenants_of(released[10:90])
    assert abs(middle.count("a") - middle.count("b")) <= 4, middle


def test_the_window_bounds_the_fragments_in_flight():
    scheduler = Scheduler(0, 1, window=3, window_s=10.0, eager=100)
    released = scheduler.queue([admitted(1, "a", k) for k in range(10)])
    assert seqs(released) == [0, 1, 2]
    assert scheduler.stats()["inflight"] == 3 and scheduler.stats()["queued"] == 7
    assert seqs(scheduler.completed([[0, 1e-3]])) == [3]  # one left the window, one more enters


def test_the_window_also_bounds_the_estimated_island_time_in_flight():
    # the first estimate of a tenant's fragment is 1 ms: 2.5 ms admit three (the window is reached after the 3rd)
    scheduler = Scheduler(0, 1, window=64, window_s=0.0025, eager=100)
    assert seqs(scheduler.queue([admitted(1, "a", k) for k in range(10)])) == [0, 1, 2]


def test_a_lone_fragment_longer_than_the_window_still_runs():
    scheduler = Scheduler(0, 1, window=64, window_s=0.001, eager=100)
    scheduler.queue([admitted(1, "a", 0)])
    scheduler.completed([[0, 5.0]])  # the tenant's estimate is now far over the window
    assert seqs(scheduler.queue([admitted(1, "a", 1), admitted(1, "a", 2)])) == [1]


def test_once_eager_fragments_are_in_flight_new_messages_wait_for_a_completion():
    scheduler = Scheduler(0, 1, window=64, eager=2)
    assert seqs(scheduler.queue([admitted(1, "a", 0), admitted(1, "a", 1)])) == [0, 1]
    assert scheduler.queue([admitted(1, "a", 2)]) == [] and scheduler.queue([admitted(1, "a", 3)]) == []
    assert seqs(scheduler.completed([[0, 1e-3]])) == [2, 3]  # released together, with the report


def test_messages_that_run_nothing_take_a_place_in_the_order_but_not_in_the_window():
    scheduler = Scheduler(0, 1, window=1, eager=100)
    released = scheduler.queue([admitted(1, "a", 0), refused(1, "a"), refused(1, "a")])
    assert seqs(released) == [0]  # the call fills the window of one
    released = scheduler.completed([[0, 1e-3]])
    assert seqs(released) == [1, 2] and scheduler.stats()["inflight"] == 0
    assert scheduler.stats()["fragments"] == {"a": 1}


def test_a_tenant_waking_up_starts_at_the_current_virtual_time():
    """A tenant idle while another ran gets its share from now on, not a burst to make up for the past."""
    scheduler = Scheduler(0, 1, window=2, eager=2)
    released = scheduler.queue([admitted(1, "busy", k) for k in range(100)])
    released = run_to_the_end(scheduler, released, 60)
    start = len(released)
    released += scheduler.queue([admitted(2, "late", k) for k in range(40)])
    released = run_to_the_end(scheduler, released, start + 40)
    window = tenants_of(released[start:start + 40])
    assert 15 <= window.count("late") <= 25, window


def test_island_time_used_is_charged_to_the_tenant_by_its_weight():
    """A tenant whose fragments take 3x as long gets a third as many of them at equal weights."""
    scheduler = Scheduler(0, 1, window=2, eager=2)
    released = scheduler.queue([admitted(1, "slow", k) for k in range(200)] +
                               [admitted(2, "fast", k) for k in range(200)])
    done = 0
    while done < 240:
        pending = released[done:]
        done = len(released)
        released += scheduler.completed([[seq, 3e-3 if item.tenant == "slow" else 1e-3] for seq, item in pending])
    later = tenants_of(released[40:240])  # once the estimates have learned each tenant's time
    assert 2.5 < later.count("fast") / later.count("slow") < 3.5, (later.count("fast"), later.count("slow"))
    stats = scheduler.stats()
    assert stats["tenant_time_s"]["slow"] == pytest.approx(3e-3 * stats["fragments"]["slow"], rel=0.05)


def test_a_fragment_that_ran_longer_than_its_estimate_is_charged_what_it_used():
    """Charged at release by its estimate (1 ms at first), corrected by the time it reported: a 50 ms
    fragment puts its tenant behind the other one by about 49 ms of the other's fragments."""
    scheduler = Scheduler(0, 1, window=2, eager=2)
    released = scheduler.queue([admitted(1, "a", k) for k in range(30)] + [admitted(2, "b", k) for k in range(30)])
    assert tenants_of(released) == ["a", "b"]
    released = scheduler.completed([[released[0][0], 0.05], [released[1][0], 1e-3]])
    done = 0
    while done < len(released) and len(released) < 29:
        pending = released[done:]
        done = len(released)
        released += scheduler.completed([[seq, 1e-3] for seq, _ in pending])
    assert tenants_of(released[:29]) == ["b"] * 29


def test_a_blocked_fragment_leaves_the_window_and_is_still_charged_when_it_completes():
    scheduler = Scheduler(0, 1, window=2, eager=100)
    released = scheduler.queue([admitted(1, "a", k) for k in range(5)])
    assert seqs(released) == [0, 1]
    assert seqs(scheduler.blocked([0])) == [2]  # waiting on another island's transfer: it makes room
    stats = scheduler.stats()
    assert (stats["inflight"], stats["blocked"]) == (2, 1)
    assert seqs(scheduler.completed([[0, 0.5]])) == []  # it was out of the window: no room made
    assert scheduler.stats()["blocked"] == 0 and scheduler.stats()["tenant_time_s"] == {"a": 0.5}


def test_blocked_and_completed_reports_of_unknown_fragments_change_nothing():
    scheduler = Scheduler(0, 1, window=2, eager=100)
    scheduler.queue([admitted(1, "a", k) for k in range(3)])
    assert scheduler.blocked([99]) == [] and scheduler.completed([[98, 1.0]]) == []
    assert scheduler.stats()["tenant_time_s"] == {} and scheduler.stats()["inflight"] == 2


def test_a_parked_receive_resumes_only_once_every_host_has_its_data():
    scheduler = Scheduler(0, n_hosts=3, window=4, eager=100)
    scheduler.queue([admitted(1, "a", 0)])
    assert scheduler.landed(0, [(0, 2)]) == []
    assert scheduler.landed(0, [(0, 2)]) == []  # the same host again does not count twice
    assert scheduler.landed(2, [(0, 2)]) == [] and scheduler.stats()["parked"] == 1
    assert scheduler.landed(1, [(0, 2)]) == [(1, Resume(0, 2))]
    assert scheduler.stats()["parked"] == 0


def test_a_resume_goes_ahead_of_new_work_and_takes_no_place_in_the_window():
    scheduler = Scheduler(0, n_hosts=2, window=8, eager=1)
    scheduler.queue([admitted(1, "a", 0)])  # seq 0, parks at its receive (op 1)
    assert scheduler.queue([admitted(2, "b", k) for k in range(3)]) == []  # eager: they wait
    scheduler.landed(0, [(0, 1)])
    released = scheduler.landed(1, [(0, 1)])
    assert released[0] == (1, Resume(0, 1))
    assert seqs(released) == [1, 2, 3, 4] and tenants_of(released[1:]) == ["b", "b", "b"]
    assert scheduler.stats()["inflight"] == 4  # the fragment of seq 0 and b's three; the resume is not one


def test_weights_come_from_set_weight():
    scheduler = Scheduler(0, 1)
    scheduler.set_weight("a", 2.5)
    assert scheduler.stats()["weights"] == {"a": 2.5}
