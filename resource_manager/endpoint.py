"""A client endpoint of the runtime: where tenants' processes connect, instead of holding Ray handles.

The resource manager and every island host run one. It listens on the node's IP, runs the endpoint's half of
the handshake (``pathways.protocol``) on each new connection in its ``Doorway``, and hands the authenticated
connection to the owner's ``serve`` on a thread of its own, so one client's connection never waits for another's.
What a careless or hostile process can grow here is bounded: handshakes in progress (the doorway's bounds and
deadline), anonymous connections (in total and per source address, the least recently active idle one giving
way), each tenant's open connections (its ``connections`` budget) and the bytes of its messages being read (its
``frame_bytes`` budget).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pathways.budgets import over
from pathways.errors import to_wire
from pathways.protocol import connection
from pathways.protocol.address import format_address
from pathways.protocol.connection import Connection
from pathways.protocol.frames import OverBudget
from pathways.protocol.handshake import ANONYMOUS, Accepting, Identity, Proven
from pathways.requests import Answer
from resource_manager.doorway import Doorway

MAX_ANONYMOUS = 64  # connections without a session yet (the resource manager's), from anyone
MAX_ANONYMOUS_PER_SOURCE = 16  # such connections from one address
LOG_EVERY_S = 60.0
LINGER_S = 1.0  # a refused connection's last bytes are read and dropped this long before it closes
LINGER_BYTES = 4 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """A session as an endpoint knows it: its key, its tenant, how many connections that tenant may hold, and how
    many bytes of its messages may be read at once (``frame_bytes``)."""

    key: bytes
    tenant: str
    max_connections: int
    frame_bytes: int


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


def refuse_frame(conn: Connection, exc: OverBudget) -> None:
    """Tell the client why its connection ends (a message over its tenant's budget, whose rest is never read), as
    the answer to no request of its, then close it. What the client still sends is read and dropped for a moment
    (``LINGER_S``, ``LINGER_BYTES`` at most) so that closing does not reset the connection before it read why."""
    log.warning("closed a connection of session %d: %s", conn.session, exc.error)
    try:
        conn.send(Answer(-1, False, list(to_wire(exc.error))).encode())
        conn.sock.shutdown(socket.SHUT_WR)
        conn.sock.settimeout(LINGER_S)
        left = LINGER_BYTES
        while left > 0 and (chunk := conn.sock.recv(min(left, 1 << 16))):
            left -= len(chunk)
    except OSError:
        pass
    conn.close()


class Reading:
    """Bytes of each tenant's messages being read at one endpoint, within its ``frame_bytes`` budget: a connection
    gets a ``meter`` for its tenant, which its large messages are counted on while they are read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def meter(self, tenant: str, limit: int) -> _Meter:
        return _Meter(self, tenant, limit)

    def take(self, tenant: str, nbytes: int, limit: int) -> None:
        with self._lock:
            held = self._held.get(tenant, 0)
            if held + nbytes > limit:
                raise OverBudget(over("frame_bytes", held, nbytes, limit, "bytes"))
            self._held[tenant] = held + nbytes

    def give(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._held[tenant] - nbytes
            if left:
                self._held[tenant] = left
            else:
                del self._held[tenant]

    def held(self, tenant: str) -> int:
        """Bytes of ``tenant``'s messages being read now."""
        with self._lock:
            return self._held.get(tenant, 0)


@dataclass(frozen=True)
class _Meter:
    reading: Reading
    tenant: str
    limit: int

    def take(self, nbytes: int) -> None:
        self.reading.take(self.tenant, nbytes, self.limit)

    def give(self, nbytes: int) -> None:
        self.reading.give(self.tenant, nbytes)


class Endpoint:
    """Accepts client connections for one endpoint of the runtime and serves each on its own thread.

    Handshakes run on the ``Doorway``'s one thread; a connection gets a thread of its own only once it proved a
    session ``caller(session)`` knows (None: unknown), or came anonymously where ``anonymous`` allows (the resource
    manager's, for credential-carrying requests). Anonymous connections are bounded in total and per source
    address; when a new one finds no room, the least recently active idle one gives way, so a crowd of idle or
    slow anonymous connections never locks out the admin or a client about to log in. ``serve(conn, caller)`` runs
    for the connection's lifetime (``caller`` None for an anonymous one); the endpoint closes the connection when
    it returns or raises.
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
        self._open: dict[str, set[Connection]] = {}  # tenant -> its open connections
        self._anonymous_from: dict[Connection, str] = {}  # anonymous connections -> their source address
        self.reading = Reading()
        self.refused = 0
        self.served = 0
        self.evicted = 0
        self._said: dict[str, float] = {}
        self._closed = False
        self.door = Doorway(self._listener, lambda: Accepting(identity, self._key_of, anonymous), self._admitted,
                            name)

    def _admitted(self, sock: socket.socket, addr: tuple, proven: Proven) -> None:
        """A connection that proved itself (on the doorway's thread: quick): counted, then served on its own thread."""
        conn = connection.adopt(sock, proven, self.max_payload, self.max_data)
        if proven.session == ANONYMOUS:
            caller = None
            admitted = self._admit_anonymous(conn, str(addr[0]))
        else:
            caller = self._caller(proven.session)
            admitted = caller is not None and self._admit(conn, caller)
            if caller is None:
                conn.close()  # the session ended between its proof and now
        if not admitted:
            return
        self.served += 1
        threading.Thread(target=self._run, args=(conn, caller), name=f"{self._name}-conn", daemon=True).start()

    def _run(self, conn: Connection, caller: Caller | None) -> None:
        try:
            self._serve(conn, caller)
        except Exception:  # one connection's failure never reaches the endpoint
            log.exception("%s: serving a connection failed", self._name)
        finally:
            with self._lock:
                self._anonymous_from.pop(conn, None)
                for conns in self._open.values():
                    conns.discard(conn)
            conn.close()

    def _admit_anonymous(self, conn: Connection, source: str) -> bool:
        """Room for one more anonymous connection: the least recently active idle one of ``source`` gives way if
        that source holds its bound, else the one of the busiest source if all are taken; refused (closed) if every
        one in the way is busy with a request."""
        with self._lock:
            if self._closed:
                ok, victim = False, None
            else:
                ok, victim = True, None
                held = self._anonymous_from
                mine = [c for c, s in held.items() if s == source]
                crowd = mine if len(mine) >= MAX_ANONYMOUS_PER_SOURCE else None
                if crowd is None and len(held) >= MAX_ANONYMOUS:
                    counts = Counter(held.values())
                    busiest = max(counts, key=counts.__getitem__)
                    crowd = [c for c, s in held.items() if s == busiest]
                if crowd is not None:
                    idle = [c for c in crowd if not c.busy]
                    victim = min(idle, key=lambda c: c.active) if idle else None
                    ok = victim is not None
                    if ok:
                        del held[victim]
                        self.evicted += 1
                if ok:
                    held[conn] = source
        if victim is not None:
            victim.close()  # its reader thread ends and lets go of the rest
        if not ok:
            self._refuse(conn, "", MAX_ANONYMOUS)
        return ok

    def _admit(self, conn: Connection, caller: Caller) -> bool:
        """Room for one more connection of ``caller``'s tenant (its ``connections`` budget); its large messages are
        read within its ``frame_bytes`` budget."""
        if not self._count(conn, caller.tenant, caller.max_connections):
            return False
        conn.meter = self.reading.meter(caller.tenant, caller.frame_bytes)
        return True

    def _count(self, conn: Connection, tenant: str, limit: int) -> bool:
        with self._lock:
            self._anonymous_from.pop(conn, None)
            held = self._open.setdefault(tenant, set())
            ok = len(held) < limit and not self._closed
            if ok:
                held.add(conn)
        if not ok:
            self._refuse(conn, tenant, limit)
        return ok

    def _refuse(self, conn: Connection, tenant: str, limit: int) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._said.get(tenant, -LOG_EVERY_S) >= LOG_EVERY_S:  # said once a minute, not per connection
            self._said[tenant] = now
            log.warning("%s refused a connection%s: over the limit of %d open connections (said once a minute)",
                        self._name, f" of tenant {tenant}" if tenant else " without a session", limit)
        conn.close()

    def adopt(self, conn: Connection, caller: Caller) -> bool:
        """An anonymous connection that opened a session now counts as that session's tenant's; False (and the
        connection closed) if that is over the tenant's budget."""
        return self._admit(conn, caller)

    def charge(self, conn: Connection, tenant: str, max_connections: int) -> bool:
        """An anonymous connection whose request proved ``tenant``'s credential and will hold it for long (a job's
        archive on its way) counts as that tenant's from now on, not as one of the few anonymous ones; False (and
        the connection closed) if that is over the tenant's ``connections`` budget."""
        return self._count(conn, tenant, max_connections)

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

    def stats(self) -> dict:
        """What the endpoint's door and limits did (no tenant named)."""
        door = self.door
        with self._lock:
            anonymous = len(self._anonymous_from)
        return {"handshakes_pending": door.pending, "handshakes_refused": door.refused,
                "handshakes_evicted": door.evicted, "handshakes_expired": door.expired,
                "anonymous_connections": anonymous, "anonymous_evicted": self.evicted,
                "connections_refused": self.refused, "connections_served": self.served}

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._closed = True
            conns = [c for cs in self._open.values() for c in cs] + list(self._anonymous_from)
        self.door.close()
        self._listener.close()
        for conn in conns:
            conn.close()
