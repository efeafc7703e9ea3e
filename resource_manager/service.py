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
import socket
import time
from collections.abc import Callable
from typing import Any

from pathways import wire
from pathways.errors import PathwaysError, TenantAccessError, WireFormatError, to_wire
from pathways.protocol.connection import Connection
from pathways.protocol.frames import FrameError, OverBudget
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
from resource_manager.endpoint import Caller, Endpoint, refuse_frame
from resource_manager.jobs import MAX_ARCHIVE, JobRunner
from resource_manager.manager import ResourceManager

MAX_MESSAGE = 1 << 20
UPLOAD_IDLE_S = 60.0  # an admitted archive whose bytes stop coming for this long ends its connection
LINGER_S = 5.0  # after refusing an archive, how long its sender may go on sending before the connection closes
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
        self._anonymous_ops: dict[type, Callable[[Any], Any]] = {
            Ready: lambda r: rm.ready(), WhoAmI: lambda r: rm.whoami(r.tenant, r.credential),
            AdminOp: lambda r: rm.admin(r.credential, r.op, r.args),
            ListJobs: lambda r: self.jobs.list(r.tenant, r.credential),
            JobLogs: lambda r: self.jobs.logs(r.tenant, r.credential, r.job, r.offset),
            StopJob: lambda r: self.jobs.stop(r.tenant, r.credential, r.job),
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
        return Caller(key, tenant, budgets.connections, budgets.frame_bytes)

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
                if isinstance(request, SubmitJob):  # its archive follows: read only once it is admitted
                    self._submit(conn, request, frame.data)
                    continue
                if frame.data and client is None:  # nobody known yet: its bytes are not worth a thread's time
                    conn.send(Answer(request.rid, False, list(to_wire(WireFormatError(
                        f"{type(request).__name__} carries no data")))).encode())
                    _refuse_unread(conn, frame.data)
                conn.skip(frame.data)
                conn.send(self._answer(request, client).encode())
        except OverBudget as exc:
            refuse_frame(conn, exc)
        except (ConnectionError, OSError, FrameError) as exc:
            log.debug("a client connection ended: %s", exc)
        finally:
            self.rm.notices.drop(conn)
            if client is not None:
                self.rm.connected(client, False)

    def _answer(self, request: Any, client: int | None) -> Answer:
        try:
            op = self._session_ops.get(type(request))
            if op is not None:
                if client is None or self.rm.caller(client) is None:
                    raise TenantAccessError("this session has ended (closed, expired or reclaimed); call pw.init() "
                                            "again")
                return Answer(request.rid, True, op(client, request))
            return Answer(request.rid, True, self._anonymous_ops[type(request)](request))
        except PathwaysError as exc:  # a bad request never takes the manager down
            return Answer(request.rid, False, list(to_wire(exc)))
        except Exception as exc:
            log.exception("resource manager: %s failed", type(request).__name__)
            return Answer(request.rid, False, list(to_wire(exc)))

    def _submit(self, conn: Connection, request: SubmitJob, nbytes: int) -> None:
        """A job: admitted (credential, job user, running jobs, ``job_disk_bytes`` for the ``nbytes`` its message
        announces) before a byte of its archive is read; then the archive streams to disk and the job starts. A
        refused archive is never read: the connection ends after the answer (``_refuse_unread``)."""
        try:
            upload = self.jobs.admit(request.tenant, request.credential, request.entrypoint, request.name, nbytes)
        except Exception as exc:
            conn.send(_failed(request.rid, exc).encode())
            if nbytes:
                _refuse_unread(conn, nbytes)
            return
        if conn.session == 0 and not self.endpoint.charge(conn, upload.record.name, upload.record.limits.connections):
            self.jobs.release(upload)
            raise ConnectionError("the tenant holds too many connections to take a job's archive on one more")
        try:
            conn.sock.settimeout(UPLOAD_IDLE_S)  # a sender that stalls gives its budget back
            try:
                self.jobs.receive(upload, conn.read_into)  # a broken connection ends here
            finally:
                conn.sock.settimeout(None)
            try:
                answer = Answer(request.rid, True, self.jobs.start(upload))
            except Exception as exc:
                answer = _failed(request.rid, exc)
        finally:
            self.jobs.release(upload)
        conn.send(answer.encode())

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
        conn.upgrade(new, key, self.endpoint.max_payload)
        caller = self._caller(new)
        if caller is None or not self.endpoint.adopt(conn, caller):
            raise ConnectionError("the session ended as it opened, or its tenant holds too many connections")
        self.rm.connected(new, True)
        return new


def _failed(rid: int, exc: Exception) -> Answer:
    """The answer to a job that could not be admitted or started (an unexpected failure is logged too)."""
    if not isinstance(exc, PathwaysError):
        log.exception("resource manager: a job could not be admitted or started")
    return Answer(rid, False, list(to_wire(exc)))


def _refuse_unread(conn: Connection, nbytes: int) -> None:
    """End a connection whose announced data was refused unread, so that its client still reads the refusal: stop
    sending (the client reads the answer, then the end), then drop what it still sends, into a small buffer and for
    at most ``LINGER_S`` seconds (closing at once could reset the connection before the answer is read). Raises
    ConnectionError: the connection is over."""
    sock = conn.sock
    scratch = bytearray(64 << 10)
    deadline = time.monotonic() + LINGER_S
    try:
        sock.shutdown(socket.SHUT_WR)
        while nbytes > 0 and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            n = sock.recv_into(scratch, min(nbytes, len(scratch)))
            if not n:
                break
            nbytes -= n
    except OSError:
        pass
    raise ConnectionError("refused a job's archive before reading it")
