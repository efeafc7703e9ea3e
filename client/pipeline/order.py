"""The order a pipelined step's program calls its tasks in, and the activations each slice holds meanwhile.

Lowering gives each island its projection of the program's order, and an island runs one step's ops
strictly in that order, so the order *is* the schedule on every island. ``emission`` list-schedules the
devices' work on a cost model: each device keeps its schedule's order, a piece of work starts once the
work it reads has finished, and devices sharing an island take turns. ``replay`` walks the lowered
fragments (a value is freed right after its last use on its island) to find the most micro-batches, and
bytes of them, each slice holds at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from client.pipeline.schedules import Schedule, Work
from pathways.errors import ProgramError


@dataclass(frozen=True)
class Timed:
    """A piece of work on a lane (one device of one pipeline replica), with its start and finish on the
    cost model."""

    work: Work
    lane: int
    start: float
    finish: float


Deps = Callable[[int, Work], Sequence[tuple[int, Work]]]


def emission(name: str, order: Sequence[Sequence[Work]], deps: Deps, island_of: Sequence[int],
             cost: Callable[[Work], float]) -> list[Timed]:
    """The lanes' work in the order to emit it: by simulated start time, lanes on one island taking turns.

    ``order[l]`` is lane l's work in its schedule's order, ``deps(l, w)`` the (lane, work) pairs whose
    outputs ``w`` on lane l reads, ``island_of[l]`` lane l's island, ``cost(w)`` its duration. Raises
    ProgramError if the order contradicts the data (the schedule would deadlock).
    """
    finish: dict[tuple[int, Work], float] = {}
    clock: dict[int, float] = defaultdict(float)
    pc = [0] * len(order)
    out: list[Timed] = []
    total = sum(map(len, order))
    while len(out) < total:
        best: tuple | None = None
        for lane, seq in enumerate(order):
            if pc[lane] == len(seq):
                continue
            w = seq[pc[lane]]
            before = deps(lane, w)
            if any(b not in finish for b in before):
                continue
            t = max([clock[island_of[lane]]] + [finish[b] for b in before])
            if best is None or (t, lane) < best[:2]:
                best = (t, lane, w)
        if best is None:
            waiting = {lane: seq[pc[lane]] for lane, seq in enumerate(order) if pc[lane] < len(seq)}
            raise ProgramError(f"pipeline schedule {name!r} deadlocks: each device's next work waits for work "
                               f"another device runs later ({waiting}); the step's data flow does not fit it")
        t, lane, w = best
        end = t + cost(w)
        finish[(lane, w)] = end
        clock[island_of[lane]] = end
        pc[lane] += 1
        out.append(Timed(w, lane, t, end))
    out.sort(key=lambda x: (x.start, x.lane))
    return out


def chain_deps(schedule: Schedule) -> Deps:
    """The dependencies of a plain stack of stages on one lane per device: a forward reads the previous stage's
    forward, a backward the next stage's backward (the last stage's reads its own forward), W reads its B."""
    n, lane = schedule.n_stages, schedule.device_of

    def deps(_: int, w: Work) -> list[tuple[int, Work]]:
        if w.kind == "F":
            return [(lane(w.stage - 1), Work("F", w.stage - 1, w.micro))] if w.stage else []
        if w.kind == "W":
            return [(lane(w.stage), Work("B", w.stage, w.micro))]
        after = Work("B", w.stage + 1, w.micro) if w.stage + 1 < n else Work("F", w.stage, w.micro)
        return [(lane(after.stage), after), (lane(w.stage), Work("F", w.stage, w.micro))]

    return deps


@dataclass(frozen=True)
class SliceMemory:
    """The most per-micro-batch state one slice held during a step, from its lowered fragment."""

    device: int
    slice: str
    island: int
    peak_micro_batches: int  # most (stage, micro-batch) pairs with a live buffer at once
    peak_buffers: int
    peak_bytes: int


def replay(graph: Any, lowered: Any, tags: dict[int, tuple[int, int]], device_of: dict[str, int]) -> list[SliceMemory]:
    """Replay each island's ops: writes add a buffer, frees drop it; track the buffers tagged with a
    (stage, micro-batch) on each device's slice (``device_of`` maps a slice key to its device)."""
    value = {v.slot: v for v in graph.values}
    peaks: dict[int, list[int]] = {d: [0, 0, 0] for d in device_of.values()}
    names = {d: k for k, d in device_of.items()}
    islands: dict[int, int] = {}
    for fragment in lowered.fragments.values():
        live: dict[int, Any] = {}
        for op in fragment.ops:
            for slot in op.writes():
                v = value[slot]
                if slot in tags and v.slice.key in device_of:
                    live[slot] = v
                    islands[device_of[v.slice.key]] = v.slice.island
            by_device: dict[int, list[int]] = defaultdict(list)
            for slot, v in live.items():
                by_device[device_of[v.slice.key]].append(slot)
            for d, slots in by_device.items():
                pairs = len({tags[s] for s in slots})
                nbytes = sum(live[s].nbytes for s in slots)
                p = peaks[d]
                peaks[d] = [max(p[0], pairs), max(p[1], len(slots)), max(p[2], nbytes)]
            for slot in op.frees:
                live.pop(slot, None)
    return [SliceMemory(d, names[d], islands.get(d, -1), *peaks[d]) for d in sorted(peaks)]
