"""A client's messages to the island schedulers: in order, coalesced while a scheduler is busy.

A message goes at once while fewer than ``unanswered`` messages the
scheduler has not answered yet are on their way, so a lone call (or a short
run of them) never waits. Otherwise the scheduler is still busy with earlier
messages, and this one waits for the oldest answer together with whatever
else the client dispatches meanwhile; all of them then go as one
``submit_batch``. A client dispatching faster than a scheduler absorbs pays
one actor call per batch instead of one per message, and so does the
scheduler, which every client of the island shares.

Messages are numbered per island: Ray does not keep the order of calls to a
threaded actor (the scheduler lives in a host), so the scheduler puts each
batch back in its place by the number of its first message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from ray.exceptions import RayActorError

Sign = Callable[..., bytes]  # the session's signature: sign(purpose, *parts)

log = logging.getLogger(__name__)


class Outbox:
    """The messages to one island's scheduler; at most ``unanswered`` sent and not answered at a time."""

    def __init__(self, scheduler: Any, client: int, sign: Sign, wake: threading.Event, unanswered: int) -> None:
        self._scheduler = scheduler
        self._client = client
        self._sign = sign
        self._sent = 0  # messages handed to Ray so far: the number of the next one
        self._wake = wake
        self._unanswered = unanswered
        self._lock = threading.Lock()
        self._held: list[tuple[bytes, list | None]] = []
        self._answers: deque[Future] = deque()

    def put(self, payload: bytes, refs: list | None) -> None:
        """Queue one message (with the object refs that travel beside it) and send it if the scheduler allows."""
        with self._lock:
            self._held.append((payload, refs))
            self._send()

    def flush(self) -> None:
        """Send what is held if the scheduler has answered (the sender thread calls this when it does)."""
        with self._lock:
            self._send()

    def _send(self) -> None:
        answers = self._answers
        while answers and answers[0].done():
            answers.popleft()
        if not self._held or len(answers) >= self._unanswered:
            return
        held, self._held = self._held, []
        parts = [p for payload, refs in held for p in (payload, *[r.binary() for r in refs or ()])]
        mac = self._sign("submit", self._sent, *parts)
        ref = self._scheduler.submit_batch.remote(self._client, self._sent, [(p, list(r or ())) for p, r in held], mac)
        self._sent += len(held)
        answer = ref.future()
        answers.append(answer)
        answer.add_done_callback(self._answered)

    def _answered(self, answer: Future) -> None:
        """Runs on Ray's thread when the scheduler answers: only wakes the sender thread, never calls Ray."""
        exc = answer.exception()
        if exc is not None and not isinstance(exc, RayActorError):  # a dead island is the session's to report
            log.error("an island scheduler refused a message: %s", exc)  # nobody else would ever see why
        if self._held:  # put appends before it checks the answer, so a message held now is never missed
            self._wake.set()

    def drain(self, deadline: float) -> bool:
        """Send everything held, waiting for answers as needed; False if ``deadline`` (monotonic) passed first."""
        while True:
            with self._lock:
                self._send()
                if not self._held:
                    return True
                answer = self._answers[0]
            if not wait([answer], timeout=max(0.0, deadline - time.monotonic())).done:
                return False


class Outboxes:
    """One outbox per island and the thread that sends held messages when no dispatch comes to send them."""

    def __init__(self, schedulers: list[Any], client: int, sign: Sign, unanswered: int = 2) -> None:
        self._wake = threading.Event()
        self._client, self._sign, self._unanswered = client, sign, unanswered
        self._boxes = [Outbox(s, client, sign, self._wake, unanswered) for s in schedulers]
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pathways-outbox", daemon=True)
        self._thread.start()

    def put(self, island: int, payload: bytes, refs: list | None) -> None:
        """Queue one message for ``island``'s scheduler (see ``Outbox.put``)."""
        self._boxes[island].put(payload, refs)

    def replace(self, island: int, scheduler: Any) -> None:
        """A restarted island's new scheduler: its stream starts again at message 0."""
        self._boxes[island] = Outbox(scheduler, self._client, self._sign, self._wake, self._unanswered)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # an answer after this sets it again; one before it is seen by flush below
            if self._stopped:
                return
            for box in self._boxes:
                try:
                    box.flush()
                except Exception as exc:  # never let the sender die silently
                    log.warning("sending to an island scheduler failed: %s", exc)

    def drain(self, timeout: float, skip: set[int]) -> bool:
        """Send everything held (except to the islands in ``skip``); False if an island did not take it in time."""
        deadline = time.monotonic() + timeout
        ok = True
        for island, box in enumerate(self._boxes):
            if island not in skip and not box.drain(deadline):
                log.warning("island %d's scheduler did not answer within %.0fs", island, timeout)
                ok = False
        return ok

    def close(self, timeout: float, skip: set[int]) -> None:
        """Send everything still held (except to the islands in ``skip``), then stop the sender thread."""
        self.drain(timeout, skip)
        self._stopped = True
        self._wake.set()
