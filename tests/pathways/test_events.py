"""The trace event log: recording costs nothing while no tracer is on, each tracer gets the events since its
own start, and a tenant sees other tenants' spans only as anonymous ones."""

from __future__ import annotations

import time

from pathways.events import OTHER, EventLog, for_tenant


def test_nothing_is_recorded_while_no_tracer_is_on():
    log = EventLog()
    log.span("run", "exec", 1.0, 2.0)
    token = log.start()
    assert log.stop(token) == []
    assert not log.enabled


def test_each_tracer_gets_the_events_since_its_own_start_and_the_log_empties_after_the_last():
    log = EventLog()
    first = log.start()
    now = time.time()
    log.span("early", "exec", now - 5.0, now - 4.0)  # ended before the first tracer started: not its own
    log.span("a", "exec", now - 0.5, now, tenant="t1")  # ends after the first started, before the second
    time.sleep(0.01)
    second = log.start()
    later = time.time() + 1.0
    log.span("b", "exec", later, later + 0.25)
    assert [e[0] for e in log.stop(second)] == ["b"]  # the span that ended before it started is not its own
    assert log.enabled  # the first one still records
    events = log.stop(first)
    assert [(e[0], e[3], e[4]) for e in events] == [("a", 0.5, {"tenant": "t1"}), ("b", 0.25, {})]
    assert not log.enabled
    assert log.stop(first) == [] and log.stop() == []  # a stopped or unknown tracer gets nothing


def test_stop_without_a_token_ends_the_latest_tracer():
    log = EventLog()
    first, second = log.start(), log.start()
    log.stop()
    assert log.enabled and log.stop(second) == []
    log.stop(first)
    assert not log.enabled


def test_a_tenant_sees_its_own_spans_whole_and_everyone_elses_as_anonymous_spans():
    events = [("run", "exec", 1.0, 0.5, {"tenant": "alice", "program": "step"}),
              ("run", "exec", 2.0, 0.25, {"tenant": "bob", "program": "secret"}),
              ("idle", "host", 3.0, 1.0, {})]
    assert for_tenant(events, "alice") == [events[0], (OTHER, "other", 2.0, 0.25, {}), (OTHER, "other", 3.0, 1.0, {})]
