"""Trace events, recorded by hosts and the client while ``pw.trace`` is on.

Recording appends a tuple to a list; when tracing is off the only cost is one
attribute check. Several tracers (one per tenant, say) may record at once:
each gets the events since its own start, and on a shared host only its own
tenant's events by name (``for_tenant``); everyone else's appear as anonymous
spans. Times are wall-clock seconds; the client corrects each host's clock
offset before writing the Chrome trace.
"""

from __future__ import annotations

import threading
import time
from typing import Any

Event = tuple[str, str, float, float, dict]  # name, category, start (s), duration (s), args
OTHER = "another tenant"


class EventLog:
    """A list of spans, recorded while at least one tracer is active."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[Event] = []
        self._active: dict[int, float] = {}  # tracer token -> its start
        self._tokens = 0
        self._lock = threading.Lock()

    def start(self) -> int:
        """Begin recording for one tracer; returns its token."""
        with self._lock:
            self._tokens += 1
            self._active[self._tokens] = time.time()
            self.enabled = True
            return self._tokens

    def stop(self, token: int | None = None) -> list[Event]:
        """End one tracer (the latest when ``token`` is None); its events since its start."""
        with self._lock:
            if token is None:
                token = max(self._active, default=0)
            since = self._active.pop(token, None)
            if since is None:
                return []
            events = [e for e in self._events if e[2] + e[3] >= since]
            if not self._active:
                self.enabled = False
                self._events = []
            else:
                oldest = min(self._active.values())
                self._events = [e for e in self._events if e[2] + e[3] >= oldest]
            return events

    def span(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record one complete span (wall-clock start and end, in seconds)."""
        if self.enabled:
            self._events.append((name, category, start, end - start, args))


def for_tenant(events: list[Event], tenant: str) -> list[Event]:
    """``events`` as ``tenant`` may see them: its own in full, others' as anonymous spans."""
    return [e if e[4].get("tenant") == tenant else (OTHER, "other", e[2], e[3], {}) for e in events]
