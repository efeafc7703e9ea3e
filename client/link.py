"""A client's connection to one endpoint of the runtime (the resource manager, or an island host).

Requests that expect an answer get a number (``rid``) and a future; one reader thread per link reads the
answers and completes the futures, reading any array bytes that follow an answer straight into the buffer its
request named (a ``Sink``). One-way messages (the stream of programs, uploads of put values) go out with
``send``. When the connection ends, every request still waiting fails at once with the link's reason.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from pathways import wire
from pathways.errors import PathwaysError, from_wire
from pathways.protocol.connection import Connection, connect
from pathways.protocol.frames import FrameError
from pathways.protocol.handshake import Identity
from pathways.requests import Answer

MAX_ANSWER = 1 << 30  # an answer's message (a trace, a status)
MAX_DATA = 1 << 40  # array bytes after an answer: each sink checks them against what its request expects
log = logging.getLogger(__name__)

Sink = Callable[[Any, Connection, int], Any]  # (answer value, connection, data bytes) -> the request's result


class LinkClosed(PathwaysError):
    """The connection to an endpoint ended; ``reason`` says how."""


class Link:
    """One authenticated connection (or an anonymous one to the resource manager) and its reader thread.

    ``broken(reason)`` is called once, from the reader thread, when the connection ends unexpectedly (the
    session uses it to learn that an island's host is gone).
    """

    def __init__(self, address: str, session: int, key: bytes | None, expect: Callable[[Identity], None],
                 what: str, broken: Callable[[str], None] | None = None, timeout: float = 5.0) -> None:
        self.address, self.what = address, what
        self.conn = connect(address, session, key, expect, MAX_ANSWER, MAX_DATA, timeout)
        self.identity = self.conn.peer
        self._broken = broken
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[Future, Sink | None]] = {}
        self.closed: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"link-{what}", daemon=True)
        self._reader.start()

    # -- requests -----------------------------------------------------------------------------------------
    def start(self, make: Callable[[int], Any], data: Sequence[Any] = (), sink: Sink | None = None) -> Future:
        """Send the request ``make(rid)`` (a message with ``encode()``) and return the future of its answer: the
        answer's value, or ``sink``'s result when array bytes follow it."""
        future: Future = Future()
        with self._lock:
            if self.closed is not None:
                future.set_exception(LinkClosed(f"the connection to {self.what} is closed: {self.closed}"))
                return future
            rid = next(self._rids)
            self._waiting[rid] = (future, sink)
        try:
            self.conn.send(make(rid).encode(), data)
        except OSError as exc:
            self._end(f"sending failed: {exc}")
        return future

    def call(self, make: Callable[[int], Any], timeout: float, data: Sequence[Any] = (),
             sink: Sink | None = None) -> Any:
        """``start`` and wait at most ``timeout`` seconds; raises the endpoint's error, or PathwaysError when
        no answer came in time."""
        future = self.start(make, data, sink)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise PathwaysError(f"{self.what} did not answer within {timeout:.0f}s") from None

    def send(self, payload: bytes, data: Sequence[Any] = ()) -> None:
        """Send one message that gets no answer; LinkClosed if the connection is gone."""
        if self.closed is not None:
            raise LinkClosed(f"the connection to {self.what} is closed: {self.closed}")
        try:
            self.conn.send(payload, data)
        except OSError as exc:
            self._end(f"sending failed: {exc}")
            raise LinkClosed(f"the connection to {self.what} is closed: {self.closed}") from None

    # -- answers ------------------------------------------------------------------------------------------
    def _read(self) -> None:
        refusal = None
        try:
            while True:
                frame = self.conn.recv()
                answer = wire.parse(frame.payload, Answer)
                with self._lock:
                    future, sink = self._waiting.pop(answer.rid, (None, None))
                if future is None:
                    self.conn.skip(frame.data)
                    if answer.rid == -1 and not answer.ok:  # the endpoint could not read a request of ours
                        log.error("%s refused a request: %s", self.what, answer.value)
                        refusal = answer.value  # if the connection ends next, this is why
                    continue
                if not answer.ok:
                    self.conn.skip(frame.data)
                    future.set_exception(from_wire(*answer.value))
                elif sink is not None:
                    try:
                        future.set_result(sink(answer.value, self.conn, frame.data))
                    except PathwaysError as exc:  # the answer was not what the request expects: trust nothing more
                        future.set_exception(exc)
                        raise FrameError(str(exc)) from None
                else:
                    self.conn.skip(frame.data)
                    future.set_result(answer.value)
        except (ConnectionError, OSError) as exc:
            if refusal is not None and self.closed is None:
                self._end(str(from_wire(*refusal)))
            else:
                self._end(f"{type(exc).__name__}: {exc}" if self.closed is None else self.closed)
        except PathwaysError as exc:  # a frame that failed a check, or an unreadable answer
            self._end(str(exc))

    def _end(self, reason: str) -> None:
        with self._lock:
            first = self.closed is None
            if first:
                self.closed = reason
            waiting, self._waiting = self._waiting, {}
        self.conn.close()
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(LinkClosed(f"the connection to {self.what} ended: {reason}"))
        if first and self._broken is not None and reason != "closed by this client":
            self._broken(reason)

    def close(self) -> None:
        """Close the connection; requests still waiting fail."""
        self._end("closed by this client")

    @property
    def alive(self) -> bool:
        """Whether the connection is still open."""
        return self.closed is None


def expect_role(runtime: str | None, role: str, island: int = -1, host: int = -1,
                epoch: int | None = None) -> Callable[[Identity], None]:
    """A check of the endpoint's identity for ``connect``: this runtime (when known), this role, island and host,
    and this epoch (when given); HandshakeError otherwise."""
    from pathways.protocol.handshake import HandshakeError

    def check(identity: Identity) -> None:
        want = Identity(runtime or identity.runtime, role, island, host, identity.epoch if epoch is None else epoch)
        if identity != want:
            raise HandshakeError(f"the endpoint is {identity.describe()} of runtime {identity.runtime}, not "
                                 f"{want.describe()} of runtime {want.runtime} (a stale address?)")

    return check
