"""What a host's executor tells the island's scheduler, gathered over one pass of its loop, and its trace."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pathways.events import EventLog
from pathways.ops import Op
from resource_manager.host.run import Run


@dataclass
class Report:
    """What the executor tells the island's scheduler: fragments done (seq, island seconds, the seconds of those
    spent compiling, the longest one computation of it ran), fragments waiting on another island (they leave the
    window), and parked receives whose data landed here."""

    done: list[list] = field(default_factory=list)
    blocked: list[int] = field(default_factory=list)
    landed: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.blocked or self.landed)


class Recorder:
    """Gathers one pass's ``Report`` and hands it to ``sink`` at the pass's end (if there is anything to say), and
    writes fragments' and ops' spans to ``events`` while tracing is on. Used only on the executor's loop thread,
    so it takes no lock."""

    def __init__(self, events: EventLog, sink: Callable[[Report], None]) -> None:
        self.events = events
        self._sink = sink
        self._report = Report()

    def blocked(self, run: Run) -> None:
        """``run`` waits on another island, so it must not hold the window: say so, once."""
        if not run.reported_blocked:
            run.reported_blocked = True
            self._report.blocked.append(run.seq)

    def flush(self, finished: list[Run], landed: list[tuple[int, int]]) -> None:
        """End of a pass: report the runs ``finished`` in it (a group's once, by its last) and the receives
        ``landed``, and hand the report over."""
        report = self._report
        done = report.done
        for run in finished:
            tally = run.tally
            if tally is None:
                done.append([run.seq, run.busy_s, run.compile_s, run.longest_s])
            elif tally.add(run):  # the last of its group: the group's place in the order is done
                done.append([run.seq, tally.busy_s, tally.compile_s, tally.longest_s])
            if self.events.enabled:
                self.events.span(f"seq {run.seq}: {run.label}", "fragment", run.admitted, time.time(), seq=run.seq,
                                 tenant=run.tenant, program=run.label, ops=len(run.ops),
                                 busy_ms=round(run.busy_s * 1e3, 3))
        report.landed.extend(landed)
        if report:
            self._report = Report()
            self._sink(report)

    def trace_op(self, run: Run, op: Op, facts: dict, wall: float, elapsed: float) -> None:
        """Spans for ``op`` of ``run``: its wait for inputs (if it waited) and its ``elapsed`` seconds from ``wall``."""
        if run.waiting_since is not None:
            waited = time.monotonic() - run.waiting_since
            self.events.span("wait for inputs", "wait", wall - waited, wall, seq=run.seq, op=op.KIND,
                             tenant=run.tenant)
        args = {"seq": run.seq, "fragment": run.fragment, "tenant": run.tenant, "program": run.label, **facts}
        self.events.span(op.label(), op.KIND, wall, wall + elapsed, **args)
