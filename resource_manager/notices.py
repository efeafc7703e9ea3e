"""Clients' standing requests to hear when the cluster's state changes (a suspend, a resume).

A client's ``Watch`` names the generation it knows; the resource manager answers it at once if the cluster
is past that, else keeps it (one per connection, no thread held) and answers every kept watch when the
state changes. So a suspend notice reaches every attached client in one round trip, without polling.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from pathways.protocol.connection import Connection
from pathways.requests import Answer

log = logging.getLogger(__name__)


class Notices:
    """Kept watches, by connection; ``state()`` is the cluster's state as clients see it (with ``generation``)."""

    def __init__(self, state: Callable[[], dict]) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._waiting: dict[Connection, int] = {}

    def watch(self, conn: Connection, rid: int, seen: int) -> None:
        """Answer ``rid`` on ``conn`` once the state is past generation ``seen``; an older watch of the same
        connection is answered now."""
        state = self._state()
        with self._lock:
            old = self._waiting.pop(conn, None)
            if state["generation"] == seen:
                self._waiting[conn] = rid
        if old is not None:
            _send(conn, old, state)
        if state["generation"] != seen:
            _send(conn, rid, state)

    def changed(self) -> None:
        """The state changed: answer every kept watch."""
        state = self._state()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for conn, rid in waiting.items():
            _send(conn, rid, state)

    def drop(self, conn: Connection) -> None:
        """The connection ended: forget its watch."""
        with self._lock:
            self._waiting.pop(conn, None)


def _send(conn: Connection, rid: int, state: Any) -> None:
    try:
        conn.send(Answer(rid, True, state).encode())
    except OSError as exc:  # the client is gone; its session's own watch will notice
        log.debug("a watch's answer was not delivered: %s", exc)
