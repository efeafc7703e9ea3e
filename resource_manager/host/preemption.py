"""What a busy machine takes from a host's run: the time its threads waited for a CPU while another process had it.

A run's island time was its wall time, and on a machine that other work keeps busy, part of that wall time
the run's threads were ready but not running (another process held the CPU), or asleep until a thread of the
host that another process preempted let go of the interpreter. Charged as it stands, a tenant pays for the
other process, and the tenant whose computation a long preemption happens to hit falls behind its share. The
kernel counts, per thread, the time it ran and the time it waited in a run queue
(``/proc/self/task/<tid>/schedstat``); the host reads them for the threads that run its computations (the
executor's own and XLA's: compute pools, compiler workers) before and after a run, and charges:

* on a one-host island of CPU devices, where a computation is the CPU work of those threads and nothing else,
  the CPU time they used, at most the wall time: nothing another process or thread did is charged;
* elsewhere (GPUs, or hosts that wait for each other in collectives: a wait the island really spends on the
  run, with no CPU in it), the wall time less what the threads waited in a run queue, never less than the CPU
  time they used.

Garbage collection is left out of both: the interpreter collects on whichever thread allocates past its
threshold, so a collection (tens of milliseconds in a host's heap) is the host's work for everything it
holds, not the work of the tenant whose run or message happened to trigger it (``gc_cpu_s``; admission
leaves it out of what a batch cost too). The host measures; nothing comes from the client, and no run is
charged less than the CPU work it did, collections aside. Where there is no /proc, runs are charged their
wall time.
"""

from __future__ import annotations

import gc
import os
import threading
import time

XLA_THREADS = ("tf_", "llvm-")  # name prefixes of the threads XLA runs computations and compiles on
UNPREEMPTED_S = 2e-4  # a run shorter than this is charged its wall time: no preemption of note fits in it (a time
# slice the kernel gives another process is milliseconds), and reading the threads again would cost a tenth of it
CHECK_S = 1.0  # how often the process's threads are counted (a new one may be XLA's: the meter looks again)
Sample = tuple[int, object, float]  # the set of threads read (it changes when they are looked for again), their
# times summed (CPU nanoseconds, or run and run-queue nanoseconds), and the executor thread's garbage collection time


class Preemption:
    """Reads the executor thread's and XLA's threads' times; made and used on the executor thread. ``cpu_work``: the
    island is one host of CPU devices (its runs are charged their CPU time, read from the threads' CPU clocks, a
    fraction of a microsecond each); elsewhere each thread's run and run-queue times (``schedstat``). Threads are
    counted every ``CHECK_S`` seconds: when an XLA thread came or went, the run that saw it is charged its wall
    time and the meter reads the new set from the next run on."""

    def __init__(self, cpu_work: bool) -> None:
        self.cpu_work = cpu_work
        self._me = threading.get_native_id()
        self._read: list[int] = []  # per thread: its CPU clock (``cpu_work``) or its schedstat's descriptor
        self._tids: list[int] = []  # the threads ``_read`` reads
        self._threads = -1  # the process's threads when XLA's were last looked for
        self._checked = 0.0
        self._generation = 0
        self._stat = _open("/proc/self/stat") if os.path.exists(f"/proc/self/task/{self._me}/schedstat") else None
        install_gc_meter()
        self.uncharged_s = 0.0  # taken off runs' wall time so far
        self.unmeasured = 0  # runs charged their wall time (the threads could not be read, or changed meanwhile)

    def sample(self) -> Sample | None:
        """The threads' CPU nanoseconds (``cpu_work``), or (ran, waited) nanoseconds, so far, summed; None where
        there is nothing to read."""
        if self._stat is None:
            return None
        try:
            if self._threads < 0:
                self._rescan()
            if self.cpu_work:
                return self._generation, sum(map(time.clock_gettime_ns, self._read)), gc_cpu_s()
            times = [_times(os.pread(fd, 96, 0)) for fd in self._read]
            return self._generation, (sum(t[0] for t in times), sum(t[1] for t in times)), gc_cpu_s()
        except OSError:  # a thread ended: look again, and correct nothing this time
            self._threads = -1
            return None

    def charge(self, before: Sample | None, wall: float) -> float:
        """The island time of a run that started at ``before`` and took ``wall`` seconds, by the module's rule."""
        if before is None or wall < UNPREEMPTED_S:
            return wall
        after = self.sample()
        if after is None or after[0] != before[0] or not self._same_threads():
            self.unmeasured += 1
            return wall
        if self.cpu_work:
            charged = min(wall, (after[1] - before[1]) * 1e-9)
        else:
            ran, waited = (after[1][0] - before[1][0]) * 1e-9, (after[1][1] - before[1][1]) * 1e-9
            charged = min(wall, max(wall - waited, ran))
        charged = max(0.0, charged - (after[2] - before[2]))  # collecting garbage is the host's work, not the run's
        self.uncharged_s += wall - charged
        return charged

    def _same_threads(self) -> bool:
        """False if the threads the meter reads are no longer the executor's and XLA's (then it looks again); the
        process's threads are counted every ``CHECK_S`` seconds, and only where their number changed are their
        names read (most threads that come and go are Ray's, which change nothing here)."""
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return True
        self._checked = now
        try:
            count = int(os.pread(self._stat, 1024, 0).rsplit(b")", 1)[1].split(None, 18)[17])
            if count == self._threads:
                return True
            count, measured = self._measured()
            if measured == self._tids:
                self._threads = count
                return True
        except (OSError, ValueError, IndexError):
            pass
        self._threads = -1
        return False

    def _measured(self) -> tuple[int, list[int]]:
        """The process's threads, and those a run's time is read from: the executor's and XLA's."""
        tids = os.listdir("/proc/self/task")
        return len(tids), [int(t) for t in tids if int(t) == self._me or _name(t).startswith(XLA_THREADS)]

    def look_again(self) -> None:
        """Find XLA's threads again before the next run (after a compile: XLA may have started compiler workers)."""
        self._threads = -1

    def _rescan(self) -> None:
        if not self.cpu_work:
            for fd in self._read:
                os.close(fd)
        self._read, self._threads = [], -1
        self._generation += 1
        self._checked = time.monotonic()
        count, self._tids = self._measured()
        for tid in self._tids:
            self._read.append(_cpu_clock(tid) if self.cpu_work else _open(f"/proc/self/task/{tid}/schedstat"))
        if self.cpu_work:
            for clock in self._read:  # a thread that ended meanwhile has no clock: OSError, look again next time
                time.clock_gettime_ns(clock)
        self._threads = count


_gc = threading.local()  # per thread: when the collection now running started (its CPU time), and the total so far


def gc_cpu_s() -> float:
    """CPU seconds the calling thread spent collecting garbage so far (``install_gc_meter`` counts them). A
    collection runs on whichever thread allocates past the interpreter's threshold, so it is the host's work for
    everything it holds, not the work of the tenant whose run or message happened to trigger it: charges leave it
    out."""
    return getattr(_gc, "spent", 0.0)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc.started = time.thread_time()
    else:
        started = getattr(_gc, "started", None)
        if started is not None:
            _gc.spent = getattr(_gc, "spent", 0.0) + time.thread_time() - started
            _gc.started = None


def install_gc_meter() -> None:
    """Count each thread's garbage collection CPU time (``gc_cpu_s``); once per process."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _cpu_clock(tid: int) -> int:
    """The id of thread ``tid``'s CPU-time clock (Linux: CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED, as
    ``pthread_getcpuclockid`` makes it)."""
    return (~tid << 3) | 6


def _open(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _times(line: bytes) -> tuple[int, int]:
    ran, waited, _ = line.split(None, 2)
    return int(ran), int(waited)


def _name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
