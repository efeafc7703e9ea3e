"""The door in front of every listening socket of the runtime: a connection proves itself before it gets a thread.

One thread per listening socket accepts connections and runs all their handshakes side by side on non-blocking
sockets: it sends the endpoint's greeting at once, collects the peer's fixed-size answer as its bytes come, and
sends the verdict. Only a connection that proved itself is handed to its owner's ``admit`` (which gives it a
thread, within limits of its own). Before that, what anyone who reaches the port can hold is bounded:

- a whole handshake has one deadline (``DEADLINE_S``), however slowly, or never, its bytes come;
- at most ``MAX_PENDING`` handshakes run at once, and ``MAX_PER_SOURCE`` from one address. A connection that comes
  when its source is at its bound makes that source's oldest handshake give way; one that comes when all are taken
  makes the oldest handshake of the busiest source give way. A flood of slow or silent connections therefore
  costs an honest client, who answers within a round trip, nothing but that round trip, and never locks it out;
- a handshake holds its few hundred bytes of state, never anything a peer announces.

The handshake itself is the endpoint's (``Handshake``: a greeting, a fixed-size answer, and a reply): the client
protocol's (``pathways.protocol.handshake.Accepting``), which the clients' endpoints and the hosts' network data
servers alike speak.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

DEADLINE_S = 10.0  # a whole handshake
MAX_PENDING = 64  # handshakes in progress, from anyone
MAX_PER_SOURCE = 16  # handshakes in progress from one address
ACCEPTS_PER_TURN = 64  # new connections taken before the handshakes under way get their turn again
log = logging.getLogger(__name__)


class Handshake(Protocol):
    """An endpoint's half of one handshake, doing no I/O: ``greeting`` goes out first, then ``expect`` bytes are
    awaited, and ``finish`` gives the reply and what the peer proved, or raises (an exception with a ``reply``
    attribute has that reply sent before the connection is closed)."""

    greeting: bytes
    expect: int

    def finish(self, answer: bytes) -> tuple[bytes, Any]: ...


Admit = Callable[[socket.socket, tuple, Any], None]  # (blocking socket, peer address, what it proved)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    addr: tuple
    source: str
    deadline: float
    handshake: Handshake
    unsent: memoryview
    got: bytearray = field(default_factory=bytearray)
    mask: int = selectors.EVENT_READ | selectors.EVENT_WRITE


class Doorway:
    """Runs the handshakes of ``listener``'s connections (each begun by ``handshake()``) and hands each proven one
    to ``admit``. Counters: ``proven``, ``refused`` (a failed handshake), ``evicted`` (gave way to a newer
    connection), ``expired`` (past the deadline)."""

    def __init__(self, listener: socket.socket, handshake: Callable[[], Handshake], admit: Admit, name: str, *,
                 deadline: float = DEADLINE_S, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        self._listener, self._handshake, self._admit, self._name = listener, handshake, admit, name
        self._deadline, self._max_pending, self._max_per_source = deadline, max_pending, max_per_source
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._closed = False
        self.proven = self.refused = self.evicted = self.expired = 0
        self._thread = threading.Thread(target=self._run, name=f"{name}-door", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Handshakes in progress now."""
        return len(self._pending)

    def _run(self) -> None:
        try:
            while not self._closed:
                soonest = min((p.deadline for p in self._pending.values()), default=None)
                timeout = None if soonest is None else max(0.0, soonest - time.monotonic())
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        return
                    else:
                        pending = self._pending.get(key.fileobj)
                        if pending is not None:
                            self._step(pending, events)
                now = time.monotonic()
                for pending in [p for p in self._pending.values() if p.deadline <= now]:
                    self.expired += 1
                    self._drop(pending)
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._wake_r.close()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed, or out of descriptors: the handshakes under way go on
                return
            sock.setblocking(False)
            source = addr[0] if isinstance(addr, tuple) else str(addr)
            self._make_room(source)
            handshake = self._handshake()
            pending = _Pending(sock, addr, source, time.monotonic() + self._deadline, handshake,
                               memoryview(handshake.greeting))
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _make_room(self, source: str) -> None:
        """Let the oldest handshake of ``source`` give way if it is at its bound, else the oldest of the busiest
        source if all are taken."""
        counts = Counter(p.source for p in self._pending.values())
        if counts[source] >= self._max_per_source:
            victim_source = source
        elif len(self._pending) >= self._max_pending:
            victim_source = max(counts, key=counts.__getitem__)
        else:
            return
        victim = next(p for p in self._pending.values() if p.source == victim_source)
        self.evicted += 1
        self._drop(victim)

    def _step(self, pending: _Pending, events: int) -> None:
        sock, expect = pending.sock, pending.handshake.expect
        try:
            if pending.unsent and events & selectors.EVENT_WRITE:
                sent = sock.send(pending.unsent)
                pending.unsent = pending.unsent[sent:]
            if events & selectors.EVENT_READ and len(pending.got) < expect:
                chunk = sock.recv(expect - len(pending.got))
                if not chunk:  # the peer gave up
                    raise ConnectionError("closed during the handshake")
                pending.got += chunk
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.refused += 1
            self._drop(pending)
            return
        if len(pending.got) == expect and not pending.unsent:
            self._finish(pending)
            return
        mask = selectors.EVENT_WRITE if pending.unsent else 0
        if len(pending.got) < expect:
            mask |= selectors.EVENT_READ
        if mask != pending.mask:
            pending.mask = mask
            self._selector.modify(sock, mask)

    def _finish(self, pending: _Pending) -> None:
        sock = pending.sock
        del self._pending[sock]
        self._selector.unregister(sock)
        try:
            reply, proven = pending.handshake.finish(bytes(pending.got))
        except Exception as exc:  # a failed proof, or bytes that are not a handshake at all
            self.refused += 1
            log.info("%s refused a connection from %s: %s", self._name, pending.addr, exc)
            _send_closing(sock, getattr(exc, "reply", b""))
            return
        # The reply is tens of bytes after a greeting of at most about a kilobyte: it fits in any socket's buffer.
        if not _send_all_now(sock, reply):
            self.refused += 1
            sock.close()
            return
        self.proven += 1
        try:
            sock.setblocking(True)
            self._admit(sock, pending.addr, proven)
        except Exception:  # the owner's failure with one connection never stops the door
            log.exception("%s: admitting a connection from %s failed", self._name, pending.addr)
            sock.close()

    def _drop(self, pending: _Pending) -> None:
        if self._pending.pop(pending.sock, None) is not None:
            self._selector.unregister(pending.sock)
        pending.sock.close()

    def close(self) -> None:
        """Stop accepting; the handshakes under way are dropped (the listening socket is the owner's to close)."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._wake_w.close()


def _send_all_now(sock: socket.socket, data: bytes) -> bool:
    """Send ``data`` on a non-blocking socket in one go; False if the peer's window did not take it all."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


def _send_closing(sock: socket.socket, data: bytes) -> None:
    if data:
        _send_all_now(sock, data)
    sock.close()
