"""The bubble of a pipelined step measured from the hosts' timelines (a ``pw.trace`` file).

Each host records a span per computation it runs, naming the slice it ran on, and per send and receive. For
each step and each device of the pipeline (one slice of one replica), the device computes during its
stages' forward, backward and weight-gradient spans (the hosts of a slice that spans several run each
computation at once: their spans overlap and count once), and moves activations during its island's
sends and receives of the step. The step's window runs from the first computation on any device to the
last one. The bubble is the fraction of the window a device neither computes nor moves data (it waits),
averaged over the devices: what the schedules' formulas predict for devices that work at a fixed speed and
move activations for free. The time spent moving is reported next to it. Where several devices share an
island, its sends and receives cannot be told apart and count as waiting.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("F", "B", "W")
MOVES = ("send", "recv")


@dataclass(frozen=True)
class Lane:
    """One device of one pipeline replica: its island (a process of the trace), its slice and its stages."""

    island: int
    slice: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class MeasuredBubble:
    """What the timelines say, as medians over the traced steps."""

    bubble: float  # fraction of the step window a device waits (neither computes nor moves data), mean over devices
    per_device: tuple[float, ...]
    moving: float  # fraction of the step window a device spends in its island's sends and receives, mean
    window_s: float  # from the first forward to the last backward of a step
    times_s: dict[str, float]  # median duration of one F, B and W span (absent kinds left out)
    steps: int
    stage_times_s: dict[str, float]  # median duration per computation, by name ("stage2.W")


def measure(trace: str | os.PathLike | dict, lanes: Sequence[Lane]) -> MeasuredBubble:
    """The bubble of every step in ``trace`` (a ``pw.trace`` file or its loaded JSON) for these devices.

    Spans are matched by name (``stage3.B``) and slice, so replicas whose slices share an island keep their
    own lanes; a step is one fragment per island (a long one runs in parts, each part's spans naming the
    fragment), the k-th traced step being each island's k-th fragment among the pipeline's spans.
    """
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    lane_of: dict[tuple[str, str], int] = {}
    for k, lane in enumerate(lanes):
        for s in lane.stages:
            for kind in KINDS:
                lane_of[(lane.slice, f"stage{s}.{kind}")] = k
    per_island = Counter(lane.island for lane in lanes)
    alone = {lane.island: k for k, lane in enumerate(lanes) if per_island[lane.island] == 1}
    # (island, fragment) -> (start, duration, name, lane); and the island's sends and receives
    spans: dict[tuple[int, int], list[tuple[float, float, str, int]]] = defaultdict(list)
    moves: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("exec", *MOVES):
            continue
        args, island = e.get("args", {}), e.get("pid", 0) - 100
        where = (island, args.get("fragment", -1))
        if e["cat"] in MOVES:
            moves[where].append((e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
            continue
        lane = lane_of.get((args.get("slice"), e.get("name")))
        if lane is not None:
            spans[where].append((e["ts"] * 1e-6, e["dur"] * 1e-6, e["name"], lane))
    by_island: dict[int, list[int]] = defaultdict(list)
    for island, fragment in sorted(spans):
        by_island[island].append(fragment)
    n_steps = min((len(v) for v in by_island.values()), default=0)
    if not n_steps or set(by_island) != {lane.island for lane in lanes}:
        raise ValueError("the trace holds no complete step of this pipeline: trace whole steps, and wait for "
                         "them to finish inside the pw.trace block")
    bubbles, moving, windows, per_device = [], [], [], []
    durations: dict[str, list[float]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for step in range(n_steps):
        computing: list[list[tuple[float, float]]] = [[] for _ in lanes]
        moved: list[list[tuple[float, float]]] = [[] for _ in lanes]
        for island, fragments in by_island.items():
            for start, dur, name, lane in spans[(island, fragments[step])]:
                computing[lane].append((start, start + dur))
                durations[name.rsplit(".", 1)[1]].append(dur)
                by_name[name].append(dur)
            if island in alone:
                moved[alone[island]] += moves[(island, fragments[step])]
        first = min(a for lane in computing for a, _ in lane)
        last = max(b for lane in computing for _, b in lane)
        window = last - first
        moved = [[(max(a, first), min(b, last)) for a, b in lane if b > first and a < last] for lane in moved]
        busy = [covered(c + m) for c, m in zip(computing, moved)]
        idle = [1.0 - b / window for b in busy]
        per_device.append(idle)
        bubbles.append(sum(idle) / len(idle))
        moving.append(sum((b - covered(c)) / window for b, c in zip(busy, computing)) / len(lanes))
        windows.append(window)
    return MeasuredBubble(statistics.median(bubbles),
                          tuple(statistics.median(d[k] for d in per_device) for k in range(len(lanes))),
                          statistics.median(moving), statistics.median(windows),
                          {k: statistics.median(v) for k, v in durations.items()}, n_steps,
                          {k: statistics.median(v) for k, v in by_name.items()})


def covered(intervals: list[tuple[float, float]]) -> float:
    """The time the union of ``intervals`` covers."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def lanes_of(replicas: Sequence[Sequence[Any]], n_stages: int) -> list[Lane]:
    """The lanes of a pipeline: per replica, per slice, its island, its key and the stages it runs (s mod p)."""
    out = []
    for slices in replicas:
        p = len(slices)
        out += [Lane(s.island, s.key, tuple(range(d, n_stages, p))) for d, s in enumerate(slices)]
    return out
