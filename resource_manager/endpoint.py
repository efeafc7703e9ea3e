"""A client endpoint of the runtime: where tenants' processes connect, instead of holding Ray handles.

The resource manager and every island host run one. It listens on the node's IP, runs the endpoint's half of
the handshake (``pathways.protocol``) on each new connection, and hands the authenticated connection to the
owner's ``serve`` on a thread of its own, so one client's connection never waits for another's. What a
careless or hostile process can grow here is bounded: handshakes in progress (each also has a time limit),
and each tenant's open connections (its ``connections`` budget).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pathways.protocol import connection
from pathways.protocol.address import format_address
from pathways.protocol.connection import Connection
from pathways.protocol.handshake import HandshakeError, Identity

MAX_HANDSHAKES = 32  # connections still proving themselves, from anyone
MAX_ANONYMOUS = 64  # connections without a session yet (the resource manager's), from anyone
LOG_EVERY_S = 60.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """A session as an endpoint knows it: its key, its tenant, and how many connections that tenant may hold."""

    key: bytes
    tenant: str
    max_connections: int


def bind(ip: str, ports: range | None = None) -> socket.socket:
    """A listening TCP socket on ``ip``: the first free port of ``ports``, else any free port. Reuses a port
    whose last connections are still in TIME-WAIT (a restart right after a stop)."""
    for port in ports or (0,):
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
            sock.listen(256)
            return sock
        except OSError:
            sock.close()
    raise OSError(f"no free port on {ip} in {ports}")


class Endpoint:
    """Accepts client connections for one endpoint of the runtime and serves each on its own thread.

    ``caller(session)`` says which session a client may prove (None: unknown); ``anonymous`` lets clients
    without a session in (the resource manager's, for credential-carrying requests). ``serve(conn, caller)``
    runs for the connection's lifetime (``caller`` None for an anonymous one); the endpoint closes the
    connection when it returns or raises.
    """

    def __init__(self, identity: Identity, ip: str, caller: Callable[[int], Caller | None],
                 serve: Callable[[Connection, Caller | None], None], *, anonymous: bool, max_payload: int,
                 max_data: int, ports: range | None = None, name: str = "endpoint") -> None:
        self.identity = identity
        self._caller, self._serve, self._anonymous = caller, serve, anonymous
        self.max_payload, self.max_data = max_payload, max_data
        self._listener = bind(ip, ports)
        host, port = self._listener.getsockname()[:2]
        self.address = format_address(host, port)
        self._name = name
        self._lock = threading.Lock()
        self._handshakes = 0
        self._open: dict[str, set[Connection]] = {}  # tenant ("" for anonymous) -> its open connections
        self.refused = 0
        self.served = 0
        self._said: dict[str, float] = {}
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                busy = self._handshakes >= MAX_HANDSHAKES
                if not busy:
                    self._handshakes += 1
            if busy:
                self.refused += 1
                sock.close()
                continue
            threading.Thread(target=self._connection, args=(sock, addr), name=f"{self._name}-conn",
                             daemon=True).start()

    def _connection(self, sock: socket.socket, addr: tuple) -> None:
        try:
            conn = connection.accept(sock, self.identity, self._key_of, self._anonymous, self.max_payload,
                                     self.max_data)
        except (HandshakeError, OSError, ValueError) as exc:
            self.refused += 1
            log.info("%s refused a connection from %s: %s", self._name, addr, exc)
            sock.close()
            return
        finally:
            with self._lock:
                self._handshakes -= 1
        caller = self._caller(conn.session) if conn.session else None
        tenant = caller.tenant if caller is not None else ""
        if not self._admit(conn, tenant, caller.max_connections if caller is not None else MAX_ANONYMOUS):
            return
        self.served += 1
        try:
            self._serve(conn, caller)
        except Exception:  # one connection's failure never reaches the endpoint
            log.exception("%s: serving a connection failed", self._name)
        finally:
            with self._lock:
                for conns in self._open.values():
                    conns.discard(conn)
            conn.close()

    def _admit(self, conn: Connection, tenant: str, limit: int) -> bool:
        with self._lock:
            held = self._open.setdefault(tenant, set())
            ok = len(held) < limit and not self._closed
            if ok:
                held.add(conn)
        if not ok:
            self.refused += 1
            now = time.monotonic()
            if now - self._said.get(tenant, -LOG_EVERY_S) >= LOG_EVERY_S:  # said once a minute, not per connection
                self._said[tenant] = now
                log.warning("%s refused a connection%s: over the limit of %d open connections (said once a "
                            "minute)", self._name, f" of tenant {tenant}" if tenant else " without a session", limit)
            conn.close()
        return ok

    def adopt(self, conn: Connection, caller: Caller) -> bool:
        """An anonymous connection that opened a session now counts as that session's tenant's; False (and the
        connection closed) if that is over the tenant's budget."""
        with self._lock:
            self._open.get("", set()).discard(conn)
        return self._admit(conn, caller.tenant, caller.max_connections)

    def _key_of(self, session: int) -> bytes | None:
        caller = self._caller(session)
        return caller.key if caller is not None else None

    def close_session(self, session: int) -> int:
        """Close every open connection of ``session`` (it ended); returns how many."""
        with self._lock:
            doomed = [c for conns in self._open.values() for c in conns if c.session == session]
        for conn in doomed:
            conn.close()
        return len(doomed)

    def connections(self, tenant: str) -> int:
        """How many connections ``tenant`` holds open here."""
        with self._lock:
            return len(self._open.get(tenant, ()))

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._closed = True
            conns = [c for cs in self._open.values() for c in cs]
        self._listener.close()
        for conn in conns:
            conn.close()
