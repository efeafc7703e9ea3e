"""One admitted fragment (or put) on a host: its ops, the ids its slots stand for, and where it stands."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from pathways.ops import Aval, Op, SliceDesc, Template, WireSpec


@dataclass(frozen=True)
class Place(Op):
    """The op a put message becomes: land the value the client uploaded to this host (``uploads``) as slot 0
    (id ``base``)."""

    KIND: ClassVar[str] = "put"
    slice: SliceDesc
    spec: WireSpec
    aval: Aval
    frees: tuple[int, ...] = ()

    def writes(self) -> tuple[int, ...]:
        """The put lands its value in slot 0."""
        return (0,)


@dataclass(eq=False, slots=True)
class Tally:
    """The runs of one group (the scheduler's ``Group``: one place in the order) not finished yet, and what the
    finished ones took: their completion is reported once, as the group's. A group runs as one run until a call
    of it must wait for an input; then its later calls become runs of their own, and the tally counts them."""

    left: int
    busy_s: float = 0.0
    compile_s: float = 0.0
    longest_s: float = 0.0

    def add(self, run: Run) -> bool:
        """Count ``run`` finished; True once every run of the group has."""
        self.left -= 1
        self.busy_s += run.busy_s
        self.compile_s += run.compile_s
        self.longest_s = max(self.longest_s, run.longest_s)
        return self.left == 0


@dataclass(eq=False, slots=True)  # one per call: slots keep making it cheap
class Run:
    """An admitted message's ops, in order; ``pc`` is the next one and ``end`` the one it stops before (a part of
    a long fragment runs ``ops[pc:end]``; -1: all of them). Client-minted ids resolve lazily."""

    seq: int
    tenant: str
    client: int
    label: str
    ops: tuple[Op, ...]
    template: Template | None = None
    n_inputs: int = 0
    base: int = 0
    inputs: tuple[int, ...] = ()
    pc: int = 0
    waiting_since: float | None = None
    busy_s: float = 0.0
    compile_s: float = 0.0  # the part of busy_s spent compiling executables
    longest_s: float = 0.0  # the longest one computation of it ran here, compiling aside
    admitted: float = field(default_factory=time.time)
    reported_blocked: bool = False
    parked: bool = False
    resumed_at: int = -1  # the recv op this run was resumed at (multi-host islands): its data will not wait
    end: int = -1
    fragment: int = -1  # the place its fragment was first released in (its first part's seq); -1: ``seq``
    tally: Tally | None = None  # its group's, when it shares its place in the order with other calls
    touched: list[int] | None = None  # a one-op run's ``touches``, worked out once at admission
    # A group's calls after the current one, last first: (base, inputs, touched), their uses counted at admission.
    # The run takes each in turn (``next_call``), so a group of calls costs the executor one run.
    more: list[tuple[int, tuple[int, ...], list[int] | None]] | None = None
    calls: int = 1  # the calls this run stands for (a group's, until its later calls are split off)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = len(self.ops)
        if self.fragment < 0:
            self.fragment = self.seq

    def part(self, seq: int, lo: int, hi: int) -> Run:
        """Ops ``lo`` to ``hi - 1`` of this run's fragment as a run of its own (the same ids), in place ``seq``."""
        return Run(seq, self.tenant, self.client, self.label, self.ops, self.template, self.n_inputs, self.base,
                   self.inputs, pc=lo, end=hi, fragment=self.fragment)

    def call_touches(self, base: int, inputs: tuple[int, ...]) -> list[int]:
        """The ids a call of this run's template with ``base`` and ``inputs`` reads or writes, all its ops together."""
        n = self.n_inputs
        return [inputs[s] if s < n else base + s for s in self.template.touched]

    def next_call(self) -> None:
        """Take the group's next call (its ops from the start, with its own ids); the caller knows there is one."""
        self.base, self.inputs, self.touched = self.more.pop()
        self.pc = 0

    def split(self) -> list[Run]:
        """The group's later calls as runs of their own, in order, this run and they sharing one ``Tally``: a call
        that waits for an input must not hold back the calls behind it."""
        more, self.more = self.more or [], None
        rest = [Run(self.seq, self.tenant, self.client, self.label, self.ops, self.template, self.n_inputs, base,
                    inputs, fragment=self.fragment, touched=touched) for base, inputs, touched in reversed(more)]
        self.calls -= len(rest)
        if rest:
            self.tally = Tally(1 + len(rest))
            for run in rest:
                run.tally = self.tally
        return rest

    def own_ops(self) -> tuple[Op, ...]:
        """The ops this run still has to run (from ``pc`` to ``end``)."""
        return self.ops[self.pc:self.end]

    def rid(self, slot: int) -> int:
        """The buffer id slot ``slot`` stands for in this run."""
        return self.inputs[slot] if slot < self.n_inputs else self.base + slot

    def ids(self, slots: tuple[int, ...]) -> list[int]:
        """The buffer ids ``slots`` stand for in this run."""
        n, base, inputs = self.n_inputs, self.base, self.inputs
        if len(slots) == 1:  # an op's one output, or one input: no comprehension
            s = slots[0]
            return [inputs[s] if s < n else base + s]
        return [inputs[s] if s < n else base + s for s in slots]

    def touches(self, op: Op) -> list[int]:
        """Ids the op reads or writes: a free arriving meanwhile must wait until the op is done."""
        return self.ids(op.touches())

    def remaining_writes(self) -> list[int]:
        """Ids this run will still write (from ``pc`` to ``end``)."""
        return [i for op in self.own_ops() for i in self.ids(op.writes())]
