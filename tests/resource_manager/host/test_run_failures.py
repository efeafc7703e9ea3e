"""Where a failed op's failure goes: its outputs (the tenant's own only), and for a run that will not run, every
output of it and of its group's later calls."""

from __future__ import annotations

import pytest
from test_executor import TENANT, Host, one

from pathways.ops import Exec, Template
from resource_manager.host.buffers import Failure
from resource_manager.host.handlers import Handler
from resource_manager.host.run import Run
from resource_manager.host.run_failures import fail_op, fail_rest

FAILURE = Failure("ProgramError", "it broke")


class Undoing(Handler):
    """A handler whose ``fail`` hook says what it was asked to undo."""

    def __init__(self, parts) -> None:
        super().__init__(parts)
        self.failed: list[tuple[int, Failure]] = []

    def fail(self, run: Run, op, failure: Failure) -> None:
        self.failed.append((run.seq, failure))


@pytest.fixture
def host():
    h = Host()
    yield h
    h.executor.stop()


def test_a_failed_op_fails_its_own_outputs_and_leaves_another_tenants_buffer_alone(host):
    op = Exec("exe", "s1", (0,), (1, 2), ((),), ((), ()), "f")
    template = Template("p", 1, 3, {}, (op,))
    run = Run(0, TENANT, 1, "p", template.ops, template, 1, 1000, (100,))
    host.table.put(1002, "other", 7.0, nbytes=4)
    handler = Undoing(host.handlers)
    fail_op(handler, host.table, run, op, FAILURE)
    assert host.table.lookup(1001, TENANT).value is FAILURE
    assert host.table.lookup(1002, "other").value == 7.0
    assert handler.failed == [(0, FAILURE)]


def test_a_run_that_will_not_run_fails_what_it_and_its_groups_later_calls_would_write(host):
    template = one("exe", "f")
    run = Run(0, TENANT, 1, "p", template.ops, template, 1, 1000, (100,), more=[(3000, (100,), None),
                                                                               (2000, (100,), None)])
    fail_rest(host.table, run, FAILURE)
    assert all(host.table.lookup(i, TENANT).value is FAILURE for i in (1001, 2001, 3001))


def test_a_part_that_will_not_run_fails_only_what_its_own_ops_would_write(host):
    ops = one("exe", "a", outputs=(1,)).ops + one("exe", "b", inputs=(1,), outputs=(2,)).ops
    template = Template("p", 1, 3, {}, ops)
    fail_rest(host.table, Run(0, TENANT, 1, "p", ops, template, 1, 1000, (100,), pc=1), FAILURE)
    assert 1001 not in host.table and host.table.lookup(1002, TENANT).value is FAILURE
