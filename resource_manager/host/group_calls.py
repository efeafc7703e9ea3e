"""A group's one-computation calls run back to back on a host: what they share is worked out once, by the caller."""

from __future__ import annotations

import time
from collections.abc import Callable

from pathways.errors import to_wire
from pathways.ops import Op
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.handlers import Failed, Handler
from resource_manager.host.run import Run
from resource_manager.host.run_failures import fail_op


def run_calls(run: Run, op: Op, run_call: Callable[[Run], bool], handler: Handler, table: BufferTable,
              start: float, lost: float) -> tuple[bool, float, int]:
    """Run ``run``'s calls of ``op`` with ``run_call`` (its ``handler``'s launcher) from the current one on, each
    as the executor would run it alone: a failed call fails its outputs, each call's uses end as it does. Times
    count from ``start`` (``time.perf_counter``); ``lost`` seconds of compiling are charged to the first call's
    time only. Returns whether every call ran (else the current one waits for an input), the seconds they took,
    and how many ran."""
    tenant, frees = run.tenant, op.frees
    busy, ran_calls = 0.0, 0
    while True:
        try:
            if not run_call(run):
                return False, busy, ran_calls
        except Failed as exc:
            fail_op(handler, table, run, op, exc.failure)
        except Exception as exc:  # an op's failure becomes its outputs' failure
            fail_op(handler, table, run, op, Failure(*to_wire(exc)))
        now = time.perf_counter()
        elapsed = now - start
        start = now
        run.busy_s += elapsed
        ran = elapsed - lost
        lost = 0.0
        if ran > run.longest_s:
            run.longest_s = ran
        busy += elapsed
        table.done_using(run.touched, run.ids(frees) if frees else (), tenant)
        ran_calls += 1
        if not run.more:
            run.pc = run.end
            return True, busy, ran_calls
        run.next_call()
