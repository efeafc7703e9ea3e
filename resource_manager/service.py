"""The resource manager's client endpoint: the runtime's address, ``pathways://HOST:PORT``.

A client connects anonymously and asks to open a session (with its tenant's credential or its job's ticket);
the answer upgrades that very connection to the new session's key, and the connection then carries the
session's requests (slices, renewals, state) and stands for the client being alive: the session ends once
its client has had no connection here for longer than the grace period. Anonymous connections take only the
requests that carry a credential of their own (the admin's operations, jobs, ``whoami``). Each request class
has one handler, in one table; each answer carries the request's ``rid``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pathways import wire
from pathways.errors import PathwaysError, TenantAccessError, WireFormatError, to_wire
from pathways.protocol.connection import Connection
from pathways.protocol.frames import FrameError
from pathways.protocol.handshake import Identity
from pathways.requests import (
    ANONYMOUS_REQUESTS,
    SESSION_REQUESTS,
    AdminOp,
    Allocate,
    Answer,
    Close,
    JobLogs,
    ListJobs,
    Open,
    Quiesced,
    Ready,
    Release,
    Renew,
    State,
    StopJob,
    SubmitJob,
    Suspect,
    Watch,
    WhoAmI,
)
from resource_manager.endpoint import Caller, Endpoint
from resource_manager.jobs import MAX_ARCHIVE, JobRunner
from resource_manager.manager import ResourceManager

MAX_MESSAGE = 1 << 20
log = logging.getLogger(__name__)


class ManagerService:
    """Serves the resource manager (``rm``) and its job runner (``jobs``, set once the address is known, since
    jobs attach to it) to clients at ``address``."""

    jobs: JobRunner

    def __init__(self, rm: ResourceManager, ip: str, ports: range | None = None) -> None:
        self.rm = rm
        self._session_ops: dict[type, Callable[[int, Any], Any]] = {
            Renew: lambda c, r: rm.renew(c), Allocate: lambda c, r: rm.allocate(c, r.shape, r.axes, r.island),
            Release: lambda c, r: rm.release(c, r.slice), Close: lambda c, r: rm.close(c),
            State: lambda c, r: rm.state_of(c), Suspect: lambda c, r: rm.suspect(c, r.island, r.reason),
            Quiesced: lambda c, r: rm.suspension.acked(c, r.generation),
        }
        self._anonymous_ops: dict[type, Callable[[Any, bytes], Any]] = {
            Ready: lambda r, d: rm.ready(), WhoAmI: lambda r, d: rm.whoami(r.tenant, r.credential),
            AdminOp: lambda r, d: rm.admin(r.credential, r.op, r.args),
            SubmitJob: lambda r, d: self.jobs.submit(r.tenant, r.credential, r.entrypoint, r.name, d),
            ListJobs: lambda r, d: self.jobs.list(r.tenant, r.credential),
            JobLogs: lambda r, d: self.jobs.logs(r.tenant, r.credential, r.job, r.offset),
            StopJob: lambda r, d: self.jobs.stop(r.tenant, r.credential, r.job),
        }
        identity = Identity(rm.runtime_id, "rm")
        self.endpoint = Endpoint(identity, ip, self._caller, self._serve, anonymous=True, max_payload=MAX_MESSAGE,
                                 max_data=MAX_ARCHIVE, ports=ports, name="resource-manager")

    @property
    def address(self) -> str:
        """The runtime's address, ``pathways://HOST:PORT``."""
        return self.endpoint.address

    def _caller(self, client: int) -> Caller | None:
        found = self.rm.caller(client)
        if found is None:
            return None
        key, tenant, budgets = found
        return Caller(key, tenant, budgets.connections)

    def close_session(self, client: int) -> None:
        """Close the connections of a session that ended."""
        self.endpoint.close_session(client)

    def _serve(self, conn: Connection, caller: Caller | None) -> None:
        client = conn.session if caller is not None else None
        if client is not None:
            self.rm.connected(client, True)
        try:
            while True:
                frame = conn.recv()
                try:
                    request = wire.parse(frame.payload, *(SESSION_REQUESTS if client else ()), *ANONYMOUS_REQUESTS)
                except PathwaysError as exc:
                    conn.skip(frame.data)
                    conn.send(Answer(-1, False, list(to_wire(WireFormatError(f"unreadable request: {exc}")))).encode())
                    continue
                if isinstance(request, Open):
                    conn.skip(frame.data)
                    client = self._open(conn, request, client)
                    continue
                if isinstance(request, Watch) and client is not None:  # answered when the cluster's state changes
                    conn.skip(frame.data)
                    self.rm.notices.watch(conn, request.rid, request.seen)
                    continue
                data = b""
                if frame.data:
                    if not isinstance(request, SubmitJob):
                        conn.skip(frame.data)
                    else:
                        buf = bytearray(frame.data)
                        conn.read_into(memoryview(buf))
                        data = bytes(buf)
                conn.send(self._answer(request, client, data).encode())
        except (ConnectionError, OSError, FrameError) as exc:
            log.debug("a client connection ended: %s", exc)
        finally:
            self.rm.notices.drop(conn)
            if client is not None:
                self.rm.connected(client, False)

    def _answer(self, request: Any, client: int | None, data: bytes) -> Answer:
        try:
            op = self._session_ops.get(type(request))
            if op is not None:
                if client is None or self.rm.caller(client) is None:
                    raise TenantAccessError("this session has ended (closed, expired or reclaimed); call pw.init() "
                                            "again")
                return Answer(request.rid, True, op(client, request))
            return Answer(request.rid, True, self._anonymous_ops[type(request)](request, data))
        except PathwaysError as exc:  # a bad request never takes the manager down
            return Answer(request.rid, False, list(to_wire(exc)))
        except Exception as exc:
            log.exception("resource manager: %s failed", type(request).__name__)
            return Answer(request.rid, False, list(to_wire(exc)))

    def _open(self, conn: Connection, request: Open, client: int | None) -> int | None:
        """Open a session and upgrade this (anonymous) connection to its key; the answer goes first."""
        if client is not None:
            conn.send(Answer(request.rid, False, list(to_wire(PathwaysError(
                "this connection already holds a session; open another one on a new connection")))).encode())
            return client
        try:
            if not request.credential and not request.ticket:
                raise TenantAccessError("opening a session needs the tenant's credential or a job's ticket")
            new, key, value = self.rm.open_session(request.tenant, request.credential, request.ticket, request.pid,
                                                   request.job)
        except PathwaysError as exc:
            conn.send(Answer(request.rid, False, list(to_wire(exc))).encode())
            return None
        value["key"] = key
        conn.send(Answer(request.rid, True, value).encode())
        conn.upgrade(new, key)
        caller = self._caller(new)
        if caller is None or not self.endpoint.adopt(conn, caller):
            raise ConnectionError("the session ended as it opened, or its tenant holds too many connections")
        self.rm.connected(new, True)
        return new
