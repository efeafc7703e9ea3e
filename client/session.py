"""The client session: the connection to the cluster, the tenant it proved, and the ids this client mints.

``pw.init`` makes one per process (like ``ray.init``); every other call finds
it with ``current()``. Its options are fixed at init: there is no global
configuration to mutate. The session's key (from the resource manager) signs
every message this client sends, so no other process can speak for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from client.jobs import CREDENTIAL_ENV, HOME_ENV, TENANT_ENV, TICKET_ENV, home  # noqa: F401 - HOME_ENV re-exported
from client.outbox import Outboxes
from client.runtime import Timeouts, connect, find_runtime, start_runtime
from pathways import auth, wire
from pathways.errors import IslandFailedError, PathwaysError, TenantAccessError, from_wire
from pathways.events import EventLog
from pathways.messages import CLIENT_ID_BITS, Free
from pathways.names import FETCH_TIMED_OUT, NAMESPACE
from pathways.ops import Limits
from pathways.topology import Topology

REFRESH_S = 1.0  # how often a client asks whether a failed island has restarted
RPC_GRACE_S = 5.0  # a host's answer may take this long beyond the wait it enforces
log = logging.getLogger(__name__)


def credential_file(tenant: str) -> Path:
    """Where ``pw.init`` looks for a tenant's credential: ``$PATHWAYS_HOME/credentials/TENANT``."""
    return home() / "credentials" / tenant


@dataclass
class IslandClient:
    """What a client knows of one island: its index, its host actors, and its epoch (restart count)."""

    index: int
    hosts: list[Any]
    epoch: int

    @property
    def scheduler(self) -> Any:  # host 0 holds the island's scheduler
        """The actor that takes this island's fragments: host 0 holds the island's scheduler."""
        return self.hosts[0]


class Session:
    """A client's session: proves its tenant once, then signs every message with the session key.

    It holds what every other client module needs: the resource manager's and the islands' actor handles
    (refreshed when an island restarts), the buffer ids this client mints, the outboxes that carry its
    messages to each island's scheduler in order, the batcher that frees dropped arrays, and its event log
    for ``pw.trace``. ``pw.init`` creates the one per process; ``current()`` finds it.
    """

    def __init__(self, rm: Any, tenant: str, timeouts: Timeouts, owns_ray: bool, credential: str | None = None,
                 ticket: str | None = None, admin_credential: str | None = None) -> None:
        self.rm = rm
        self.timeouts = timeouts
        self.owns_ray = owns_ray
        self.admin_credential = admin_credential
        from resource_manager.lease import Lease

        # On this process's node: a lease on another node would die with that node and get us reclaimed.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.lease = ray.remote(Lease).options(num_cpus=0, namespace=NAMESPACE, scheduling_strategy=here).remote()
        body = {"tenant": tenant, "pid": os.getpid(), "job": os.environ.get("RAY_JOB_SUBMISSION_ID", "")}
        body.update({"ticket": ticket} if ticket else {"credential": credential})
        try:
            raw, handles = ray.get(rm.open_session.remote(wire.encode("open", body), self.lease),
                                   timeout=timeouts.start)
        except GetTimeoutError:
            raise PathwaysError(f"the resource manager did not answer within {timeouts.start:.0f}s") from None
        except RayActorError as exc:
            raise PathwaysError(f"the resource manager is gone ({exc}); restart the cluster") from None
        reply = _value(raw)
        self.client_id: int = reply["client"]
        self._key: bytes = reply["key"]
        self.tenant: str = reply["tenant"]
        self.weight: float = reply["weight"]
        self.topology = Topology.from_wire(reply["topology"])
        self.host_info = [isl["hosts"] for isl in reply["islands"]]
        self.islands = [IslandClient(i["index"], hosts, i["epoch"]) for i, hosts in zip(reply["islands"], handles)]
        # The first call to an actor resolves its handle, which is slow; pay that now, not on the first put.
        ray.get([i.scheduler.ping.remote() for i in self.islands if reply["islands"][i.index]["healthy"]],
                timeout=timeouts.start)
        self._next_id = 1
        self._id_lock = threading.Lock()
        self.sent_exes: list[set[str]] = [set() for _ in self.islands]
        self.dead: dict[int, str] = {}
        self._refreshed = [0.0 for _ in self.islands]
        self.slices: dict[str, Any] = {}
        self.outboxes = Outboxes([i.scheduler for i in self.islands], self.client_id, self.sign)
        self.frees = FreeBatcher(self)
        self.events = EventLog()
        self._trace_token: int | None = None
        self.closed = False

    # -- ids and signatures -------------------------------------------------------------------------------
    def mint(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive buffer ids; the first is returned. Ids never repeat in a cluster."""
        with self._id_lock:
            start = self._next_id
            self._next_id += n
        if self._next_id >= 1 << CLIENT_ID_BITS:
            raise PathwaysError("this client has minted all the buffer ids it can; start a new session")
        return (self.client_id << CLIENT_ID_BITS) | start

    def sign(self, purpose: str, *parts: Any) -> bytes:
        """This session's signature over a message (``pathways.auth.sign`` under the session key)."""
        return auth.sign(self._key, purpose, *parts)

    # -- messages -----------------------------------------------------------------------------------------
    def request(self, kind: str, body: dict) -> Any:
        """A signed request to the resource manager (allocate, release, close, state, suspect)."""
        payload = wire.encode(kind, body)
        return self._rm(self.rm.request.remote(self.client_id, payload, self.sign("rm", payload)), kind)

    def _rm(self, ref: Any, what: str) -> Any:
        try:
            raw = ray.get(ref, timeout=self.timeouts.start)
        except GetTimeoutError:
            raise PathwaysError(f"the resource manager did not answer {what} within "
                                f"{self.timeouts.start:.0f}s") from None
        except RayActorError as exc:
            raise PathwaysError(f"the resource manager is gone ({exc}); restart the cluster") from None
        return _value(raw)

    def submit(self, island: int, payload: bytes, refs: list | None = None) -> None:
        """Hand one message to an island's scheduler without waiting for it (in order; see ``client.outbox``)."""
        if island in self.dead and not self.refresh(island):
            raise IslandFailedError(f"island {island} has failed ({self.dead[island]}); it has not restarted yet")
        self.outboxes.put(island, payload, refs)

    def hosts_of(self, island: int, host_ids: Sequence[int]) -> list[Any]:
        """The actors of hosts ``host_ids`` of ``island``."""
        return [self.islands[island].hosts[h] for h in host_ids]

    def usage(self, island: int, host: int = 0, reset_peak: bool = False) -> dict:
        """This tenant's buffers, bytes and peak bytes on one host (``reset_peak``: the peak starts again
        from now), and its executables there. Peaks measure a step's memory: reset, run, read."""
        mac = self.sign("usage", int(reset_peak))
        return ray.get(self.islands[island].hosts[host].usage.remote(self.client_id, mac, reset_peak),
                       timeout=self.timeouts.fetch)

    def epoch(self, island: int) -> int:
        """How many times ``island`` had restarted when this client last looked."""
        return self.islands[island].epoch

    def limits(self, island: int) -> Limits:
        """What a host of ``island`` can hold (from the resource manager): arrays larger are refused here."""
        hosts = self.host_info[island]
        return Limits(island, self.topology.islands, self.topology.hosts_per_island, self.topology.devices_per_host,
                      min(h["memory_bytes"] for h in hosts), min(h["device_bytes"] for h in hosts))

    # -- islands that fail and restart --------------------------------------------------------------------
    def refresh(self, island: int) -> bool:
        """Whether ``island`` has restarted since it failed here; if so, talk to its new hosts from now on."""
        now = time.monotonic()
        if now - self._refreshed[island] < REFRESH_S:
            return island not in self.dead
        self._refreshed[island] = now
        try:
            raw, handles = ray.get(self.rm.hosts.remote(self.client_id, self.sign("hosts")),
                                   timeout=self.timeouts.poll * 10)
            epochs = _value(raw)
        except Exception:  # the resource manager is busy or gone: the island counts as failed for now
            return False
        for k, (epoch, hosts) in enumerate(zip(epochs, handles)):
            if epoch > self.islands[k].epoch:
                self.islands[k] = IslandClient(k, hosts, epoch)
                self.sent_exes[k] = set()  # the new hosts have none of the executables
                self.outboxes.replace(k, hosts[0])
                self.dead.pop(k, None)
        return island not in self.dead

    # -- waiting ------------------------------------------------------------------------------------------
    def wait(self, refs: list, islands: frozenset[int], timeout: float | None, what: str) -> list:
        """ray.get with a deadline, raising IslandFailedError as soon as an island it depends on dies.

        The hosts enforce ``timeout`` themselves (a value that is there returns even with 0); this side
        allows the calls ``RPC_GRACE_S`` more to come back."""
        timeout = self.timeouts.fetch if timeout is None else timeout
        deadline = time.monotonic() + timeout + RPC_GRACE_S
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(self.timeouts.poll,
                                                                                          remaining)))
            if pending and time.monotonic() >= deadline:
                raise self._timed_out(what, timeout, islands)
            if pending:
                self.check_islands(islands)
        out = []
        for ref in refs:
            try:
                value = ray.get(ref)
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, PathwaysError):
                    raise cause.with_traceback(None) from None
                raise PathwaysError(f"{what} failed on the island: {exc}") from None
            except RayActorError as exc:
                self.check_islands(islands)
                raise IslandFailedError(f"{what} failed: a host died ({type(exc).__name__})") from None
            if isinstance(value, str) and value == FETCH_TIMED_OUT:
                raise self._timed_out(what, timeout, islands)
            out.append(value)
        return out

    def _timed_out(self, what: str, timeout: float, islands: frozenset[int]) -> IslandFailedError:
        """The timeout error, saying where this tenant's unfinished fragments on ``islands`` stopped."""
        hosts = [host for i in sorted(islands) for host in self.islands[i].hosts]
        mac = self.sign("stalled")
        refs = [host.stalled.remote(self.client_id, mac) for host in hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeouts.poll)
        lines = []
        for ref in refs:
            if ref not in ready:
                continue
            try:
                report = ray.get(ref, timeout=0)
            except Exception:  # the host is gone: the health check says so, not this message
                continue
            where = f"island {report['island']} host {report['host']}"
            for run in report["runs"]:
                missing = run["missing"]
                waits = (f"waits for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         if missing else "is running")
                op = run["kind"] if run["name"] == run["kind"] else f"{run['kind']} {run['name']}"
                lines.append(f"{where}: program {run['program']!r} (sequence {run['seq']}) at op {run['op']} ({op}) "
                             f"{waits}")
            if report["held"]:
                lines.append(f"{where}: {report['held']} messages wait for an earlier one to arrive")
        detail = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
        return IslandFailedError(f"{what} timed out after {timeout:.1f}s; islands {sorted(islands)} are alive but "
                                 f"did not produce it (overloaded or stuck)" + (f": {detail}" if detail else ""))

    def check_islands(self, islands: frozenset[int]) -> None:
        """Ping every host of ``islands``; a dead one marks its island failed here and raises."""
        for i in sorted(islands):
            if i in self.dead and not self.refresh(i):
                raise IslandFailedError(f"island {i} has failed: {self.dead[i]}")
        pings = {(i, h): host.ping.remote() for i in islands for h, host in enumerate(self.islands[i].hosts)}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=self.timeouts.poll)
        for (i, h), ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except Exception as exc:  # the actor is dead or unreachable, or its host can no longer run
                reason = str(exc.cause) if isinstance(exc, RayTaskError) and exc.cause else type(exc).__name__
                self.island_failed(i, f"host {h}: {reason}")
                raise IslandFailedError(f"island {i} failed: host {h}: {reason}") from None

    def island_failed(self, island: int, reason: str) -> None:
        """This client saw ``island`` fail: stop sending to it, and ask the resource manager to check it."""
        if island in self.dead:
            return
        self.dead[island] = reason
        self._refreshed[island] = time.monotonic()
        payload = wire.encode("suspect", {"island": island, "reason": reason[:500]})
        self.rm.request.remote(self.client_id, payload, self.sign("rm", payload))

    def flush(self, timeout: float | None = None) -> None:
        """Send every message this client still holds back (see ``client.outbox``), waiting at most
        ``timeout`` seconds (the op timeout by default) for the islands to take them."""
        self.frees.flush()
        if not self.outboxes.drain(self.timeouts.op if timeout is None else timeout, skip=set(self.dead)):
            raise IslandFailedError("the islands did not take this client's messages in time")

    # -- teardown -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session: free every buffer of this client on the islands, flush what is held, and tell the
        resource manager, which releases the client's slices. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.frees.stop()
        for island in self.islands:
            if island.index not in self.dead:
                self.outboxes.put(island.index, Free((), everything=True).encode(), None)
        self.outboxes.close(self.timeouts.op, skip=set(self.dead))
        try:
            self.request("close", {})
        except PathwaysError as exc:
            log.warning("could not close the session at the resource manager: %s", exc)


def _value(raw: bytes) -> Any:
    msg = wire.decode(raw, "reply")
    if not msg["ok"]:
        raise from_wire(*msg["value"])
    return msg["value"]


class FreeBatcher:
    """Collects ids of garbage-collected arrays and frees them in batches, in order with fragments.

    Frees ride on the island's next fragment; a background flush sends the rest
    every ``interval`` seconds. ``add`` only appends to a deque, so it is safe
    from ``__del__`` in any thread.
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
            if ids and island not in self._session.dead:
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
_started: dict[str, tuple[str, str, str]] = {}  # runtimes this process started: (admin, tenant, credential)


def current() -> Session:
    """The open session of this process; PathwaysError before ``pw.init`` or after ``pw.shutdown``."""
    if _session is None or _session.closed:
        raise PathwaysError("pathways is not initialized; call pw.init() first")
    return _session


def init(topology: Topology | None = None, address: str | None = None, *, tenant: str | None = None,
         credential: str | None = None, timeouts: Timeouts | None = None,
         default_quota: int | None = None) -> Session:
    """Connect to (or start) a cluster and open this process's session. Idempotent: a second call returns
    the same session.

    Args:
        topology: the islands to start (``pw.Topology``). With no ``address``, an embedded local Ray
            cluster is started with it (default: 2 islands x 1 host x 4 CPU devices); with an address,
            a runtime is started on that cluster only if none runs there yet. Where a runtime already
            runs, a given topology must equal the running one.
        address: a Ray cluster to attach to (``"host:port"`` or ``"auto"``; default ``RAY_ADDRESS``, else
            a live cluster recorded on this machine, else an embedded one this call starts).
        tenant: the tenant to act as (default ``PATHWAYS_TENANT``, else ``"default"``). On an embedded
            cluster this is its one implicit tenant and needs no credential.
        credential: the tenant's credential, issued by the cluster's admin (default
            ``PATHWAYS_CREDENTIAL``, else the file ``$PATHWAYS_HOME/credentials/TENANT``). A job started
            with ``pathways submit`` instead holds a one-time ticket (``PATHWAYS_TICKET``).
        timeouts: bounds on every wait (``pw.Timeouts``).
        default_quota: the device quota of new tenants, on a runtime this call starts.

    Weights and quotas come from the cluster's tenant registry, never from the client.

    Returns:
        The session. Other calls find it themselves; ``pw.shutdown`` closes it.

    Raises:
        PathwaysError: no Ray cluster answers at ``address``; the cluster runs no pathways runtime and no
            ``topology`` was given; the resource manager does not answer within ``timeouts.start``; or
            ``topology``/``timeouts`` is of the wrong type.
        ResourceError: the running runtime has another topology, or the runtime could not start.
        TenantAccessError: there is no credential for ``tenant``, or the resource manager refuses it.
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
        tenant = tenant or os.environ.get(TENANT_ENV) or "default"
        ticket = None if credential else os.environ.get(TICKET_ENV)
        credential = credential or os.environ.get(CREDENTIAL_ENV) or _read_credential(tenant)
        owns_ray = connect(address or os.environ.get("RAY_ADDRESS"))
        rm = find_runtime()
        admin = None
        if rm is None:
            if not owns_ray and topology is None:
                raise PathwaysError("no pathways runtime runs on this Ray cluster; start one with `pathways up "
                                    "--address ADDR`, or pw.init(address=..., topology=pw.Topology(...))")
            # This process starts the runtime: it is its admin, and its tenant is the implicit one.
            admin, credential, ticket = auth.new_secret(), credential or auth.new_secret(), None
            rm = start_runtime(topology or Topology(), timeouts, auth.digest(admin),
                               implicit={"tenant": tenant, "digest": auth.digest(credential)},
                               default_quota=default_quota)
            _started[rm._actor_id.hex()] = (admin, tenant, credential)
        else:
            if topology is not None:
                start_runtime(topology, timeouts, None)  # refuses a different running topology
            mine = _started.get(rm._actor_id.hex())
            if mine is not None:  # a runtime this process started: it stays its admin and implicit tenant
                admin = mine[0]
                if tenant == mine[1] and credential is None:
                    credential = mine[2]
        if credential is None and ticket is None:
            raise TenantAccessError(f"tenant {tenant!r} has no credential on this machine: ask the cluster's admin "
                                    f"for one (`pathways tenants add {tenant}`), then pass pw.init(credential=...), "
                                    f"set {CREDENTIAL_ENV}, or save it in {credential_file(tenant)}")
        _session = Session(rm, tenant, timeouts, owns_ray, credential, ticket, admin)
        return _session


def _read_credential(tenant: str) -> str | None:
    path = credential_file(tenant)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def shutdown() -> None:
    """Close this process's session: free its buffers on the islands and release its slices; stop the
    embedded Ray instance if ``pw.init`` started it. A no-op without a session; ``pw.init`` may follow.

    Arrays and slices of the closed session can no longer be used.
    """
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    session.close()
    if session.owns_ray:
        ray.shutdown()
