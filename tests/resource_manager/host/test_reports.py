"""What a host's executor reports over one pass of its loop, and the spans it traces."""

from __future__ import annotations

import time

from pathways.events import EventLog
from pathways.ops import Exec
from resource_manager.host.reports import Recorder, Report
from resource_manager.host.run import Run


def make() -> tuple[Recorder, list[Report], EventLog]:
    sent: list[Report] = []
    events = EventLog()
    return Recorder(events, sent.append), sent, events


def test_a_pass_with_nothing_to_say_sends_nothing():
    recorder, sent, _ = make()
    recorder.flush([], [])
    assert sent == []


def test_a_blocked_run_is_reported_once_with_what_finished_and_landed():
    recorder, sent, _ = make()
    run = Run(3, "t", 1, "p", (), busy_s=0.5, compile_s=0.1, longest_s=0.2)
    blocked = Run(4, "t", 1, "q", ())
    recorder.blocked(blocked)
    recorder.blocked(blocked)
    recorder.flush([run], [(9, 2)])
    (report,) = sent
    assert report.done == [[3, 0.5, 0.1, 0.2]] and report.blocked == [4] and report.landed == [(9, 2)]
    recorder.blocked(blocked)
    recorder.flush([], [])
    assert len(sent) == 1  # said already: not again


def test_a_group_is_reported_done_once_by_its_last_run():
    recorder, sent, _ = make()
    first = Run(0, "t", 1, "p", (), busy_s=1.0, more=[(10, (), None)])
    rest = first.split()
    first.busy_s, rest[0].busy_s = 1.0, 2.0
    recorder.flush([first], [])
    assert sent == []
    recorder.flush(rest, [])
    assert [r.done for r in sent] == [[[0, 3.0, 0.0, 0.0]]]


def test_fragments_and_ops_are_traced_while_tracing_is_on():
    recorder, _, events = make()
    op = Exec("exe", "s1", (0,), (1,), ((),), ((),), "f")
    run = Run(1, "t", 1, "p", (op,))
    recorder.flush([run], [])  # not tracing: nothing recorded
    recorder.trace_op(run, op, {}, time.time(), 0.5)
    token = events.start()
    run.waiting_since = time.monotonic() - 1.0  # it waited for its inputs before it ran
    wall = time.time()
    recorder.trace_op(run, op, {"slice": "s1"}, wall, 0.5)
    recorder.flush([run], [])
    spans = events.stop(token)
    expected = [("wait for inputs", "wait"), (op.label(), "exec"), ("seq 1: p", "fragment")]
    assert [(e[0], e[1]) for e in spans] == expected
    assert spans[0][3] >= 1.0 and spans[1][2] == wall and spans[1][4]["slice"] == "s1"
