"""The runs of a multi-host island parked off the order, and which parked run will write what.

A run that reaches a receive on a multi-host island parks there, on every host alike, until the island's
scheduler gives the rest of it a new place in the order (a resume); a later run that needs a value a parked one
will write parks behind it and comes back right after it. A host that reaches that later run only after the
resume came (a busy host lags) must still run it behind the resumed one, as the others do, so what a resumed run
will write stays known until it finishes. The executor holds its lock around every use of this part: it keeps no
lock of its own.
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
        self._future: dict[int, int] = {}  # buffer id -> seq of the parked (or resumed) run that will write it
        self._writes: dict[int, list[int]] = {}  # that seq -> the buffer ids it stands for in ``_future``
        self._returned: dict[int, list[Run]] = {}  # a resumed run's seq -> it and the runs behind it, until it ends

    def park(self, run: Run) -> None:
        """``run`` waits at a receive, off the order: what it will still write comes from it."""
        run.parked = True
        self.parked[run.seq] = run
        writes = self._writes.setdefault(run.seq, [])
        for buffer_id in run.remaining_writes():
            self._future[buffer_id] = run.seq
            writes.append(buffer_id)

    def producer(self, reads: list[int], present: Container[int]) -> int | None:
        """The seq of the parked or resumed (unfinished) run that will write one of ``reads`` not ``present`` yet,
        or None."""
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
        self._will_write(producer, run)

    def join(self, producer: int, run: Run) -> None:
        """``run`` was moved right behind resumed run ``producer`` and the runs that came back with it (a host that
        reached it after the resume): it belongs to them now, as if it had parked behind ``producer``."""
        self._returned[producer].append(run)
        self._will_write(producer, run)

    def _will_write(self, producer: int, run: Run) -> None:
        """What ``run`` will write, a reader finds behind ``producer``."""
        writes = self._writes.setdefault(producer, [])
        for written in run.remaining_writes():
            if written not in self._future:
                self._future[written] = producer
                writes.append(written)

    def is_parked(self, seq: int) -> bool:
        """Whether run ``seq`` is parked at a receive (not resumed yet)."""
        return seq in self.parked

    def returned(self, seq: int) -> list[Run]:
        """Resumed run ``seq`` and the runs behind it, in their order (empty once it finished)."""
        return self._returned.get(seq, [])

    def finished(self, seq: int) -> None:
        """Run ``seq`` finished: what it (and the runs that came back behind it) would write is written or failed."""
        self._returned.pop(seq, None)
        for buffer_id in self._writes.pop(seq, ()):
            if self._future.get(buffer_id) == seq:
                del self._future[buffer_id]

    @property
    def expecting(self) -> bool:
        """Whether any parked or resumed run's writes are still to come."""
        return bool(self._writes or self._returned)

    def resume(self, seq: int, pc: int) -> list[Run] | None:
        """Unpark run ``seq`` parked at op ``pc`` and the runs behind it, in that order; None (and the run is
        dropped) if it is not parked there."""
        run = self.parked.pop(seq, None)
        if run is None or run.pc != pc:
            return None
        run.parked, run.resumed_at = False, pc
        waiting = self._behind.pop(seq, [])
        for behind in waiting:
            behind.parked = False
        self._returned[seq] = [run, *waiting]
        return [run, *waiting]

    def count(self) -> int:
        """Runs parked here, at a receive or behind one."""
        return len(self.parked) + sum(len(rs) for rs in self._behind.values())

    def take_all(self) -> list[Run]:
        """Every parked run, none parked from now on (the host died; what they would have written, they fail)."""
        pending = list(self.parked.values()) + [r for rs in self._behind.values() for r in rs]
        self.parked, self._behind, self._future, self._writes, self._returned = {}, {}, {}, {}, {}
        return pending
