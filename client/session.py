"""The client session: the connection to the runtime, the tenant it proved, and the ids this client mints.

``pw.init`` makes one per process; every other call finds it with ``current()``. The session talks to the
runtime only through its protocol (``client.link``): one connection to the resource manager, which opened the
session and stands for this client being alive, and one to each island host it uses. Its options are fixed at
init: there is no global configuration to mutate.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

from client import attach, waiting
from client.islands import Islands
from client.link import Link, LinkClosed, expect_role
from client.outbox import Outboxes
from client.parked import ParkedWindow
from client.runtime import (
    DEFAULT_TENANT,
    Embedded,
    Timeouts,
    find_address,
    home,
    load_login,
    not_a_runtime,
    ray_cluster,
)
from client.suspension import RUNNING, Gate, suspended_error
from pathways import auth
from pathways.errors import ClusterSuspendedError, IslandFailedError, PathwaysError, ResourceError, TenantAccessError
from pathways.events import EventLog
from pathways.messages import CLIENT_ID_BITS, Call, Free
from pathways.names import CREDENTIAL_ENV, JOB_ENV, TENANT_ENV, TICKET_FD_ENV
from pathways.requests import Close, HostStats, Position, Quiesced, Renew, Stalled, Suspect, Usage, Watch
from pathways.topology import Topology

RENEW_S = 5.0  # how often the session is renewed (and islands' restarts learned)
STOP_SENDING_S = 2.0  # a suspend gives attached clients 5 s to say they stopped sending: calls under way, then
DRAIN_S = 2.5  # what they hold
log = logging.getLogger(__name__)


def credential_file(tenant: str) -> Path:
    """Where ``pw.init`` looks for a tenant's credential: ``$PATHWAYS_HOME/credentials/TENANT``."""
    return home() / "credentials" / tenant


class Session:
    """A client's session: attached to the runtime at ``address``, as ``tenant``.

    It holds what every other client module needs: the link to the resource manager, the island table with the
    links to the islands' hosts (``client.islands``, renewed when an island restarts), the buffer ids this
    client mints, the outboxes that carry its messages to each island in order, the batcher that frees dropped
    arrays, and its event log for ``pw.trace``.
    """

    def __init__(self, address: str, tenant: str, timeouts: Timeouts, credential: str | None = None,
                 ticket: str | None = None, admin_credential: str | None = None,
                 embedded: Embedded | None = None) -> None:
        self.address = address
        self.timeouts = timeouts
        self.admin_credential = admin_credential
        self.embedded = embedded
        self.closed = False
        self.gate = Gate()  # before the first link: its reader may report the link broken at once
        self.rm, reply = attach.open_session(address, tenant, timeouts, credential, ticket, embedded is not None,
                                             self._rm_broken)
        self.runtime = self.rm.identity.runtime
        self.client_id: int = reply["client"]
        self._key: bytes = reply["key"]
        self.tenant: str = reply["tenant"]
        self.weight: float = reply["weight"]
        self.budgets: dict = reply["budgets"]
        self.topology = Topology.from_wire(reply["topology"])
        self.islands = Islands(reply["islands"])
        self._next_id = 1
        self._id_lock = threading.Lock()
        self.slices: dict[str, Any] = {}
        self.outboxes = Outboxes(self, len(self.islands))
        self.frees = FreeBatcher(self)
        self.parked = ParkedWindow(self.budgets["parked_bytes"], timeouts.fetch)
        self.events = EventLog()
        self._stop = threading.Event()
        self._renewed = time.monotonic()
        threading.Thread(target=self._renew_loop, name="pathways-renew", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="pathways-watch", daemon=True).start()

    # -- ids ------------------------------------------------------------------------------------------------
    def mint(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive buffer ids; the first is returned. Ids never repeat in a cluster."""
        with self._id_lock:
            start = self._next_id
            self._next_id += n
        if self._next_id >= 1 << CLIENT_ID_BITS:
            raise PathwaysError("this client has minted all the buffer ids it can; start a new session")
        return (self.client_id << CLIENT_ID_BITS) | start

    # -- the resource manager -----------------------------------------------------------------------------
    def request(self, make: Any, what: str) -> Any:
        """A request to the resource manager (``make(rid)`` builds it); its answer's value."""
        try:
            return self.rm.call(make, self.timeouts.start)
        except LinkClosed as exc:
            raise PathwaysError(f"{what}: the connection to the runtime at {self.address} is gone ({exc}); "
                                "call pw.init() again once it is back") from None

    def _rm_broken(self, reason: str) -> None:
        if self.closed:
            return
        if self.gate.open:
            log.error("the connection to the runtime at %s ended (%s); this session is over", self.address, reason)
        else:
            log.warning("the suspended runtime at %s went away (%s); this client reattaches once it is resumed there "
                        "(for at most %.0fs, pw.Timeouts.reattach)", self.address, reason, self.timeouts.reattach)

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._renewed = time.monotonic()
                self.update_islands(self.rm.call(lambda rid: Renew(rid), self.timeouts.start)["islands"])
            except PathwaysError as exc:
                if not self.closed and self.gate.open:
                    log.warning("renewing the session failed: %s", exc)
                if not self.rm.alive and self.gate.open:
                    return

    # -- suspend and resume -------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        """Hear every change of the cluster's state (a suspend, a resume) from the resource manager at once."""
        seen = -1
        while not self._stop.is_set():
            rm = self.rm
            future = rm.start(lambda rid, seen=seen: Watch(rid, seen))
            try:
                while not future.done() and not self._stop.is_set():
                    futures_wait([future], timeout=RENEW_S)
                if self._stop.is_set():
                    return
                state = future.result()
            except PathwaysError:
                if self.closed or self.gate.open or not self._reattach():
                    return
                seen = -1
                continue
            seen = state["generation"]
            try:
                self._on_cluster(state)
            except Exception as exc:  # never let the watcher die silently
                log.error("following the cluster's state (%s) failed: %s", state.get("state"), exc)

    def _on_cluster(self, state: dict) -> None:
        phase = state["state"]
        if phase == "suspending":
            if self.gate.open:
                self._stop_sending(state["generation"])
        elif phase != RUNNING:
            self.gate.close(phase, 0.0)
            self.outboxes.pause()
        elif not self.gate.open:
            self._resumed(state["islands"])
        else:
            self.update_islands(state["islands"])

    def _stop_sending(self, generation: int) -> None:
        """The admin suspends the cluster: let the calls under way finish, send what is held, hold the rest, and
        tell the resource manager this client is quiet."""
        finished = self.gate.close("suspending", STOP_SENDING_S)
        self.frees.flush()
        drained = self.outboxes.drain(DRAIN_S, skip=set(self.islands.dead))
        self.outboxes.pause()
        if not finished or not drained:
            log.warning("the cluster is being suspended and this client could not finish sending in time; what it "
                        "still held is sent after the resume")
        try:
            self.rm.start(lambda rid: Quiesced(rid, generation))
        except PathwaysError as exc:
            log.info("could not tell the resource manager this client stopped sending: %s", exc)

    def _reattach(self) -> bool:
        """The suspended runtime's resource manager went away: connect to its address again (a resume on a new
        cluster serves this session's key there) until it answers or ``timeouts.reattach`` passes."""
        rm = attach.reattach(self.address, self.client_id, self._key, self.timeouts.reattach, self._stop,
                             self._rm_broken)
        if rm is not None:
            self.rm, self.runtime = rm, rm.identity.runtime
        return rm is not None

    def _resumed(self, islands: list[dict]) -> None:
        """The cluster runs again, with new hosts: connect to them, send again from where each island's order
        stands, and let calls go on."""
        for info in islands:
            k = info["index"]
            if not self.islands.resumed(info):
                self.outboxes.restart(k)  # another island than the one saved: this client's buffers are gone
                continue
            try:
                position = self._connect(k, 0).call(lambda rid: Position(rid), self.timeouts.start)
            except PathwaysError as exc:
                log.error("island %d did not say where this client's messages resume (%s)", k, exc)
                self.outboxes.restart(k)
                self.island_failed(k, str(exc))
                continue
            self.outboxes.resume(k, int(position))
        self.gate.reopen()
        log.warning("the cluster was resumed; this client goes on")

    def update_islands(self, islands: list[dict]) -> None:
        """What the resource manager says of the islands now: an island whose epoch grew restarted, with new
        hosts (this client's buffers there are lost); one marked unhealthy is dead here too."""
        for info in islands:
            restarted = self.islands.restarted(info)
            if restarted:
                self.outboxes.restart(info["index"])
            self.islands.judge(info, restarted)

    # -- islands --------------------------------------------------------------------------------------------
    def link(self, island: int, host: int) -> Link:
        """The connection to host ``host`` of ``island`` (made on first use); ClusterSuspendedError while the
        cluster is suspended."""
        found = self.islands.live_link(island, host)
        if found is not None:
            return found
        if not self.gate.open:
            raise suspended_error(f"reaching island {island}", self.gate.phase)
        return self._connect(island, host)

    def _connect(self, island: int, host: int) -> Link:
        found = self.islands.live_link(island, host)
        if found is not None:
            return found
        info, epoch = self.islands.target(island, host)
        self._check_serving(island)
        try:
            made = Link(info["client"], self.client_id, self._key,
                        expect_role(self.runtime, "host", island, host, epoch), f"island {island} host {host}",
                        lambda reason, i=island, h=host: self.island_failed(i, f"host {h}: {reason}"))
        except PathwaysError as exc:
            self.island_failed(island, f"host {host}: {exc}")
            raise IslandFailedError(f"island {island} host {host} cannot be reached: {exc}") from None
        return self.islands.adopt(island, host, epoch, made)

    def submit(self, island: int, payload: bytes | Call) -> None:
        """Hand one message to an island's scheduler without waiting for it (in order; see ``client.outbox``)."""
        self._check_serving(island)
        self.outboxes.put(island, payload)

    def _check_serving(self, island: int) -> None:
        if island in self.islands.dead and not self.refresh(island):
            raise IslandFailedError(f"island {island} has failed ({self.islands.dead[island]}); it has not "
                                    "restarted yet")

    def upload(self, island: int, host: int, payload: bytes, data: Sequence[Any]) -> None:
        """Send a put's value (this host's shards) straight to the host that will hold them."""
        try:
            self.link(island, host).send(payload, data)
        except LinkClosed as exc:
            raise IslandFailedError(f"island {island} host {host}: {exc}") from None

    def ask(self, island: int, host: int, make: Any, sink: Any = None) -> Future:
        """Send a request to a host; the future of its answer (IslandFailedError if the host is gone)."""
        try:
            return self.link(island, host).start(make, sink=sink)
        except (IslandFailedError, ClusterSuspendedError) as exc:
            future: Future = Future()
            future.set_exception(exc)
            return future

    def usage(self, island: int, host: int = 0, reset_peak: bool = False) -> dict:
        """This tenant's buffers, bytes and peak bytes on one host (``reset_peak``: the peak starts again
        from now), and its executables there. Peaks measure a step's memory: reset, run, read."""
        return self.wait([self.ask(island, host, lambda rid: Usage(rid, reset_peak))], frozenset({island}),
                         self.timeouts.fetch, f"usage on island {island}")[0]

    def host_stats(self, island: int, host: int = 0) -> dict:
        """Counters of one host (which name no tenant)."""
        return self.wait([self.ask(island, host, lambda rid: HostStats(rid))], frozenset({island}),
                         self.timeouts.fetch, f"counters of island {island} host {host}")[0]

    def epoch(self, island: int) -> int:
        """How many times ``island`` had restarted when this client last looked."""
        return self.islands[island].epoch

    def refresh(self, island: int) -> bool:
        """Whether ``island`` serves (it has not failed, or restarted since): asks the resource manager."""
        self._renewed = time.monotonic()
        try:
            self.update_islands(self.rm.call(lambda rid: Renew(rid), self.timeouts.poll * 10)["islands"])
        except PathwaysError:
            return False
        return island not in self.islands.dead

    def island_failed(self, island: int, reason: str) -> None:
        """This client saw ``island`` fail: stop sending to it, and ask the resource manager to check it. (While
        the cluster is suspended its hosts stop on purpose.)"""
        if island in self.islands.dead or self.closed or not self.gate.open:
            return
        self.islands.dead[island] = reason
        try:
            self.rm.start(lambda rid: Suspect(rid, island, reason[:500]))
        except PathwaysError:
            pass

    def check_islands(self, islands: frozenset[int]) -> None:
        """Raise IslandFailedError if one of ``islands`` failed (its connection broke, or the resource manager,
        asked at most once per poll interval, says so) and has not restarted; ClusterSuspendedError if the
        cluster is suspended."""
        if not self.gate.open:
            raise suspended_error("waiting for a result", self.gate.phase)
        if time.monotonic() - self._renewed > self.timeouts.poll:
            self.refresh(-1)
        for i in sorted(islands):
            if i in self.islands.dead and not self.refresh(i):
                raise IslandFailedError(f"island {i} has failed: {self.islands.dead[i]}")

    # -- waiting ------------------------------------------------------------------------------------------
    def wait(self, futures: list[Future], islands: frozenset[int], timeout: float | None, what: str) -> list:
        """The futures' results, raising IslandFailedError as soon as an island they depend on fails, or after
        ``timeout`` (the fetch timeout by default; see ``client.waiting``)."""
        timeout = self.timeouts.fetch if timeout is None else timeout
        return waiting.results(futures, timeout, self.timeouts.poll, what, lambda: self.check_islands(islands),
                               lambda: self._timed_out(what, timeout, islands))

    def _timed_out(self, what: str, timeout: float, islands: frozenset[int]) -> IslandFailedError:
        """The timeout error, saying where this tenant's unfinished fragments on ``islands`` stopped."""
        reports = [self.ask(i, h, lambda rid: Stalled(rid)) for i in sorted(islands)
                   for h in range(len(self.islands[i].hosts))]
        return waiting.timed_out(what, timeout, islands, reports, self.timeouts.poll)

    def flush(self, timeout: float | None = None) -> None:
        """Send every message this client still holds back (see ``client.outbox``), waiting at most
        ``timeout`` seconds (the op timeout by default) for them to leave."""
        self.frees.flush()
        if not self.outboxes.drain(self.timeouts.op if timeout is None else timeout, skip=set(self.islands.dead)):
            raise IslandFailedError("the islands did not take this client's messages in time")

    # -- teardown -----------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """End the session: free every buffer of this client on the islands, flush what is held, and tell the
        resource manager, which releases the client's slices. Idempotent. ``wait``: also wait for an embedded
        cluster to stop (at interpreter exit it stops by itself once this process is gone)."""
        if self.closed:
            return
        self.frees.stop()
        for island in self.islands:
            if island.index not in self.islands.dead:
                self.outboxes.put(island.index, Free((), everything=True).encode())
        self.outboxes.close(self.timeouts.op, skip=set(self.islands.dead))
        self.closed = True
        self._stop.set()
        try:
            self.rm.call(lambda rid: Close(rid), self.timeouts.poll * 10)
        except PathwaysError as exc:
            log.info("could not close the session at the resource manager: %s", exc)
        self.islands.close()
        self.rm.close()
        if self.embedded is not None:
            self.embedded.stop(30.0 if wait else 0.0)


class FreeBatcher:
    """Collects ids of garbage-collected arrays and frees them in batches, in order with fragments.

    Frees ride on the island's next fragment; a background flush sends the rest every ``interval`` seconds.
    ``add`` only appends to a deque, so it is safe from ``__del__`` in any thread.
    """

    def __init__(self, session: Session, interval: float = 0.1) -> None:
        self._session = session
        self._pending = [deque() for _ in session.islands]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="pathways-frees", daemon=True)
        self._thread.start()

    def add(self, island: int, buffer_id: int) -> None:
        """Free ``buffer_id`` on ``island`` with the next batch; safe from any thread."""
        self._pending[island].append(buffer_id)

    def take(self, island: int) -> list[int]:
        """Every id waiting to be freed on ``island`` (they ride on the caller's next message there)."""
        q = self._pending[island]
        out = []
        while q:
            out.append(q.popleft())
        return out

    def flush(self) -> None:
        """Send every island's waiting frees now, as one Free message per island."""
        for island in range(len(self._pending)):
            ids = self.take(island)
            if ids and island not in self._session.islands.dead:
                self._session.submit(island, Free(tuple(ids)).encode())

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.flush()
            except Exception as exc:  # never let the flusher die silently
                log.warning("freeing buffers failed: %s", exc)

    def stop(self) -> None:
        """Stop the background flush, after one last flush."""
        self._stop.set()
        self.flush()


_session: Session | None = None
_lock = threading.Lock()


def current() -> Session:
    """The open session of this process; PathwaysError before ``pw.init`` or after ``pw.shutdown``."""
    if _session is None or _session.closed:
        raise PathwaysError("pathways is not initialized; call pw.init() first")
    return _session


def init(topology: Topology | None = None, address: str | None = None, *, tenant: str | None = None,
         credential: str | None = None, timeouts: Timeouts | None = None,
         default_quota: int | None = None) -> Session:
    """Attach to a runtime (or start one of this client's own) and open this process's session. Idempotent: a
    second call returns the same session.

    Args:
        topology: the islands of a runtime this call starts (``pw.Topology``; default 2 islands x 1 host x 4 CPU
            devices). Attaching to a running runtime, a given topology must equal its own.
        address: the runtime's address, ``pathways://HOST:PORT`` (what ``pathways up`` prints), never a Ray
            cluster's. Default: ``PATHWAYS_ADDRESS``, else the address ``pathways login`` saved, else (with no
            ``topology``) the runtime ``pathways up`` started on this machine. With none of these, this call starts
            a runtime of its own (and ``pw.shutdown``, or this process's end, stops it): on the running Ray cluster
            ``RAY_ADDRESS`` names (inside a Ray job, the job's cluster), its islands spread over the cluster's
            nodes; without ``RAY_ADDRESS``, on an embedded local Ray cluster.
        tenant: the tenant to act as (default ``PATHWAYS_TENANT``, else the saved login's, else ``"default"``:
            on this machine, after ``pathways up``, the admin's own tenant). On a runtime this call starts it is
            the one tenant and needs no credential.
        credential: the tenant's credential, issued by the cluster's admin (default ``PATHWAYS_CREDENTIAL``,
            else the saved login's, else the file ``$PATHWAYS_HOME/credentials/TENANT``, where ``pathways up``
            saves tenant ``default``'s for the admin). A job started with ``pathways submit`` instead holds a
            one-time ticket, which this call reads itself.
        timeouts: bounds on every wait (``pw.Timeouts``).
        default_quota: the device quota of new tenants, on a runtime this call starts.

    Weights, quotas and budgets come from the cluster's tenant registry, never from the client.

    Returns:
        The session. Other calls find it themselves; ``pw.shutdown`` closes it.

    Raises:
        PathwaysError: nothing answers at the address, or what answers is not a pathways runtime (a Ray address
            says what to do instead); the runtime does not answer within ``timeouts.start``; ``RAY_ADDRESS`` is
            not a Ray cluster's HOST:PORT; or ``topology``/``timeouts`` is of the wrong type.
        ResourceError: the running runtime has another topology; ``RAY_ADDRESS`` names a cluster that does not
            answer (within seconds); or the runtime this call starts could not start.
        TenantAccessError: there is no credential for ``tenant``, or the runtime refuses it.
    """
    global _session
    with _lock:
        if _session is not None and not _session.closed:
            return _session
        timeouts = timeouts or Timeouts()
        if not isinstance(timeouts, Timeouts):
            raise PathwaysError(f"timeouts must be a pw.Timeouts, got {type(timeouts).__name__}")
        if topology is not None and not isinstance(topology, Topology):
            raise PathwaysError(f"topology must be a pw.Topology, got {type(topology).__name__}")
        found, source = find_address(address, machine=topology is None)
        saved = load_login() if source.endswith("login.json") else None
        tenant = tenant or os.environ.get(TENANT_ENV) or (saved.tenant if saved else None) or DEFAULT_TENANT
        ticket = None if credential else _read_ticket()
        credential = (credential or os.environ.get(CREDENTIAL_ENV) or (saved.credential if saved else None)
                      or _read_credential(tenant))
        embedded = admin = None
        if found is None:
            ray_address = ray_cluster()
            admin, credential, ticket = auth.new_secret(), credential or auth.new_secret(), None
            embedded = Embedded(topology or Topology(), timeouts, admin, tenant, credential, default_quota,
                                ray_address)
            found = embedded.address
        elif credential is None and ticket is None and os.environ.get(JOB_ENV):
            raise TenantAccessError(f"job {os.environ[JOB_ENV]}'s ticket was already used: a job's ticket opens one "
                                    "session; keep the session the first pw.init() returned for the whole job")
        elif credential is None and ticket is None:
            _check_runtime(found, source)
            raise TenantAccessError(f"tenant {tenant!r} has no credential on this machine: ask the cluster's admin "
                                    f"for one (`pathways tenants add {tenant}` prints a `pathways login` command), "
                                    f"or pass pw.init(credential=...), set {CREDENTIAL_ENV}, or save it in "
                                    f"{credential_file(tenant)}")
        try:
            session = Session(found, tenant, timeouts, credential, ticket, admin, embedded)
        except BaseException as exc:
            if embedded is not None:
                embedded.stop()
            elif isinstance(exc, PathwaysError) and not isinstance(exc, TenantAccessError):
                _check_runtime(found, source)
            raise
        if topology is not None and session.topology != topology:
            session.close()
            raise ResourceError(f"the runtime at {found} runs {session.topology}; you asked for {topology}. Call "
                                "pw.init() without a topology to attach, or start a new cluster")
        _session = session
        atexit.register(_at_exit, session)
        return _session


def _check_runtime(address: str, source: str) -> None:
    """PathwaysError saying what to do where ``address`` (from ``source``) is not a pathways runtime's: a Ray
    address, or whatever else does not open with the pathways handshake."""
    reason = not_a_runtime(address)
    if reason is not None:
        raise PathwaysError(reason if source.startswith("pw.init") else f"{reason} (the address came from {source})")


def _at_exit(session: Session) -> None:
    """A process that ends without ``pw.shutdown`` still closes its session at once (instead of leaving it to the
    runtime's grace period), in bounded time."""
    if not session.closed:
        try:
            session.close(wait=False)
        except Exception:  # the interpreter is going away: never stop it from doing so
            pass


def _read_ticket() -> str | None:
    """A job's single-use ticket, from the pipe its runner left open (read once, then closed)."""
    fd = os.environ.pop(TICKET_FD_ENV, None)
    if not fd:
        return None
    try:
        with os.fdopen(int(fd), "rb") as pipe:
            return pipe.read(256).decode().strip() or None
    except (OSError, ValueError):
        return None


def _read_credential(tenant: str) -> str | None:
    path = credential_file(tenant)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def shutdown() -> None:
    """Close this process's session: free its buffers on the islands and release its slices; stop the
    embedded cluster if ``pw.init`` started one. A no-op without a session; ``pw.init`` may follow.

    Arrays and slices of the closed session can no longer be used.
    """
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    session.close()
