"""Pipeline schedules as data: for each device (slice), the order of its forward, backward and weight work.

A model of S stages runs on p devices, ``v = S / p`` stages each (stage s on device s mod p), over m
micro-batches. ``Work("F", s, i)`` is stage s's forward of micro-batch i, ``"B"`` its backward (with
``split_weights``, only the input gradient) and ``"W"`` its weight gradients.

- ``gpipe``: every forward, then every backward (Huang et al. 2019); holds m micro-batches per device.
- ``1f1b``: device d runs p - d - 1 forwards, then alternates one forward and one backward, then drains the
  backwards (PipeDream-Flush / Megatron-LM); at most p micro-batches in flight.
- ``interleaved``: 1F1B over v model chunks per device, in groups of p micro-batches (Narayanan et al.
  2021); the bubble shrinks by v, m must be a multiple of p.
- ``zb-h1``: 1F1B with the backward split into B and W, each device deferring its first d weight passes
  into the drain, where 1F1B idles (Qi et al. 2023); at most p micro-batches in flight, as 1F1B.

Each schedule's ``bubble`` is its idle fraction in the model those papers use: every stage takes the same
times for F, B and W, and moving activations costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pathways.errors import ProgramError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Work:
    """One unit of a schedule: ``kind`` ("F", "B" or "W") of model stage ``stage`` on micro-batch ``micro``."""

    kind: str
    stage: int
    micro: int


@dataclass(frozen=True)
class Schedule:
    """A schedule's order of work on each of ``n_devices`` devices."""

    name: str
    n_devices: int
    chunks: int  # v: model stages per device
    n_micro: int
    order: tuple[tuple[Work, ...], ...]

    @property
    def n_stages(self) -> int:
        """Model stages: devices x chunks."""
        return self.n_devices * self.chunks

    @property
    def split_weights(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradients)."""
        return any(w.kind == "W" for seq in self.order for w in seq)

    def device_of(self, stage: int) -> int:
        """The device a model stage runs on (chunks go round-robin: stage s on device s mod p)."""
        return stage % self.n_devices

    def in_flight(self, device: int) -> int:
        """The most (stage, micro-batch) pairs whose forward ran on ``device`` and whose last backward
        pass (W where the backward is split, else B) has not: the activations the device holds at most."""
        last = "W" if self.split_weights else "B"
        live, peak = 0, 0
        for w in self.order[device]:
            live += (w.kind == "F") - (w.kind == last)
            peak = max(peak, live)
        return peak

    def bubble(self, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
        """The schedule's idle fraction per device, for forward, backward (input gradient) and weight
        gradient times ``t_f``, ``t_b``, ``t_w`` alike on every stage (only ``zb-h1`` depends on them)."""
        return bubble(self.name, self.n_devices, self.n_micro, self.chunks, t_f, t_b, t_w)


def bubble(name: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """The idle fraction of schedule ``name`` on p devices, m micro-batches, v chunks per device.

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved: (p-1)/(vm+p-1), its bubble cut by v. ZB-H1: an idle time of
    (p-1)(t_f+t_b-t_w) against m(t_f+t_b+t_w) of work, against 1F1B's (p-1)(t_f+t_b+t_w): a third of it when
    the three times are equal (for m >= p; with fewer micro-batches there is too little W to fill the drain).
    The paper's (p-1)(t_f+t_b-t_w) holds while W takes no longer than F and B; a longer W cannot shorten the
    fill and the drain below one F or B per device, so the idle time is (p-1)max(t_f+t_b-t_w, t_f, t_b).
    """
    check(name, p, m, v)
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    idle = (p - 1) * max(t_f + t_b - t_w, t_f, t_b)
    return idle / (m * (t_f + t_b + t_w) + idle)


def check(name: str, p: int, m: int, v: int) -> None:
    """ProgramError unless ``name`` is a known schedule that can run p devices, m micro-batches, v chunks."""
    if name not in SCHEDULES:
        raise ProgramError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for what, value in (("devices", p), ("n_micro", m), ("chunks", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProgramError(f"pipeline {what} must be a positive int, got {value!r}")
    if name == "interleaved":
        if v < 2:
            raise ProgramError(f"the interleaved schedule runs at least 2 stages (chunks) per slice, got {v}: mark "
                               f"{2 * p} or more stages for {p} slices, or use schedule='1f1b'")
        if m % p:
            raise ProgramError(f"the interleaved schedule takes micro-batches in groups of one per slice: n_micro "
                               f"({m}) must be a multiple of the number of slices ({p})")
    elif v != 1:
        raise ProgramError(f"schedule {name!r} runs one stage per slice, but the step marks {p * v} stages for "
                           f"{p} slices; use schedule='interleaved', or mark {p} stages")


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Schedule ``name`` for p devices, m micro-batches and v stages per device."""
    check(name, p, m, v)
    build: Callable[[int, int, int, int], list[Work]] = {
        "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1}[name]
    return Schedule(name, p, v, m, tuple(tuple(build(d, p, m, v)) for d in range(p)))


def _gpipe(d: int, p: int, m: int, v: int) -> list[Work]:
    return [Work("F", d, i) for i in range(m)] + [Work("B", d, i) for i in range(m)]


def _one_f_one_b(d: int, p: int, m: int, v: int) -> list[Work]:
    warm = min(p - d - 1, m)
    seq = [Work("F", d, i) for i in range(warm)]
    for k in range(m - warm):
        seq += [Work("F", d, warm + k), Work("B", d, k)]
    return seq + [Work("B", d, i) for i in range(m - warm, m)]


def _interleaved(d: int, p: int, m: int, v: int) -> list[Work]:
    total = m * v

    def unit(kind: str, k: int) -> Work:
        group, within = divmod(k, p * v)
        chunk = within // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Work(kind, chunk * p + d, group * p + within % p)

    warm = total if m == p else min((p - d - 1) * 2 + (v - 1) * p, total)
    seq = [unit("F", k) for k in range(warm)]
    for k in range(total - warm):
        seq += [unit("F", warm + k), unit("B", k)]
    return seq + [unit("B", k) for k in range(total - warm, total)]


def _zb_h1(d: int, p: int, m: int, v: int) -> list[Work]:
    f = b = w = 0
    seq: list[Work] = []

    def run(kind: str, i: int) -> int:
        seq.append(Work(kind, d, i))
        return i + 1

    for _ in range(min(p - d - 1, m)):  # warm-up, as 1F1B
        f = run("F", f)
    for _ in range(d):  # one forward, one input gradient; the weight gradient waits for the drain
        if f < m:
            f, b = run("F", f), run("B", b)
    while f < m:  # steady state: F, B and W of the oldest deferred micro-batch
        f, b, w = run("F", f), run("B", b), run("W", w)
    while b < m:
        b, w = run("B", b), run("W", w)
    while w < m:  # the deferred weight gradients fill the drain
        w = run("W", w)
    return seq
