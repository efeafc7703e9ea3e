"""A client's lease: a tiny actor owned by the client process.

Ray kills an actor when the process that owns it exits (fate sharing), so
the resource manager learns that a client ended, crashed or was stopped when
its lease stops answering, and reclaims the client's slices and buffers.
"""

from __future__ import annotations


class Lease:
    """Owned by the client process, so Ray kills it when that process exits; the resource manager pings it."""

    def ping(self) -> bool:
        """Answers while the client process lives."""
        return True
