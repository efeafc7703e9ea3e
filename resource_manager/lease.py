"""A client's lease: a tiny actor owned by the client process.

Ray kills an actor when the process that owns it exits (fate sharing), so
the resource manager learns that a client ended, crashed or was stopped when
its lease stops answering, and reclaims the client's slices and buffers.
"""

from __future__ import annotations


class Lease:
    def ping(self) -> bool:
        return True
