"""Where a failed op's failure goes: to the buffers it would have written, so every reader fails with it."""

from __future__ import annotations

from pathways.ops import Op
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.handlers import Handler
from resource_manager.host.run import Run


def fail_op(handler: Handler, table: BufferTable, run: Run, op: Op, failure: Failure) -> None:
    """``op`` of ``run`` failed: its ``handler`` undoes what it started, and its outputs become ``failure``."""
    handler.fail(run, op, failure)
    for buffer_id in run.ids(op.writes()):
        try:
            table.put(buffer_id, run.tenant, failure)
        except Exception:  # another tenant's buffer: leave it exactly as it is
            pass


def fail_rest(table: BufferTable, run: Run, failure: Failure) -> None:
    """``run`` (a group's later calls too) will not run: what its ops would still write becomes ``failure``."""
    for part in (run, *run.split()):
        for op in part.own_ops():
            for buffer_id in part.ids(op.writes()):
                try:
                    table.put(buffer_id, part.tenant, failure)
                except Exception:  # another tenant's buffer: leave it exactly as it is
                    pass
