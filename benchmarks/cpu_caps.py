"""Devices of a fixed speed on a machine with fewer cores than devices: each island host capped at a share.

A pipeline's bubble formula assumes every stage has a device of its own that computes at one speed. When p
island hosts share fewer than p cores, a host computes faster while the others wait and slower while they all
work, so the timeline of a step is not that of p devices. Capping every host's process at the same share of
the cores with the Linux cgroup CPU controller (``cpu.cfs_quota_us`` in cgroup v1, ``cpu.max`` in v2) makes
each a device of fixed speed: it never gets more than its share, and as long as the shares add up to less
than the cores, never less. It needs root and a writable cgroup CPU controller; ``Caps.start`` says why not
otherwise. Every group is removed (and its process moved back) on ``release``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import proc_stat

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 2500  # short, so a capped host that used its share waits little; its share must be 1 ms or more


def host_pids() -> list[int]:
    """The island hosts (Ray workers titled ``ray::Host``) among this process's descendants."""
    stats: dict[int, tuple[int, bytes]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = proc_stat(int(d.name))
            if fields is not None:
                stats[int(d.name)] = (int(fields[1]), (d / "cmdline").read_bytes())
        except OSError:  # exited meanwhile
            continue
    mine, frontier = set(), [os.getpid()]
    while frontier:
        pid = frontier.pop()
        mine.add(pid)
        frontier += [p for p, (parent, _) in stats.items() if parent == pid and p not in mine]
    return sorted(p for p in mine if stats[p][1].startswith(b"ray::Host"))


def cpu_ticks(pid: int) -> int:
    fields = proc_stat(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])


def hosts_by_island(islands: list[int], busy: Callable[[int], None]) -> dict[int, int]:
    """Which host process serves each island: the one whose CPU time grows while ``busy(island)`` computes
    on that island alone."""
    pids = host_pids()
    out: dict[int, int] = {}
    for island in islands:
        before = {p: cpu_ticks(p) for p in pids}
        busy(island)
        grew = {p: cpu_ticks(p) - before[p] for p in pids if p not in out.values()}
        out[island] = max(grew, key=grew.get)
    return out


class Caps:
    """CPU caps on processes, one cgroup each; ``release`` undoes them all."""

    def __init__(self, root: Path, v2: bool) -> None:
        self.root, self.v2 = root, v2
        self.groups: dict[int, Path] = {}

    @classmethod
    def start(cls) -> tuple[Caps | None, str]:
        """A Caps on this machine's CPU controller, or None and the reason it cannot cap."""
        if os.geteuid() != 0:
            return None, "capping hosts needs root"
        if (V1 / "cpu.cfs_quota_us").exists() and os.access(V1, os.W_OK):
            return cls(V1, False), "cgroup v1"
        if "cpu" in (V2 / "cgroup.controllers").read_text().split() if (V2 / "cgroup.controllers").exists() else []:
            try:
                (V2 / "cgroup.subtree_control").write_text("+cpu")
                return cls(V2, True), "cgroup v2"
            except OSError as exc:
                return None, f"cannot enable the cgroup v2 CPU controller: {exc}"
        return None, "no writable cgroup CPU controller"

    def cap(self, pid: int, cores: float) -> None:
        """Hold process ``pid`` (all its threads) to ``cores`` CPUs."""
        group = self.groups.get(pid)
        if group is None:
            group = self.root / f"pathways-bench-{os.getpid()}-{pid}"
            group.mkdir(exist_ok=True)
            self.groups[pid] = group
        period = max(PERIOD_US, int(1000 / cores) + 1)
        quota = int(cores * period)
        if self.v2:
            (group / "cpu.max").write_text(f"{quota} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))

    def release(self) -> None:
        """Move every capped process back to the root group and remove the groups."""
        for pid, group in self.groups.items():
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:  # the process has exited
                pass
            for _ in range(50):  # a group empties once its last task has moved
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        self.groups = {}
