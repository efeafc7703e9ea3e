"""Suspending the whole cluster into a directory, and resuming it there or on a new cluster of the same shape.

A suspend (``pathways suspend DIR``, or SIGTERM to the resource manager when ``pathways up --suspend-dir``
named one, as a preemption notice would send) goes in steps, each bounded in time:

1. Every attached client hears of it (``resource_manager.notices``), finishes the program call it is
   dispatching, sends what it holds, and says so; new calls wait in the client (``pw.Timeouts.suspend``).
2. Each island's host 0 stops taking batches (a late one is answered "suspended" and sent again after the
   resume), and the islands finish what they were given.
3. Each host writes its part into ``DIR`` (``resource_manager.host.snapshot``); the resource manager then
   writes the manifest: sessions and their keys, slices, epochs, and every part with its size and checksum.
4. The islands stop. Sessions stay open: a client's calls fail with ClusterSuspendedError, or wait for the
   resume.

If any step fails (a host dies, an island stays busy past the timeout), nothing is written as a manifest, the
islands take batches again, and the admin gets the reason. A resume checks the manifest and every part's
size before it stops anything; it starts the islands at the epochs they had, reopens the sessions, and each
host checks every chunk it reads. If that fails, nothing restored is used: the islands stop again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from pathways.errors import PathwaysError
from pathways.snapshot import FORMAT, MANIFEST, Store, host_part
from pathways.topology import Topology
from resource_manager.fleet import Fleet
from resource_manager.health import IslandHealth
from resource_manager.island import stop_island
from resource_manager.notices import Notices
from resource_manager.phase import RESUMING, RUNNING, SUSPENDED, SUSPENDING, ClusterPhase
from resource_manager.sessions import Sessions
from resource_manager.slices import Slices

ACK_S = 5.0  # how long attached clients have to stop sending
POLL_S = 0.05
CALL_S = 30.0  # an ordinary call to a host
SAVE_BYTES_PER_S = 50e6  # the slowest store a save's timeout allows for, beyond the suspend's own timeout
log = logging.getLogger(__name__)


class Suspension:
    """The suspend and resume procedures, one at a time: they move the cluster's ``phase``, ask every host through
    ``fleet``, save and restore ``sessions`` and ``slices``, and tell watching clients through ``notices``.
    Its own state is where the cluster was suspended to, what the last procedure did, and which clients have
    stopped sending."""

    def __init__(self, phase: ClusterPhase, fleet: Fleet, health: IslandHealth, sessions: Sessions, slices: Slices,
                 notices: Notices) -> None:
        self._phase, self._fleet, self._health, self._notices = phase, fleet, health, notices
        self._sessions, self._slices = sessions, slices
        self.directory: str | None = None  # where the cluster is suspended to now (written under ``_busy``)
        self.last: dict | None = None  # what the last suspend or resume did (likewise)
        self._acks: set[int] = set()
        self._acked = threading.Condition()  # the lock of ``_acks``
        self._busy = threading.Lock()  # one suspend or resume at a time

    def acked(self, client: int, generation: int) -> None:
        """Client ``client`` has stopped sending for the suspend of ``generation``."""
        with self._acked:
            if generation == self._phase.generation:
                self._acks.add(client)
                self._acked.notify_all()

    def _set(self, phase: str) -> None:
        self._phase.move(phase)
        self._notices.changed()

    # -- suspend ------------------------------------------------------------------------------------------
    def suspend(self, directory: str, timeout: float) -> dict:
        """Save every tenant's arrays, sessions and executables into ``directory`` and stop the islands. Raises
        PathwaysError (with nothing saved, and the cluster running on) if any step fails."""
        if not self._busy.acquire(blocking=False):
            raise PathwaysError("a suspend or resume is already under way")
        try:
            return self._suspend(directory, float(timeout))
        finally:
            self._busy.release()

    def _suspend(self, directory: str, timeout: float) -> dict:
        started = time.monotonic()
        store = Store(directory)
        if self._phase.now != RUNNING:
            raise PathwaysError(f"the cluster is {self._phase.now}, not running: nothing to suspend")
        restarting = self._health.restarting()
        if restarting:
            raise PathwaysError(f"islands {sorted(restarting)} are restarting after a failure; suspend again "
                                "once they are back (pathways status)")
        store.prepare()
        with self._acked:
            self._acks = set()
        attached = self._sessions.attached()
        self._set(SUSPENDING)
        try:
            silent = self._wait_acks(attached, started + min(ACK_S, timeout / 4))
            self._call("quiesce", lambda i, k: (1,))
            held = self._wait_quiet(started + timeout)
            parts = self._call("save", lambda i, k: (store.location,), timeout + held / SAVE_BYTES_PER_S)
            manifest = self._manifest(parts, time.monotonic() - started)
            store.write_json(MANIFEST, manifest)
        except BaseException as exc:
            for island in self._fleet.islands():  # what the hosts that finished wrote
                for k in range(len(island.hosts)):
                    for name in host_part(island.index, k):
                        store.remove(name)
            try:
                self._call("quiesce", lambda i, k: (0,), tolerate=True)
            finally:
                self._set(RUNNING)
            reason = str(exc) if isinstance(exc, PathwaysError) else f"{type(exc).__name__}: {exc}"
            raise PathwaysError(f"suspending into {directory} failed: {reason}. Nothing was saved ({directory} holds "
                                "no manifest) and the cluster runs on") from None
        self._fleet.stop_all()
        self.directory = store.location
        seconds = time.monotonic() - started
        self.last = {"suspended": store.location, "seconds": seconds, "bytes": manifest["array_bytes"],
                     "buffers": manifest["buffers"], "sessions": len(manifest["sessions"]),
                     "clients_silent": sorted(silent)}
        self._set(SUSPENDED)
        log.warning("suspended into %s: %d buffers, %.3f GiB, %d sessions, in %.1fs", store.location,
                    manifest["buffers"], manifest["array_bytes"] / 2**30, len(manifest["sessions"]), seconds)
        return self.last

    def _wait_acks(self, attached: set[int], deadline: float) -> set[int]:
        """Wait until every attached client has stopped sending (or ``deadline``); the ones that did not."""
        with self._acked:
            while not attached <= self._acks and time.monotonic() < deadline:
                self._acked.wait(max(0.0, deadline - time.monotonic()))
            silent = attached - self._acks
        alive = silent & set(self._sessions.listing())
        if alive:
            log.warning("suspend: clients %s did not say they stopped sending within the time; their later "
                        "batches are answered 'suspended' and sent again after the resume", sorted(alive))
        return alive

    def _wait_quiet(self, deadline: float) -> int:
        """Wait until every island has run everything it was given (PathwaysError at ``deadline``); returns the
        bytes the hosts hold."""
        while True:
            reports = self._call("quiet", lambda i, k: ())
            busy = []
            for island in self._fleet.islands():
                mine = sorted((r for r in reports if r["island"] == island.index), key=lambda r: r["host"])
                order = mine[0].get("sequenced", 0)
                busy += [f"island {island.index} host {r['host']} ({r['busy']} runs or messages unfinished)"
                         for r in mine if not r["idle"] or r["next_seq"] != order]
            if not busy:
                return sum(r["bytes"] for r in reports)
            if time.monotonic() >= deadline:
                raise PathwaysError("the islands did not finish their work in time: " + "; ".join(busy[:4]))
            time.sleep(POLL_S)

    def _call(self, method: str, args: Any, timeout: float = CALL_S, tolerate: bool = False) -> list:
        return self._fleet.call(method, args, timeout, tolerate)

    def _manifest(self, parts: list[dict], seconds: float) -> dict:
        fleet = self._fleet
        return {"format": FORMAT, "written": time.time(), "seconds": seconds, "runtime": fleet.runtime_id,
                "topology": fleet.topology.to_wire(), "epochs": [i.epoch for i in fleet.islands()],
                "sessions": self._sessions.to_wire(), "allocations": self._slices.to_wire(), "parts": parts,
                "buffers": sum(p["buffers"] for p in parts), "array_bytes": sum(p["array_bytes"] for p in parts)}

    # -- resume -------------------------------------------------------------------------------------------
    def resume(self, directory: str, timeout: float) -> dict:
        """Restore the cluster saved in ``directory`` on this cluster, suspended or freshly started with the same
        topology. Raises PathwaysError, with nothing of it used, on failure."""
        if not self._busy.acquire(blocking=False):
            raise PathwaysError("a suspend or resume is already under way")
        try:
            return self._resume(directory, float(timeout))
        finally:
            self._busy.release()

    def _resume(self, directory: str, timeout: float) -> dict:
        started = time.monotonic()
        store = Store(directory)
        manifest = self._check(store)
        phase = self._phase.now
        fresh = phase == RUNNING
        sessions, slices = len(self._sessions.listing()), len(self._slices.listing())
        if fresh and (sessions or slices):
            raise PathwaysError(f"the cluster runs with {sessions} sessions and {slices} slices; resume into a "
                                "cluster that is suspended or freshly started (pathways down, pathways up, pathways "
                                "resume DIR)")
        if phase not in (RUNNING, SUSPENDED):
            raise PathwaysError(f"the cluster is {phase}; wait for that to finish")
        self._set(RESUMING)
        try:
            restored = self._restore(store, manifest, timeout)
        except BaseException as exc:
            self._fleet.stop_all()
            if fresh:  # a fresh cluster gets its empty islands back
                self._sessions.forget_restored()
                self._replace([self._fleet.restart(i, timeout, epoch=i.epoch) for i in self._fleet.islands()])
            self._set(RUNNING if fresh else SUSPENDED)
            reason = str(exc) if isinstance(exc, PathwaysError) else f"{type(exc).__name__}: {exc}"
            state = "runs on, empty" if fresh else "stays suspended"
            raise PathwaysError(f"resuming from {directory} failed: {reason}. Nothing of it is used and the cluster "
                                f"{state}") from None
        self.directory = None
        seconds = time.monotonic() - started
        self.last = {"resumed": store.location, "seconds": seconds, **restored}
        self._set(RUNNING)
        log.warning("resumed from %s: %d buffers, %.3f GiB, %d sessions, in %.1fs", store.location,
                    restored["buffers"], restored["bytes"] / 2**30, restored["sessions"], seconds)
        return self.last

    def _check(self, store: Store) -> dict:
        """The manifest, checked against this cluster and the parts' files, before anything is stopped."""
        if not store.exists(MANIFEST):
            raise PathwaysError(f"{store.location} holds no finished suspend (no {MANIFEST}): a suspend into it did "
                                "not finish, or it is another directory. Nothing was resumed")
        store.check_private()
        manifest = store.read_json(MANIFEST)
        if manifest.get("format") != FORMAT:
            raise PathwaysError(f"{store.location} was written in snapshot format {manifest.get('format')!r}; this "
                                f"runtime reads format {FORMAT}")
        saved = Topology.from_wire(manifest["topology"])
        if saved != self._fleet.topology:
            raise PathwaysError(f"{store.location} holds a cluster of {saved}; this one is {self._fleet.topology}. "
                                "Start one of the same topology to resume it")
        for part in manifest["parts"]:
            for name, size in ((part["data"], part["data_bytes"]), (part["index"], None)):
                if not store.exists(name) or (size is not None and store.size(name) != size):
                    raise PathwaysError(f"{store.location}/{name} is missing or not the size the manifest says; "
                                        "nothing was resumed")
        return manifest

    def _restore(self, store: Store, manifest: dict, timeout: float) -> dict:
        epochs = manifest["epochs"]
        new = []
        try:
            for island in self._fleet.islands():
                new.append(self._fleet.restart(island, timeout, epoch=epochs[island.index]))
        except BaseException:
            for island in new:
                stop_island(island)
            raise
        self._replace(new)
        dropped = self._sessions.restore(manifest["sessions"], manifest["allocations"])
        parts = {(p["island"], p["host"]): p for p in manifest["parts"]}
        held = sum(p["data_bytes"] for p in manifest["parts"])
        done = self._call("restore", lambda i, k: (store.location, json.dumps(parts[(i, k)], sort_keys=True)),
                          timeout + held / SAVE_BYTES_PER_S)
        return {"buffers": sum(d["buffers"] for d in done), "bytes": sum(d["array_bytes"] for d in done),
                "sessions": len(manifest["sessions"]) - len(dropped), "sessions_dropped": dropped,
                "buffers_dropped": sum(d["buffers_dropped"] for d in done)}


    def _replace(self, islands: list) -> None:
        """New hosts for every island, all in service."""
        self._health.reset()
        self._fleet.replace_all(islands)
