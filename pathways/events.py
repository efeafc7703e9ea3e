"""Trace events, recorded by hosts and the client while ``pw.trace`` is on.

Recording appends a tuple to a list; when tracing is off the only cost is
one attribute check. Times are wall-clock seconds; the client corrects each
host's clock offset before writing the Chrome trace.
"""

from __future__ import annotations

import threading
import time
from typing import Any

Event = tuple[str, str, float, float, dict]  # name, category, start (s), duration (s), args


class EventLog:
    def __init__(self) -> None:
        self.enabled = False
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def start(self) -> float:
        with self._lock:
            self._events = []
            self.enabled = True
        return time.time()

    def stop(self) -> list[Event]:
        with self._lock:
            self.enabled = False
            events, self._events = self._events, []
        return events

    def span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record one complete span (wall-clock start and end, in seconds)."""
        if self.enabled:
            self._events.append((name, category, start, end - start, args))
