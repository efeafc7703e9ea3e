"""Waiting for the islands' answers (client/waiting.py): results in order, errors as they are, a broken link as
an island failure after the health check, a host's own timeout and a wait past its deadline as the timeout
error that says where the unfinished programs stopped."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from client import waiting
from client.link import LinkClosed
from pathways.errors import ClusterSuspendedError, IslandFailedError, ProgramError
from pathways.names import FETCH_TIMED_OUT


def _done(value=None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
    return future


def _never() -> Exception:
    raise AssertionError("not a timeout")


def test_results_come_in_the_futures_order():
    later: Future = Future()
    threading.Timer(0.05, later.set_result, args=("b",)).start()
    assert waiting.results([_done("a"), later, _done(3)], 10.0, 0.01, "x", lambda: None, _never) == ["a", "b", 3]


def test_the_health_check_runs_while_waiting_and_its_error_ends_the_wait():
    checks = []

    def check() -> None:
        checks.append(time.monotonic())
        if len(checks) == 3:
            raise IslandFailedError("island 1 has failed: its host died")

    with pytest.raises(IslandFailedError, match="its host died"):
        waiting.results([Future()], 60.0, 0.01, "x", check, _never)
    assert len(checks) == 3


def test_an_error_is_raised_as_it_is_and_a_broken_link_is_an_island_failure():
    with pytest.raises(ProgramError, match="bad program"):
        waiting.results([_done(1), _done(error=ProgramError("bad program"))], 10.0, 0.01, "x", lambda: None, _never)
    checked = []
    for broken in (LinkClosed("the host went away"), ClusterSuspendedError("suspended")):
        with pytest.raises(IslandFailedError, match=r"fetching y failed: .*(went away|suspended)"):
            waiting.results([Future(), _done(error=broken)], 10.0, 0.01, "fetching y", lambda: checked.append(1),
                            _never)
    assert checked == [1, 1]


def test_a_hosts_timeout_and_a_wait_past_its_deadline_are_the_timeout_error(monkeypatch):
    error = IslandFailedError("timed out, here is where")
    with pytest.raises(IslandFailedError, match="here is where"):
        waiting.results([_done(FETCH_TIMED_OUT)], 10.0, 0.01, "x", lambda: None, lambda: error)
    monkeypatch.setattr(waiting, "RPC_GRACE_S", 0.0)
    started = time.monotonic()
    with pytest.raises(IslandFailedError, match="here is where"):
        waiting.results([Future()], 0.2, 0.05, "x", lambda: None, lambda: error)
    assert 0.2 <= time.monotonic() - started < 5.0


def _report(host: int, runs: list[dict], held: int = 0) -> dict:
    return {"island": 1, "host": host, "runs": runs, "held": held}


def _run(program: str, missing: list[str], kind: str = "exec", name: str = "exec") -> dict:
    return {"program": program, "seq": 4, "op": 2, "kind": kind, "name": name, "missing": missing}


def test_the_timeout_error_says_where_each_unfinished_program_stands():
    reports = [_done(_report(0, [_run("step", ["buffer 7", "buffer 8", "buffer 9"], "recv", "grads"),
                                 _run("eval", [])], held=2)),
               _done(error=LinkClosed("gone")),  # a host that does not answer is left out
               Future()]  # nor does a slow one hold the error up for more than the poll interval
    error = waiting.timed_out("fetching loss", 3.0, frozenset({1}), reports, poll=0.01)
    text = str(error)
    assert isinstance(error, IslandFailedError)
    assert text.startswith("fetching loss timed out after 3.0s; islands [1] are alive but did not produce it")
    assert ("island 1 host 0: program 'step' (sequence 4) at op 2 (recv grads) waits for buffer 7 and 2 more"
            in text)
    assert "program 'eval' (sequence 4) at op 2 (exec) is running" in text
    assert "island 1 host 0: 2 messages wait for an earlier one to arrive" in text


def test_a_long_report_names_the_first_runs_and_counts_the_rest():
    report = _report(0, [_run(f"p{k}", []) for k in range(11)])
    assert len(waiting.stalled_lines(report)) == 11
    text = str(waiting.timed_out("x", 1.0, frozenset({1}), [_done(report)], poll=0.01))
    assert "'p7'" in text and "'p8'" not in text and text.endswith("; and 3 more")
    assert str(waiting.timed_out("x", 1.0, frozenset({0}), [], poll=0.01)).endswith("(overloaded or stuck)")
