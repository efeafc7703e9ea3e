"""The runs of a multi-host island parked off the order, and which parked run will write what.

A run that reaches a receive on a multi-host island parks there, on every host alike, until the island's
scheduler gives the rest of it a new place in the order (a resume); a later run that needs a value a parked one
will write parks behind it and comes back right after it. The executor holds its lock around every use of this
part: it keeps no lock of its own.
"""

from __future__ import annotations

from collections.abc import Container

from resource_manager.host.run import Run


class Parking:
    """Parked runs by seq, the runs parked behind each, and the parked run that will write each buffer id. Used
    only under the executor's lock."""

    def __init__(self) -> None:
        self.parked: dict[int, Run] = {}
        self._behind: dict[int, list[Run]] = {}  # parked run's seq -> runs waiting for its outputs
        self._future: dict[int, int] = {}  # buffer id -> seq of the parked run that will write it

    def park(self, run: Run) -> None:
        """``run`` waits at a receive, off the order: what it will still write comes from it."""
        run.parked = True
        self.parked[run.seq] = run
        for buffer_id in run.remaining_writes():
            self._future[buffer_id] = run.seq

    def producer(self, reads: list[int], present: Container[int]) -> int | None:
        """The seq of the parked run that will write one of ``reads`` not ``present`` yet, or None."""
        for buffer_id in reads:
            producer = self._future.get(buffer_id)
            if producer is not None and buffer_id not in present:
                return producer
        return None

    def park_behind(self, run: Run, producer: int) -> None:
        """``run`` waits for parked run ``producer``'s outputs and comes back right after it; what ``run`` will
        write, a reader finds behind ``producer`` too."""
        run.parked = True
        self._behind.setdefault(producer, []).append(run)
        for written in run.remaining_writes():
            self._future.setdefault(written, producer)

    def resume(self, seq: int, pc: int) -> list[Run] | None:
        """Unpark run ``seq`` parked at op ``pc`` and the runs behind it, in that order; None (and the run is
        dropped) if it is not parked there."""
        run = self.parked.pop(seq, None)
        if run is None or run.pc != pc:
            return None
        for buffer_id in [i for i, s in self._future.items() if s == seq]:
            del self._future[buffer_id]
        run.parked, run.resumed_at = False, pc
        waiting = self._behind.pop(seq, [])
        for behind in waiting:
            behind.parked = False
        return [run, *waiting]

    def count(self) -> int:
        """Runs parked here, at a receive or behind one."""
        return len(self.parked) + sum(len(rs) for rs in self._behind.values())

    def take_all(self) -> list[Run]:
        """Every parked run, none parked from now on (the host died; what they would have written, they fail)."""
        pending = list(self.parked.values()) + [r for rs in self._behind.values() for r in rs]
        self.parked, self._behind = {}, {}
        return pending
