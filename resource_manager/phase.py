"""The cluster's phase (running, suspending, suspended, resuming) and its generation, which every change moves on.

Sessions and slices are refused while the cluster is not running; the island health checks pause while it has no
islands to check; a client's watch (``resource_manager.notices``) is answered when the generation moves on. The
suspend and resume procedures (``resource_manager.suspension``) move it.
"""

from __future__ import annotations

import threading

from pathways.errors import ClusterSuspendedError

RUNNING, SUSPENDING, SUSPENDED, RESUMING = "running", "suspending", "suspended", "resuming"
PHASES = (RUNNING, SUSPENDING, SUSPENDED, RESUMING)


class ClusterPhase:
    """The phase and generation, read and moved together under their own lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = RUNNING
        self._generation = 0

    @property
    def now(self) -> str:
        """The phase now."""
        return self._phase

    def read(self) -> tuple[str, int]:
        """(phase, generation), consistent with each other."""
        with self._lock:
            return self._phase, self._generation

    @property
    def generation(self) -> int:
        """The generation now: how many times the phase has moved."""
        return self._generation

    def move(self, phase: str) -> int:
        """Move to ``phase``; returns the new generation."""
        if phase not in PHASES:
            raise ValueError(f"no cluster phase {phase!r}; the phases are {', '.join(PHASES)}")
        with self._lock:
            self._phase = phase
            self._generation += 1
            return self._generation

    def refuse(self, what: str) -> None:
        """ClusterSuspendedError unless the cluster runs (``what`` needs islands that are up)."""
        phase = self._phase
        if phase != RUNNING:
            raise ClusterSuspendedError(
                f"{what}: the cluster is {phase} by its admin. Arrays you hold are kept; once it is resumed "
                "(`pathways resume`), do this again")
