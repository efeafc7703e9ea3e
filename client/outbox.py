"""A client's messages to the island schedulers: in order, coalesced while a connection is busy.

Each island has one outbox, whose messages go to the island's host 0 as ``batch`` frames numbered by the
client's stream. Whoever puts a message while nothing is being sent sends it at once, on its own thread (a
lone call never waits for a thread switch); while a send is under way, new messages wait and the sender
takes them all as its next batch. A client dispatching faster than the host reads pays one frame per batch
instead of one per message, and when the host falls far behind, TCP's backpressure holds the dispatcher.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pathways.errors import PathwaysError
from pathways.requests import Batch

log = logging.getLogger(__name__)


class Outbox:
    """The messages to one island's scheduler (host 0)."""

    def __init__(self, session: Any, island: int) -> None:
        self._session, self._island = session, island
        self._cond = threading.Condition()
        self._held: list[bytes] = []
        self._sending = False
        self._next = 0  # the number of the next message in this client's stream to the island
        self.failed: str | None = None

    def put(self, payload: bytes) -> None:
        """Queue one message and, unless a send is under way, send what is queued."""
        with self._cond:
            self._held.append(payload)
            if self._sending:
                return
            self._sending = True
        self._pump()

    def _pump(self) -> None:
        while True:
            with self._cond:
                if not self._held:
                    self._sending = False
                    self._cond.notify_all()
                    return
                batch, self._held = self._held, []
                first = self._next
                self._next += len(batch)
            try:
                self._session.link(self._island, 0).send(Batch(first, batch).encode())
            except PathwaysError as exc:  # the island failed: these messages are lost with it
                self.failed = str(exc)
                log.info("island %d did not take %d message(s): %s", self._island, len(batch), exc)

    def drain(self, deadline: float) -> bool:
        """Wait until everything queued has been sent; False if ``deadline`` (monotonic) passed first."""
        with self._cond:
            while self._held or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


class Outboxes:
    """One outbox per island."""

    def __init__(self, session: Any, islands: int) -> None:
        self._session = session
        self._boxes = [Outbox(session, i) for i in range(islands)]

    def put(self, island: int, payload: bytes) -> None:
        """Queue one message for ``island``'s scheduler (see ``Outbox.put``)."""
        self._boxes[island].put(payload)

    def restart(self, island: int) -> None:
        """A restarted island's new scheduler: the client's stream to it starts again at message 0."""
        self._boxes[island] = Outbox(self._session, island)

    def drain(self, timeout: float, skip: set[int]) -> bool:
        """Wait until everything queued has been sent (except to the islands in ``skip``); False if an island
        did not take it in time."""
        deadline = time.monotonic() + timeout
        ok = True
        for island, box in enumerate(self._boxes):
            if island not in skip and not box.drain(deadline):
                log.warning("island %d did not take this client's messages within %.0fs", island, timeout)
                ok = False
        return ok

    def close(self, timeout: float, skip: set[int]) -> None:
        """Send everything still queued (except to the islands in ``skip``)."""
        self.drain(timeout, skip)
