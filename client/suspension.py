"""What a client does while its cluster is suspended: the gate every call that sends to the islands passes.

The gate is open while the cluster runs. When the admin suspends it, the session closes the gate: calls
already dispatching finish (a program call reaches all its islands or none), new ones wait for the resume,
at most ``pw.Timeouts.suspend`` seconds, and then fail with ClusterSuspendedError. The session reopens the
gate once the cluster has resumed and this client's streams are back in order.
"""

from __future__ import annotations

import threading
import time

from pathways.errors import ClusterSuspendedError

RUNNING = "running"


class Gate:
    """Whether this client may send to the islands now, and how many calls are sending."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # entered directly on a call's way: a Condition's own enter costs more
        self._cond = threading.Condition(self._lock)
        self._sending = 0
        self._mine = threading.local()  # how deep this thread is in ``sending`` (a call's puts are part of it)
        self.phase = RUNNING  # the cluster's phase as this client last heard it

    @property
    def open(self) -> bool:
        """Whether the cluster runs (as far as this client knows)."""
        return self.phase == RUNNING

    def sending(self, timeout: float, what: str) -> _Sending:
        """Hold the gate open for one call (``what``, in a ``with``), waiting at most ``timeout`` seconds for a
        suspended cluster to resume. Within a call that holds it already, it passes at once."""
        return _Sending(self, timeout, what)

    def enter(self, timeout: float, what: str) -> None:
        """``sending``'s start, for a caller that leaves in a ``finally`` (a call's path: no object per call)."""
        mine = self._mine
        depth = getattr(mine, "depth", 0)
        if depth:
            mine.depth = depth + 1
            return
        with self._lock:
            if self.phase != RUNNING:
                self._wait_open(timeout, what)
            self._sending += 1
        mine.depth = 1

    def leave(self) -> None:
        """``sending``'s end."""
        mine = self._mine
        depth = mine.depth = mine.depth - 1
        if depth:
            return
        with self._lock:
            self._sending -= 1
            if self.phase != RUNNING:  # ``close`` waits for the calls sending now
                self._cond.notify_all()

    def wait_open(self, timeout: float, what: str) -> None:
        """Return once the cluster runs; ClusterSuspendedError after ``timeout`` seconds."""
        with self._cond:
            self._wait_open(timeout, what)

    def _wait_open(self, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while self.phase != RUNNING:
            left = deadline - time.monotonic()
            if left <= 0:
                raise suspended_error(what, self.phase, timeout)
            self._cond.wait(left)

    def close(self, phase: str, timeout: float) -> bool:
        """The cluster is ``phase`` (not running): let no new call send, and wait at most ``timeout`` seconds for
        the calls sending now to finish; whether they did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self.phase = phase
            while self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def reopen(self) -> None:
        """The cluster runs again: calls that wait go on."""
        with self._cond:
            self.phase = RUNNING
            self._cond.notify_all()


class _Sending:
    """One call holding the gate open (``Gate.sending``): a plain object, since one is made per call."""

    __slots__ = ("_gate", "_timeout", "_what")

    def __init__(self, gate: Gate, timeout: float, what: str) -> None:
        self._gate, self._timeout, self._what = gate, timeout, what

    def __enter__(self) -> None:
        self._gate.enter(self._timeout, self._what)

    def __exit__(self, *exc: object) -> None:
        self._gate.leave()


def suspended_error(what: str, phase: str, waited: float | None = None) -> ClusterSuspendedError:
    """The error a call gets while the cluster is suspended: what happened and what to do."""
    wait = f" and did not resume within {waited:.0f}s (pw.Timeouts.suspend)" if waited else ""
    return ClusterSuspendedError(
        f"{what}: the cluster is {phase} by its admin{wait}. Your arrays are saved with it and stay valid: "
        "once the admin resumes it (`pathways resume`), call again")
