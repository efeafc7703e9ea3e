"""A client's messages to the island schedulers: in order, coalesced while a scheduler is busy.

Each island has one outbox, whose messages go to the island's host 0 as ``batch`` frames numbered by the
client's stream; the host answers each batch once it has taken it. A message goes at once while fewer than
``WINDOW`` batches are unanswered, so a lone call (or a short run of them) never waits, not even for a thread
switch: the caller sends it. Otherwise the host is still busy with earlier batches, and the message waits
for the oldest answer together with whatever else the client dispatches meanwhile; all of them then go as one
batch, in which calls of one program back to back are merged into one ``Calls`` message. A client
dispatching faster than the host absorbs pays one frame per batch instead of one per message, and one message
per run of calls instead of one per call, and so does the host, which every client of the island shares.

The caller does not wait for answers to keep the host fed: a held run of ``BATCH`` messages goes as one batch
even while the window is full (up to ``MAX_UNANSWERED`` unanswered batches). Answers are read by the link's
own thread, which a caller dispatching in a tight loop holds off the interpreter for up to its switch interval
(5 ms); waiting for them would leave the host idle that long, then hand it hundreds of messages at once.

While the cluster is suspended an outbox holds what it is given: a batch the host answered "suspended" (or
that was under way when the islands stopped) is kept, and once the cluster resumes the outbox sends again from
the message the island's host 0 says it takes next (``resume``), so no message is lost or taken twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from typing import Any

from client.link import LinkClosed
from pathways.errors import ClusterSuspendedError, PathwaysError
from pathways.messages import MAX_BATCH, MAX_CALLS, Call, Calls
from pathways.requests import Batch

WINDOW = 2  # batches sent and not answered yet, per island, before messages are held
BATCH = 32  # held messages that go as one batch while the window is full
MAX_UNANSWERED = 16  # unanswered batches per island beyond which messages are held, however many
log = logging.getLogger(__name__)


class Outbox:
    """The messages to one island's scheduler (host 0). ``wake`` is set when an answer lets held messages go."""

    def __init__(self, session: Any, island: int, wake: threading.Event, window: int = WINDOW) -> None:
        self._session, self._island, self._wake, self._window = session, island, wake, window
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # one sender at a time, so batches leave in their stream's order
        self._held: list[bytes | Call] = []  # encoded at sending, when calls waiting together merge
        self._answers: deque[tuple[Future, int, list[bytes]]] = deque()  # (answer, first message's number, batch)
        self._unsent: list[tuple[int, list[bytes]]] = []  # batches the suspended cluster did not take
        self._next = 0  # the number of the next message in this client's stream to the island
        self._answered_since = 0  # answers come since ``_window_full`` last looked (it polls no future until one has)
        self.paused = False  # the cluster is suspended: hold everything
        self.failed: str | None = None

    def put(self, payload: bytes | Call) -> None:
        """Queue one message and send what the window allows (on this thread: if another thread is sending, this
        one waits for it rather than leave its message to a thread that may not run for a while)."""
        with self._lock:
            self._held.append(payload)
            if self.paused or self._window_full():
                return  # it goes with a later put, or when an answer frees the window (``Outboxes``' thread)
        with self._sending:
            while self._send_one():
                pass

    def flush(self) -> None:
        """Send what is held, as the window allows."""
        while True:
            if not self._sending.acquire(blocking=False):
                return  # another thread is sending; it looks again before it lets go
            try:
                while self._send_one():
                    pass
            finally:
                self._sending.release()
            with self._lock:  # a message put while we were letting go would otherwise wait for the next answer
                if not self._held or self._window_full() or self.paused:
                    return

    def _window_full(self) -> bool:
        if self._answered_since:
            self._answered_since = 0
            self._drop_answered()
        unanswered = len(self._answers)
        return unanswered >= self._window and (len(self._held) < BATCH or unanswered >= MAX_UNANSWERED)

    def _drop_answered(self) -> None:
        while self._answers and self._answers[0][0].done():
            answer, first, batch = self._answers.popleft()
            exc = answer.exception()
            if isinstance(exc, ClusterSuspendedError) or (isinstance(exc, LinkClosed) and self.paused):
                self._unsent.append((first, batch))
                self.paused = True

    def _send_one(self) -> bool:
        with self._lock:
            if not self._held or self._window_full() or self.paused:
                return False
            held = self._held
            if len(held) > MAX_BATCH:
                held, self._held = held[:MAX_BATCH], held[MAX_BATCH:]
            else:
                self._held = []
            batch = _encoded(held)
            first = self._next
            self._next += len(batch)
        try:
            answer = self._session.link(self._island, 0).start(lambda rid: Batch(rid, first, batch))
        except PathwaysError as exc:  # the island failed: these messages are lost with it
            self.failed = str(exc)
            log.info("island %d did not take %d message(s): %s", self._island, len(batch), exc)
            return True
        with self._lock:
            self._answers.append((answer, first, batch))
        answer.add_done_callback(self._answered)
        return True

    def _answered(self, answer: Future) -> None:
        """Runs on the link's reader thread: only wakes the sender thread, never sends."""
        with self._lock:
            self._answered_since += 1
        exc = answer.exception()
        if isinstance(exc, ClusterSuspendedError):
            self.paused = True  # kept and sent again after the resume (``_drop_answered`` keeps the batch)
        elif exc is not None and not isinstance(exc, LinkClosed):  # a dead island is the session's to report
            log.error("island %d refused a batch of this client's messages: %s", self._island, exc)
        if self._held:
            self._wake.set()

    def pause(self) -> None:
        """The cluster is suspended: send nothing until ``resume``."""
        with self._lock:
            self.paused = True

    def resume(self, position: int) -> None:
        """The cluster resumed and island's host 0 takes message ``position`` of this client's stream next: send
        again from there (what it took before the suspend is not sent twice)."""
        with self._lock:
            self.paused = True  # so that answers of "suspended" keep their batches
            self._drop_answered()
            kept = sorted(self._unsent + [(first, batch) for _, first, batch in self._answers])
            self._answers.clear()
            self._unsent = []
            again: list[bytes] = []
            for first, batch in kept:
                again += batch[max(0, position - first):] if first + len(batch) > position else []
            missing = self._next - position - len(again)
            if missing > 0 or position > self._next:
                log.error("island %d took messages %d.. of this client but %d were sent: %d message(s) are lost",
                          self._island, position, self._next, max(missing, 0))
            self._held = again + self._held
            self._next = position
            self.paused = False
        self._wake.set()

    def drain(self, deadline: float) -> bool:
        """Send everything held, waiting for answers as needed; False if ``deadline`` (monotonic) passed first."""
        while True:
            self.flush()
            with self._lock:
                self._drop_answered()
                if self.paused or (not self._held and not self._answers):
                    return True  # paused: what is held goes after the resume
                pending = [answer for answer, _, _ in self._answers]
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            wait(pending[:1], timeout=left)


def _encoded(held: list[bytes | Call]) -> list[bytes]:
    """The wire messages of what is held, in order: calls of one program back to back (no executables with them)
    go as one ``Calls`` message, up to ``MAX_CALLS`` each, so the island decodes and checks the program once."""
    out: list[bytes] = []
    run: list[Call] = []
    for message in held:
        if type(message) is Call and not message.exes:
            if run and (len(run) == MAX_CALLS or message.template != run[0].template):
                out.append(_merged(run))
                run = []
            run.append(message)
            continue
        if run:
            out.append(_merged(run))
            run = []
        out.append(message if type(message) is bytes else message.encode())
    if run:
        out.append(_merged(run))
    return out


def _merged(run: list[Call]) -> bytes:
    """A run of calls of one program as one message (a lone call as itself)."""
    return run[0].encode() if len(run) == 1 else Calls.merge(run).encode()


class Outboxes:
    """One outbox per island, and the thread that sends held messages when answers free the window."""

    def __init__(self, session: Any, islands: int, window: int = WINDOW) -> None:
        self._session, self._window = session, window
        self._wake = threading.Event()
        self._boxes = [Outbox(session, i, self._wake, window) for i in range(islands)]
        self._stopped = False
        threading.Thread(target=self._run, name="pathways-outbox", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # an answer after this sets it again; one before it is seen by flush below
            if self._stopped:
                return
            for box in list(self._boxes):
                try:
                    box.flush()
                except Exception as exc:  # never let the sender die silently
                    log.warning("sending to an island failed: %s", exc)

    def put(self, island: int, payload: bytes | Call) -> None:
        """Queue one message for ``island``'s scheduler (see ``Outbox.put``)."""
        self._boxes[island].put(payload)

    def restart(self, island: int) -> None:
        """A restarted island's new scheduler: the client's stream to it starts again at message 0."""
        self._boxes[island] = Outbox(self._session, island, self._wake, self._window)

    def pause(self) -> None:
        """The cluster is suspended: every outbox holds what it is given."""
        for box in self._boxes:
            box.pause()

    def resume(self, island: int, position: int) -> None:
        """The cluster resumed: ``island``'s outbox sends again from message ``position`` (``Outbox.resume``)."""
        self._boxes[island].resume(position)

    def drain(self, timeout: float, skip: set[int]) -> bool:
        """Send everything held (except to the islands in ``skip``); False if an island did not take it in time."""
        deadline = time.monotonic() + timeout
        ok = True
        for island, box in enumerate(self._boxes):
            if island not in skip and not box.drain(deadline):
                log.warning("island %d did not take this client's messages within %.0fs", island, timeout)
                ok = False
        return ok

    def close(self, timeout: float, skip: set[int]) -> None:
        """Send everything still held (except to the islands in ``skip``), then stop the sender thread."""
        self.drain(timeout, skip)
        self._stopped = True
        self._wake.set()
