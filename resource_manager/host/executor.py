"""Runs admitted fragments on one host: dataflow within a host, the scheduler's order across hosts.

Fragments are admitted strictly in the island scheduler's sequence order. On
a single-host island any op whose inputs are ready may run (a fragment
waiting for a transfer does not block the next client's work). On a
multi-host island only the oldest fragment advances, so every host launches
the island's collectives in the same order (gang scheduling), with one
exception that keeps two islands from waiting on each other: a fragment that
reaches a receive *parks* there, off the order, on every host alike. Each host
reports when its pieces of that receive have landed; once all have, the
scheduler gives the rest of the fragment a new place in the order (a resume),
the same on every host. A later fragment that needs a value a parked one will
produce parks behind it and comes back right after it.

A long fragment arrives in parts (the scheduler decides where it is cut): each
part is a run of its own with a place of its own in the order, over the same
ids, so other tenants' runs go between the parts on every host alike, and a
part that needs what an earlier one has yet to write waits for it by dataflow
(or parks behind it) like any later fragment.

Completion, blocking and landing flow out as reports to the ``report`` sink
(the island's order, ``order.IslandOrder``, which hands them to its scheduler); the executor never calls
the layers above it. If its thread dies, every pending and future wait fails
with the reason, and the host says so to its health checks.

Its parts: ``parking`` (the parked runs), ``reports`` (what a pass reports, and its trace), ``group_calls`` (a
group's calls back to back), ``run_failures`` (where a failed op's failure goes), ``waits`` (deadlines and
what a stuck client is told).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pathways.errors import to_wire
from pathways.events import EventLog
from pathways.ops import Op
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.group_calls import run_calls
from resource_manager.host.handlers import Failed, Handlers
from resource_manager.host.parking import Parking
from resource_manager.host.preemption import Preemption
from resource_manager.host.receive import Receiver
from resource_manager.host.reports import Recorder, Report
from resource_manager.host.run import Run
from resource_manager.host.run_failures import fail_op, fail_rest
from resource_manager.host.waits import next_deadline, stalled

log = logging.getLogger(__name__)


class Executor:
    """The loop of one host: runs admitted fragments' ops as their inputs arrive, in the island's order.

    ``admit`` and ``resume`` are called in sequence order (by the inbox). The executor owns its lock and
    never calls another part while it holds it; the parts below it say that something changed through
    ``touch``. The loop runs on its own thread: each pass advances every runnable run (on a multi-host
    island, ``strict``, only the oldest), runs each op through ``handlers``, frees what an op's ``frees``
    name once it is done, fails an op whose inputs do not arrive within ``op_timeout``, and hands what
    finished, blocked or landed to the ``report`` sink. A failed op writes its failure to its outputs; the
    run and the island go on.
    """

    def __init__(self, island: int, host: int, strict: bool, handlers: Handlers, receiver: Receiver,
                 table: BufferTable, op_timeout: float, events: EventLog, report: Callable[[Report], None]) -> None:
        self.island, self.host, self.strict = island, host, strict
        self.handlers, self.receiver, self.table = handlers, receiver, table
        self._lock = threading.Lock()  # taken directly where nothing waits: a Condition's own enter costs more
        self._cond = threading.Condition(self._lock)
        self.op_timeout = op_timeout
        self.events = events
        self._record = Recorder(events, report)  # the loop's thread only
        self.runs: list[Run] = []
        self._parking = Parking()  # under ``_lock``
        self.version = 0
        self._sleeping = False  # the loop waits on ``_cond``: what changes must notify it
        self.passes = 0  # passes of the loop begun, under ``_lock``
        self._settling = 0  # threads waiting in ``settle`` for the pass in progress to end, under ``_lock``
        self.completed = 0
        self.ops_run = 0
        self.busy_s = 0.0
        self.preemption: Preemption | None = None  # made on the loop's thread, whose times it reads
        self.dead: str | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name=f"executor-{island}.{host}", daemon=True)
        self._thread.start()

    # -- admission (in sequence order) --------------------------------------------------------------------
    def count_uses(self, run: Run) -> list[int] | None:
        """Count the uses of what ``run``'s ops read and write and announce its receives; returns a one-op run's
        touched ids (kept on the run: its op's end uses them again), None for a longer one."""
        if run.end - run.pc == 1 and not run.ops[run.pc].RECEIVES:  # the common case: one computation
            touched = run.touched = run.touches(run.ops[run.pc])
            self.table.add_uses(touched)
            return touched
        touched = []
        for op in run.own_ops():
            touched += run.touches(op)
            if op.RECEIVES:
                self.handlers.by_op[type(op)].announce(run, op)
        self.table.add_uses(touched)
        return None

    def admit(self, run: Run, counted: bool = False) -> None:
        """Take the next run in sequence order: count its uses (unless ``counted``: a group's, call by call), announce
        its receives, and queue it (or fail it at once if the host is dead)."""
        if not counted:
            self.count_uses(run)
        with self._lock:
            dead = self.dead
            if dead is None:
                self.runs.append(run)
                self.version += 1
                if self._sleeping:
                    self._cond.notify()
        if dead is not None:
            fail_rest(self.table, run, Failure("IslandFailedError", dead))

    def resume(self, seq: int, pc: int) -> None:
        """The rest of a parked run takes this place in the order (every host of the island alike)."""
        with self._lock:
            resumed = self._parking.resume(seq, pc)
            if resumed is None:
                log.error("island %d host %d: resume of fragment %d at op %d, which is not parked there", self.island,
                          self.host, seq, pc)
                return
            self.runs += resumed
            self._wake()

    def touch(self) -> None:
        """Something changed (a buffer, a landing, an upload): wake the loop."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        self.version += 1
        self._cond.notify_all()

    def stop(self) -> None:
        """Stop the loop and the handlers' sender threads."""
        with self._lock:
            self._stopped = True
            self._wake()
        self.handlers.stop()

    def settle(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until the loop has ended the pass it is in (if any): what that pass
        finished is then reported and in the trace. An output can be seen ready before the pass that computed it
        ends, so a trace stopped after it would otherwise miss its fragment. False if the pass went on longer."""
        deadline = time.monotonic() + timeout
        with self._lock:
            begun = self.passes
            while not (self._sleeping or self._stopped or self.dead or self.passes != begun):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settling += 1
                self._cond.wait(left)
                self._settling -= 1
        return True

    def busy(self) -> int:
        """Runs admitted here and not finished (parked ones included)."""
        with self._lock:
            return len(self.runs) + self._parking.count()

    # -- the loop -----------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            cpu = all(d.platform == "cpu" for d in self.handlers.devices.local)
            self.preemption = Preemption(cpu_work=cpu and not self.strict)
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop must be said, not swallowed
            log.exception("island %d host %d: the executor died", self.island, self.host)
            self.die(f"the executor of island {self.island} host {self.host} died: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                self.passes += 1
                if self._settling:
                    self._cond.notify_all()
                seen = self.version
                runs = list(self.runs)
            progressed = False
            finished = []
            for run in runs:
                if run.parked:
                    continue
                progressed |= self._advance(run)
                if run.pc >= run.end:
                    finished.append(run)
                elif self.strict and not run.parked:
                    break
            if finished:
                self._finish(finished)
            self._record.flush(finished, self.receiver.take_landed())
            if progressed:
                continue
            until_expiry = self.receiver.expire()
            with self._lock:
                if self.version == seen and not self._stopped:
                    self._sleeping = True
                    if self._settling:
                        self._cond.notify_all()
                    self._cond.wait(timeout=next_deadline(self.runs, self.op_timeout, until_expiry))
                    self._sleeping = False

    def _finish(self, finished: list[Run]) -> None:
        """Runs done in one pass: out of the list in one step (the pass's report says so)."""
        with self._lock:
            if len(finished) == 1:
                self.runs.remove(finished[0])
            else:
                gone = set(finished)
                self.runs = [run for run in self.runs if run not in gone]
            if self._parking.expecting:
                for run in finished:
                    self._parking.finished(run.seq)
            self.completed += sum(run.calls for run in finished)

    def _advance(self, run: Run) -> bool:
        """Run what ``run`` can now; what it took of the island is measured by ``preemption`` (on a busy machine, not
        the time other processes held the CPU meanwhile). Where reading the threads' times costs (their run-queue
        times, off a one-host CPU island), a run found waiting last time is not measured so (it most likely waits
        again): if it runs now, its wall time counts."""
        meter = self.preemption
        before = meter.sample() if run.waiting_since is None or meter.cpu_work else None
        busy, compiled, longest = run.busy_s, run.compile_s, run.longest_s
        if run.more and run.pc == 0 and len(run.ops) == 1 and not self.events.enabled:
            progressed = self._advance_calls(run)
        else:
            progressed = self._advance_ops(run)
        wall = run.busy_s - busy
        if before is not None and wall > 0:
            charged = meter.charge(before, wall)
            if charged < wall:  # the run's time, its compiling and its longest computation alike, less the stolen part
                keep = charged / wall
                run.busy_s = busy + charged
                run.compile_s = compiled + (run.compile_s - compiled) * keep
                if run.longest_s > longest:
                    run.longest_s = max(longest, run.longest_s * keep)
                self.busy_s -= wall - charged
            if run.compile_s > compiled:  # XLA may have started compiler threads: measure them too from now on
                meter.look_again()
        return progressed

    def _advance_calls(self, run: Run) -> bool:
        """A group of one-computation calls back to back (``run_calls``), what they share worked out once; a call
        whose input is missing splits the group there and waits as a run does."""
        op = run.ops[0]
        start = time.perf_counter()
        compiled_before = run.compile_s
        try:
            handler = self.handlers.by_op[type(op)]
            run_call = handler.launcher(run, op)
        except Exception:  # noqa: BLE001 - the call itself will fail the same way, and say so, one by one
            run_call = None
        if run_call is None:
            return self._advance_ops(run)
        done, busy, ran = run_calls(run, op, run_call, handler, self.table, start, run.compile_s - compiled_before)
        self.busy_s += busy
        self.ops_run += ran
        if done:
            return True
        self._split(run)
        return self._advance_ops(run) or ran > 0

    def _advance_ops(self, run: Run) -> bool:
        progressed = False
        traced = self.events.enabled
        by_op = self.handlers.by_op
        while run.pc < run.end:
            op = run.ops[run.pc]
            handler = by_op[type(op)]
            if self.strict and op.RECEIVES and run.resumed_at != run.pc:
                self._park(run, op)
                return progressed
            start, compiled_before = time.perf_counter(), run.compile_s
            wall = time.time() if traced else 0.0
            try:
                if not handler.run(run, op, run.resumed_at == run.pc):
                    if run.more:
                        self._split(run)
                    if self.strict and self._park_behind(run, op):
                        return progressed
                    now = time.monotonic()
                    if run.waiting_since is None:
                        run.waiting_since = now
                        if op.RECEIVES and not run.reported_blocked:
                            self._record.blocked(run)
                    if now - run.waiting_since < self.op_timeout:
                        return progressed
                    fail_op(handler, self.table, run, op, handler.waited_too_long(run, op))
            except Failed as exc:
                fail_op(handler, self.table, run, op, exc.failure)
            except Exception as exc:  # an op's failure becomes its outputs' failure
                fail_op(handler, self.table, run, op, Failure(*to_wire(exc)))
            elapsed = time.perf_counter() - start
            run.busy_s += elapsed
            if handler.computes:
                ran = elapsed - (run.compile_s - compiled_before)
                if ran > run.longest_s:
                    run.longest_s = ran
            self.busy_s += elapsed
            if traced:
                self._record.trace_op(run, op, handler.trace(op), wall, elapsed)
            touched = run.touched if run.touched is not None else run.touches(op)
            self.table.done_using(touched, run.ids(op.frees) if op.frees else (), run.tenant)
            run.pc += 1
            run.waiting_since = None
            self.ops_run += 1
            progressed = True
            if run.pc >= run.end and run.more:
                run.next_call()
        return progressed

    def _split(self, run: Run) -> None:
        """A call of a group waits for an input: the group's later calls become runs of their own, right behind it."""
        rest = run.split()
        with self._lock:
            at = self.runs.index(run) + 1 if run in self.runs else len(self.runs)
            self.runs[at:at] = rest
            self.version += 1

    # -- parking (multi-host islands) ---------------------------------------------------------------------
    def _park(self, run: Run, op: Op) -> None:
        with self._lock:
            self.runs.remove(run)
            self._parking.park(run)
        self.handlers.by_op[type(op)].watch(run, op)
        self._record.blocked(run)

    def _park_behind(self, run: Run, op: Op) -> bool:
        """Park ``run`` behind the parked run that will write a value ``op`` is missing, if there is one. If that run
        was resumed already (this host came to ``run`` after the resume), move ``run`` right behind it and the runs
        that came back with it instead: where a host that parked it has it, so every host runs them in one order,
        and where the value will be written (waiting in front of it would wait for ever)."""
        with self._lock:
            parking = self._parking
            producer = parking.producer(run.ids(op.reads()), self.table)
            if producer is None:
                return False
            if not parking.is_parked(producer):
                return self._move_behind(run, producer)
            self.runs.remove(run)
            parking.park_behind(run, producer)
        self._record.blocked(run)  # it waits on another island too: it must not hold the window
        return True

    def _move_behind(self, run: Run, producer: int) -> bool:
        """Move ``run`` right behind resumed run ``producer`` and the runs that came back (or were moved) behind it;
        False if they are not after ``run`` (they are then on their way). Under ``_lock``."""
        group = self._parking.returned(producer)
        if not group:
            return False
        runs = self.runs
        mine = runs.index(run)
        at = next((k for k in range(mine + 1, len(runs)) if runs[k] is group[0]), None)
        if at is None:
            return False
        del runs[mine]
        at -= 1  # the resumed run's place, ``run`` being out
        members = {id(r) for r in group}
        while at + 1 < len(runs) and id(runs[at + 1]) in members:
            at += 1
        runs.insert(at + 1, run)
        self._parking.join(producer, run)
        self.version += 1
        return True

    # -- dying --------------------------------------------------------------------------------------------
    def die(self, reason: str) -> None:
        """This host can no longer run: fail everything admitted, and every wait from now on."""
        failure = Failure("IslandFailedError", reason)
        with self._lock:
            self.dead = reason
            pending = self.runs + self._parking.take_all()
            self.runs = []
        for run in pending:
            fail_rest(self.table, run, failure)
        self.table.die(failure)
        self.touch()

    # -- what a stuck client is told ----------------------------------------------------------------------
    def stalled(self, tenant: str) -> list[dict]:
        """The tenant's admitted fragments that have not finished, and what each waits for."""
        with self._lock:
            runs = [r for r in self.runs + list(self._parking.parked.values()) if r.tenant == tenant]
        return stalled(runs, self.handlers.by_op)

    def stats(self) -> dict:
        """The host's execution counters: queue depth, parked runs, fragments completed, ops run, busy seconds (and
        ``uncharged_s``: runs' wall time not charged, other processes' and threads' time in it; ``runs_unmeasured``:
        runs charged their wall time, the threads' times unreadable), bytes."""
        parked = len(self._parking.parked)
        return {"queue_depth": len(self.runs) + parked, "parked": parked,
                "completed": self.completed, "ops": self.ops_run, "busy_s": self.busy_s,
                "uncharged_s": self.preemption.uncharged_s if self.preemption is not None else 0.0,
                "runs_unmeasured": self.preemption.unmeasured if self.preemption is not None else 0,
                "bytes_out": self.handlers.bytes_out, **self.receiver.stats(),
                "lent_bytes": self.handlers.peers.lent_bytes}
