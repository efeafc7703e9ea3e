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

import ray

from pathways.errors import ClusterSuspendedError, PathwaysError
from pathways.snapshot import FORMAT, MANIFEST, Store, host_part
from pathways.topology import Topology
from resource_manager.island import restart_island, stop_island

RUNNING, SUSPENDING, SUSPENDED, RESUMING = "running", "suspending", "suspended", "resuming"
ACK_S = 5.0  # how long attached clients have to stop sending
POLL_S = 0.05
CALL_S = 30.0  # an ordinary call to a host
SAVE_BYTES_PER_S = 50e6  # the slowest store a save's timeout allows for, beyond the suspend's own timeout
log = logging.getLogger(__name__)


class Suspension:
    """The cluster's phase (running, suspending, suspended, resuming) and the suspend and resume procedures,
    over the resource manager ``rm`` (``resource_manager.manager``)."""

    def __init__(self, rm: Any) -> None:
        self.rm = rm
        self.phase = RUNNING
        self.generation = 0
        self.directory: str | None = None
        self.last: dict | None = None  # what the last suspend or resume did
        self._acks: set[int] = set()
        self._acked = threading.Condition()
        self._busy = threading.Lock()  # one suspend or resume at a time

    # -- what clients see ---------------------------------------------------------------------------------
    def refuse(self, what: str) -> None:
        """ClusterSuspendedError unless the cluster runs (``what`` needs islands that are up)."""
        if self.phase != RUNNING:
            raise ClusterSuspendedError(
                f"{what}: the cluster is {self.phase} by its admin. Arrays you hold are kept; once it is resumed "
                "(`pathways resume`), do this again")

    def acked(self, client: int, generation: int) -> None:
        """Client ``client`` has stopped sending for the suspend of ``generation``."""
        with self._acked:
            if generation == self.generation:
                self._acks.add(client)
                self._acked.notify_all()

    def _set(self, phase: str) -> None:
        with self.rm.lock:
            self.phase = phase
            self.generation += 1
        self.rm.notices.changed()

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
        rm = self.rm
        started = time.monotonic()
        store = Store(directory)
        if self.phase != RUNNING:
            raise PathwaysError(f"the cluster is {self.phase}, not running: nothing to suspend")
        if rm.restarting():
            raise PathwaysError(f"islands {sorted(rm.restarting())} are restarting after a failure; suspend again "
                                "once they are back (pathways status)")
        store.prepare()
        with self._acked:
            self._acks = set()
        attached = {c for c, s in rm.clients.items() if s.connections > 0}
        self._set(SUSPENDING)
        try:
            silent = self._wait_acks(attached, started + min(ACK_S, timeout / 4))
            self._call("quiesce", lambda i, k: (1,))
            held = self._wait_quiet(started + timeout)
            parts = self._call("save", lambda i, k: (store.location,), timeout + held / SAVE_BYTES_PER_S)
            manifest = self._manifest(parts, time.monotonic() - started)
            store.write_json(MANIFEST, manifest)
        except BaseException as exc:
            for island in rm.islands:  # what the hosts that finished wrote
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
        for island in rm.islands:
            stop_island(island)
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
        alive = {c for c in silent if c in self.rm.clients}
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
            for island in self.rm.islands:
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
        """``method`` on every host (``args(island, host)`` its arguments, signed for that host); the results in
        order, the first failure raised naming the host (left out with ``tolerate``)."""
        rm = self.rm
        calls = []
        for island in rm.islands:
            for k, actor in enumerate(island.hosts):
                a = args(island.index, k)
                calls.append((island.index, k, getattr(actor, method).remote(
                    rm.sign_for(island.index, k, method, *a), *a)))
        return call_all(calls, timeout, tolerate)

    def _manifest(self, parts: list[dict], seconds: float) -> dict:
        rm = self.rm
        with rm.lock:
            return {"format": FORMAT, "written": time.time(), "seconds": seconds, "runtime": rm.runtime_id,
                    "topology": rm.topology.to_wire(), "epochs": [i.epoch for i in rm.islands],
                    "sessions": rm.sessions_to_wire(), "allocations": rm.allocations_to_wire(), "parts": parts,
                    "buffers": sum(p["buffers"] for p in parts),
                    "array_bytes": sum(p["array_bytes"] for p in parts)}

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
        rm = self.rm
        started = time.monotonic()
        store = Store(directory)
        manifest = self._check(store)
        fresh = self.phase == RUNNING
        if fresh and (rm.clients or rm.inventory.allocations):
            raise PathwaysError(f"the cluster runs with {len(rm.clients)} sessions and "
                                f"{len(rm.inventory.allocations)} slices; resume into a cluster that is suspended "
                                "or freshly started (pathways down, pathways up, pathways resume DIR)")
        if self.phase not in (RUNNING, SUSPENDED):
            raise PathwaysError(f"the cluster is {self.phase}; wait for that to finish")
        self._set(RESUMING)
        try:
            restored = self._restore(store, manifest, timeout)
        except BaseException as exc:
            for island in rm.islands:
                stop_island(island)
            if fresh:  # a fresh cluster gets its empty islands back
                rm.forget_restored()
                rm.replace_islands([restart_island(rm.topology, i, rm.key, rm.runtime_id, rm.config.op_timeout,
                                                   rm.config.gap_timeout, timeout, epoch=i.epoch)
                                    for i in rm.islands])
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
        if saved != self.rm.topology:
            raise PathwaysError(f"{store.location} holds a cluster of {saved}; this one is {self.rm.topology}. Start "
                                "one of the same topology to resume it")
        for part in manifest["parts"]:
            for name, size in ((part["data"], part["data_bytes"]), (part["index"], None)):
                if not store.exists(name) or (size is not None and store.size(name) != size):
                    raise PathwaysError(f"{store.location}/{name} is missing or not the size the manifest says; "
                                        "nothing was resumed")
        return manifest

    def _restore(self, store: Store, manifest: dict, timeout: float) -> dict:
        rm = self.rm
        epochs = manifest["epochs"]
        new = []
        try:
            for island in rm.islands:
                new.append(restart_island(rm.topology, island, rm.key, rm.runtime_id, rm.config.op_timeout,
                                          rm.config.gap_timeout, timeout, epoch=epochs[island.index]))
        except BaseException:
            for island in new:
                stop_island(island)
            raise
        rm.replace_islands(new)
        dropped = rm.restore_sessions(manifest["sessions"], manifest["allocations"])
        parts = {(p["island"], p["host"]): p for p in manifest["parts"]}
        held = sum(p["data_bytes"] for p in manifest["parts"])
        done = self._call("restore", lambda i, k: (store.location, json.dumps(parts[(i, k)], sort_keys=True)),
                          timeout + held / SAVE_BYTES_PER_S)
        return {"buffers": sum(d["buffers"] for d in done), "bytes": sum(d["array_bytes"] for d in done),
                "sessions": len(manifest["sessions"]) - len(dropped), "sessions_dropped": dropped}


def call_all(calls: list[tuple[int, int, Any]], timeout: float, tolerate: bool = False) -> list:
    """The results of (island, host, object ref) calls, in order; the first failure raised (naming the host),
    or left out with ``tolerate``."""
    out = []
    deadline = time.monotonic() + timeout
    for island, host, ref in calls:
        try:
            out.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except Exception as exc:
            if tolerate:
                continue
            cause = getattr(exc, "cause", None)
            detail = str(cause) if isinstance(cause, PathwaysError) else f"{type(exc).__name__}: {exc}"
            raise PathwaysError(f"island {island} host {host}: {detail.splitlines()[0][:400]}") from None
    return out
