"""How long a host's loop may sleep before an op times out, and what a stuck client is told."""

from __future__ import annotations

import time

import pytest
from test_executor import Host, one

from resource_manager.host.run import Run
from resource_manager.host.waits import next_deadline, stalled


def waiting(since: float | None) -> Run:
    return Run(0, "t", 1, "p", (), waiting_since=since)


def test_the_loop_sleeps_at_most_a_second_and_never_past_the_receivers_expiry():
    assert next_deadline([], 5.0, 10.0) == 1.0
    assert next_deadline([waiting(None)], 5.0, 0.25) == 0.25


def test_the_loop_wakes_when_the_longest_waiting_op_times_out():
    now = time.monotonic()
    assert next_deadline([waiting(now), waiting(now - 4.7)], 5.0, 10.0) == pytest.approx(0.3, abs=0.1)
    assert next_deadline([waiting(now - 60)], 5.0, 10.0) == 0.001  # overdue: at once, but not a busy spin


def test_a_stuck_client_is_told_what_each_unfinished_run_waits_for():
    host = Host()
    try:
        op_run = Run(4, "t", 1, "prog", one("exe", "f").ops, n_inputs=1, base=1000, inputs=(404,),
                     waiting_since=time.monotonic() - 2)
        done = Run(5, "t", 1, "done", one("exe", "g").ops, pc=1)
        (stuck,) = stalled([op_run, done], host.handlers.by_op)
        assert stuck["seq"] == 4 and stuck["program"] == "prog" and stuck["kind"] == "exec"
        assert stuck["missing"] == ["buffer 404"] and not stuck["parked"] and stuck["waiting_s"] >= 2
    finally:
        host.executor.stop()
