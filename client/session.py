"""The client session: the connection to the cluster, the tenant, and the ids this client mints.

``pw.init`` makes one per process (like ``ray.init``); every other call finds
it with ``current()``. Its options are fixed at init: there is no global
configuration to mutate.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from client.outbox import Outboxes
from pathways import wire
from pathways.errors import IslandFailedError, PathwaysError, ResourceError, from_wire
from pathways.events import EventLog
from pathways.names import CLIENT_ID_BITS, FETCH_TIMED_OUT, NAMESPACE, RESOURCE_MANAGER, host_name
from pathways.topology import Topology


@dataclass(frozen=True)
class Timeouts:
    """Bounds on every wait, in seconds."""

    fetch: float = 120.0  # a client waiting for a result
    op: float = 60.0  # a host waiting for an op's inputs (a transfer, a buffer)
    start: float = 300.0  # the cluster starting up
    poll: float = 1.0  # how often a long wait checks that the islands it depends on are alive


@dataclass
class IslandClient:
    index: int
    scheduler: Any  # host 0, which holds the island's scheduler
    hosts: list[Any]


class Session:
    def __init__(self, rm: Any, tenant: str, weight: float, timeouts: Timeouts, owns_ray: bool) -> None:
        self.rm = rm
        self.tenant = tenant
        self.weight = weight
        self.timeouts = timeouts
        self.owns_ray = owns_ray
        from resource_manager.lease import Lease

        # On this process's node: a lease on another node would die with that node and get us reclaimed.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.lease = ray.remote(Lease).options(num_cpus=0, namespace=NAMESPACE, scheduling_strategy=here).remote()
        reg = self.rm_call("register", "register", {"tenant": tenant, "pid": os.getpid(), "weight": weight},
                           self.lease)
        self.client_id: int = reg["client"]
        self.topology = Topology.from_wire(reg["topology"])
        hosts = [[ray.get_actor(host_name(i, h), namespace=NAMESPACE) for h in range(self.topology.hosts_per_island)]
                 for i in range(self.topology.islands)]
        self.islands = [IslandClient(i, hs[0], hs) for i, hs in enumerate(hosts)]
        # The first call to an actor resolves its handle (~0.5 s); pay that now, not on the first put.
        ray.get([i.scheduler.ping.remote() for i in self.islands], timeout=timeouts.start)
        self._counter = itertools.count(1)
        self._id_lock = threading.Lock()
        self.sent_exes: list[set[str]] = [set() for _ in self.islands]
        self.dead: dict[int, str] = {}
        self.slices: dict[str, Any] = {}
        self.outboxes = Outboxes([i.scheduler for i in self.islands], self.client_id)
        self.frees = FreeBatcher(self)
        self.events = EventLog()
        self.closed = False

    # -- ids ----------------------------------------------------------------------------------------
    def mint(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive buffer ids; the first is returned. Ids never repeat in a cluster."""
        with self._id_lock:
            start = next(self._counter)
            for _ in range(n - 1):
                next(self._counter)
        return (self.client_id << CLIENT_ID_BITS) | start

    # -- messages -----------------------------------------------------------------------------------
    def rm_call(self, method: str, kind: str, body: dict, *extra: Any) -> Any:
        payload = wire.encode(kind, body)
        try:
            raw = ray.get(getattr(self.rm, method).remote(payload, *extra), timeout=self.timeouts.start)
        except GetTimeoutError:
            raise PathwaysError(f"the resource manager did not answer {method} within "
                                f"{self.timeouts.start:.0f}s") from None
        except RayActorError as exc:
            raise PathwaysError(f"the resource manager is gone ({exc}); restart the cluster") from None
        msg = wire.decode(raw, "reply")
        if not msg["ok"]:
            raise from_wire(*msg["value"])
        return msg["value"]

    def submit(self, island: int, payload: bytes, refs: list | None = None) -> None:
        """Hand one message to an island's scheduler without waiting for it (in order; see ``client.outbox``)."""
        if island in self.dead:
            raise IslandFailedError(f"island {island} has failed ({self.dead[island]}); allocate a new slice")
        self.outboxes.put(island, payload, refs)

    def hosts_of(self, island: int, host_ids: Sequence[int]) -> list[Any]:
        return [self.islands[island].hosts[h] for h in host_ids]

    # -- waiting ------------------------------------------------------------------------------------
    def wait(self, refs: list, islands: frozenset[int], timeout: float | None, what: str) -> list:
        """ray.get with a deadline, raising IslandFailedError as soon as an island it depends on dies."""
        timeout = self.timeouts.fetch if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out(what, timeout, islands)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(self.timeouts.poll, remaining))
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
        refs = [host.stalled.remote(self.tenant) for host in hosts]
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
        """Ping every host of ``islands``; a dead one marks its island failed everywhere and raises."""
        for i in sorted(islands):
            if i in self.dead:
                raise IslandFailedError(f"island {i} has failed: {self.dead[i]}")
        pings = {(i, h): host.ping.remote() for i in islands for h, host in enumerate(self.islands[i].hosts)}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=self.timeouts.poll)
        for (i, h), ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except Exception as exc:  # the actor is dead or unreachable
                self.island_failed(i, f"host {h} died ({type(exc).__name__})")
                raise IslandFailedError(f"island {i} failed: host {h} died") from None

    def island_failed(self, island: int, reason: str) -> None:
        if island in self.dead:
            return
        self.dead[island] = reason
        self.rm.mark_unhealthy.remote(wire.encode("unhealthy", {"island": island, "reason": reason}))
        for other in self.islands:
            if other.index != island and other.index not in self.dead:
                for host in other.hosts:
                    host.island_failed.remote(island)

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.frees.stop()
        for island in self.islands:
            if island.index not in self.dead:
                self.submit(island.index, wire.encode("free", {"tenant": self.tenant, "client": self.client_id,
                                                               "ids": [], "everything": True}))
        self.outboxes.close(self.timeouts.op, skip=set(self.dead))
        try:
            self.rm_call("unregister", "unregister", {"client": self.client_id})
        except PathwaysError as exc:
            logging.getLogger(__name__).warning("could not unregister from the resource manager: %s", exc)


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
        self._pending[island].append(buffer_id)

    def take(self, island: int) -> list[int]:
        q = self._pending[island]
        out = []
        while q:
            out.append(q.popleft())
        return out

    def flush(self) -> None:
        for island in range(len(self._pending)):
            ids = self.take(island)
            if ids and island not in self._session.dead:
                s = self._session
                s.submit(island, wire.encode("free", {"tenant": s.tenant, "client": s.client_id, "ids": ids}))

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.flush()
            except Exception as exc:  # never let the flusher die silently
                logging.getLogger(__name__).warning("freeing buffers failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self.flush()


_session: Session | None = None
_lock = threading.Lock()


def current() -> Session:
    if _session is None or _session.closed:
        raise PathwaysError("pathways is not initialized; call pw.init() first")
    return _session


def init(topology: Topology | None = None, address: str | None = None, *, tenant: str | None = None,
         weight: float = 1.0, timeouts: Timeouts | None = None, default_quota: int | None = None) -> Session:
    """Connect to (or start) a cluster. Idempotent: a second call returns the same session.

    With no address and no ``RAY_ADDRESS``, starts an embedded local Ray instance
    with ``topology``; with ``address="auto"`` (or ``RAY_ADDRESS``) attaches to that
    cluster and to the resource manager already running there (giving ``topology``
    starts one on that cluster if none runs yet). ``default_quota`` caps each tenant's
    devices on a runtime this call starts.
    """
    global _session
    with _lock:
        if _session is not None and not _session.closed:
            return _session
        timeouts = timeouts or Timeouts()
        tenant = tenant or os.environ.get("PATHWAYS_TENANT") or "default"
        if "PATHWAYS_WEIGHT" in os.environ and weight == 1.0:
            weight = float(os.environ["PATHWAYS_WEIGHT"])
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        address = address or os.environ.get("RAY_ADDRESS")
        owns_ray = False
        if not ray.is_initialized():
            if address:
                _use_token_auth()
                ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
            else:
                ray.init(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING)
                owns_ray = True
        rm = _resource_manager(topology, timeouts, default_quota, may_create=not address or topology is not None)
        _session = Session(rm, tenant, weight, timeouts, owns_ray)
        return _session


def _use_token_auth() -> None:
    """Ray 2.60 clusters require token authentication, but only a process that *starts* a cluster turns it
    on for itself; an attaching process must opt in, or the GCS refuses it. Opt in when a token exists,
    with Ray's own helper (it also refreshes Ray's cached config), where this Ray version has one."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _resource_manager(topology: Topology | None, timeouts: Timeouts, default_quota: int | None,
                      may_create: bool) -> Any:
    from resource_manager.manager import ResourceManager

    if not may_create:
        try:
            ray.get_actor(RESOURCE_MANAGER, namespace=NAMESPACE)
        except ValueError:
            raise PathwaysError("no pathways runtime runs on this Ray cluster; start one with `pathways up "
                                "--address ADDR`, or pw.init(address=..., topology=pw.Topology(...))") from None
    wanted = topology or Topology()
    rm = ray.remote(ResourceManager).options(
        name=RESOURCE_MANAGER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_concurrency=1, resources={"node:__internal_head__": 0.001},  # the head outlives worker nodes
    ).remote(wanted.to_wire(), NAMESPACE, timeouts.op, timeouts.start, default_quota)
    try:
        raw = ray.get(rm.ready.remote(), timeout=timeouts.start)
    except GetTimeoutError:
        raise PathwaysError(f"the cluster did not start within {timeouts.start:.0f}s") from None
    except RayActorError as exc:
        raise ResourceError(f"the pathways runtime could not start: {exc}") from None
    msg = wire.decode(raw, "reply")
    if not msg["ok"]:
        raise from_wire(*msg["value"])
    running = Topology.from_wire(msg["value"]["topology"])
    if topology is not None and running != topology:
        raise ResourceError(f"the cluster already runs {running}; you asked for {topology}. "
                            "Call pw.init() without a topology to attach, or start a new cluster")
    return rm


def shutdown() -> None:
    """Free this client's buffers and slices; stop the embedded cluster if init started it."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    session.close()
    if session.owns_ray:
        ray.shutdown()
