"""A group's one-computation calls run back to back: each as if alone, and the group stops at a call that waits."""

from __future__ import annotations

import numpy as np
import pytest
from test_executor import TENANT, Host, one

import pathways as pw
from resource_manager.host.buffers import Failure
from resource_manager.host.group_calls import run_calls
from resource_manager.host.run import Run


@pytest.fixture
def host():
    h = Host()
    yield h
    h.executor.stop()


def group(host: Host, exe: str, reads: list[int], base: int = 1000) -> Run:
    """A group of one call of ``exe`` per read (call k writes ``base + 100 * k + 1``), its uses counted as at
    admission; not admitted to the executor."""
    template = one(exe, "inc")
    calls = [(base + 100 * k, (read,)) for k, read in enumerate(reads)]
    run = Run(0, TENANT, 1, "inc", template.ops, template, 1, calls[0][0], calls[0][1], calls=len(calls))
    run.touched = run.call_touches(*calls[0])
    run.more = [(b, i, run.call_touches(b, i)) for b, i in reversed(calls[1:])]
    for touched in [run.touched] + [t for _, _, t in run.more]:
        host.table.add_uses(touched)
    return run


def launch(host: Host, run: Run) -> tuple[bool, float, int]:
    op = run.ops[0]
    handler = host.handlers.by_op[type(op)]
    return run_calls(run, op, handler.launcher(run, op), handler, host.table, 0.0, 0.0)


def test_every_call_of_a_group_runs_with_its_own_ids(host):
    inc = host.function(lambda v: v + 1.0, 1)
    host.value(100, np.zeros(4, np.float32))
    run = group(host, inc, [100, 1001, 1101])  # each call reads the one before it
    done, busy, ran = launch(host, run)
    assert done and ran == 3 and busy > 0 and run.pc == run.end and run.busy_s == pytest.approx(busy)
    np.testing.assert_allclose(host.fetch(1201), 3.0)


def test_a_call_whose_input_is_missing_stops_the_group_there(host):
    inc = host.function(lambda v: v + 1.0, 1)
    host.value(100, np.zeros(4, np.float32))
    run = group(host, inc, [100, 555, 100])
    done, _, ran = launch(host, run)
    assert not done and ran == 1 and run.base == 1100 and run.pc == 0 and len(run.more) == 1
    np.testing.assert_allclose(host.fetch(1001), 1.0)
    assert 1101 not in host.table and 1201 not in host.table


def test_a_failing_call_fails_its_own_outputs_and_the_next_call_runs(host):
    inc = host.function(lambda v: v + 1.0, 1)
    host.value(100, np.zeros(4, np.float32))
    host.table.put(101, TENANT, Failure("ProgramError", "the input failed"))
    done, _, ran = launch(host, group(host, inc, [101, 100]))
    assert done and ran == 2
    with pytest.raises(pw.ProgramError, match="the input failed"):
        host.fetch(1001)
    np.testing.assert_allclose(host.fetch(1101), 1.0)
