"""Where each pod of an elastic data-parallel run (``pw.elastic.DataParallel``) stands.

A pod trains (it holds the state, received when its island was at some epoch), is lost (with the epoch of
its island's instance that failed: any later restart is taken back), or warms up after its island came back
(a landing that resolves once the warm-up ran). A pod holds the state only while its island is alive and
still the instance that received it: a restart empties it. The islands' health and epochs come from the
session; the runner decides what to do, and this table records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from client.session import current
from client.slices import VirtualSlice
from pathways.errors import IslandFailedError


class Pods:
    """The pods over ``slices`` (pod ``p`` runs on ``slices[p].island``): which train, which are lost, which
    warm up."""

    def __init__(self, slices: Sequence[VirtualSlice]) -> None:
        self._islands = [s.island for s in slices]
        self.active: tuple[int, ...] = ()  # training now
        self.lost: dict[int, int] = {}  # pod -> its island's epoch when it was lost
        self._epochs: dict[int, int] = {}  # pod -> its island's epoch when it received the state
        self._returning: dict[int, tuple[int, Future]] = {}  # pod -> (its island's epoch, its warm-up landing)

    def epoch(self, pod: int) -> int:
        """How many times ``pod``'s island had restarted when the session last looked."""
        return current().epoch(self._islands[pod])

    def alive(self, pod: int) -> bool:
        """Whether ``pod``'s island serves (asking the resource manager at most once per poll interval)."""
        try:
            current().check_islands(frozenset({self._islands[pod]}))
            return True
        except IslandFailedError:
            return False

    def holds_state(self, pod: int) -> bool:
        """Whether ``pod`` is alive and has not restarted since it received the state (a restart empties it)."""
        return self.holds_island(pod, self._epochs.get(pod))

    def holds_island(self, pod: int, epoch: int | None) -> bool:
        """Whether ``pod`` is alive and its island is still the instance of restart ``epoch``."""
        return self.alive(pod) and self.epoch(pod) == epoch

    def start(self, live: Sequence[int]) -> None:
        """The pods ``live`` received the state now; every other pod is lost, and no warm-up counts."""
        self._epochs = {p: self.epoch(p) for p in live}
        self.lost = {p: self.epoch(p) for p in range(len(self._islands)) if p not in live}
        self.active, self._returning = tuple(live), {}

    def lose(self, pods: Sequence[int]) -> None:
        """``pods`` failed: each is lost as the instance that held the state (a later restart is taken back)."""
        for pod in pods:
            self.lost[pod] = self._epochs[pod]
        self.active = tuple(p for p in self.active if p not in pods)

    def back(self) -> list[int]:
        """The lost pods, not warming up yet, whose islands restarted since they were lost and serve."""
        session = current()
        return [pod for pod, epoch in list(self.lost.items())
                if pod not in self._returning and session.refresh(self._islands[pod])
                and self.epoch(pod) > epoch and self.alive(pod)]

    def warming(self, pod: int, epoch: int, landing: Future) -> None:
        """``pod``, back at its island's restart ``epoch``, warms up until ``landing`` resolves."""
        self._returning[pod] = (epoch, landing)

    def warmed(self) -> tuple[list[int], list[tuple[int, BaseException]]]:
        """The warm-ups that landed: the pods ready to rejoin, and those that failed while warming up (each lost
        again as that instance, with the error). A warm-up broken by a survivor's failure, not the pod's, is
        neither: the pod warms up again from the survivors' state."""
        ready, failed = [], []
        for pod in sorted(p for p, (_, landing) in self._returning.items() if landing.done()):
            epoch, landing = self._returning.pop(pod)
            error = landing.exception()
            if error is None:
                ready.append(pod)
            elif not (isinstance(error, IslandFailedError) and self.holds_island(pod, epoch)):
                self.lost[pod] = epoch
                failed.append((pod, error))
        return ready, failed

    def failed_again(self, pod: int, epoch: int) -> None:
        """``pod``'s instance of restart ``epoch`` failed before rejoining: a later restart is taken back."""
        self.lost[pod] = epoch

    def rejoined(self, pod: int, epoch: int) -> None:
        """``pod`` received the state at its island's restart ``epoch`` and trains again."""
        self._epochs[pod] = epoch
        del self.lost[pod]
        self.active = tuple(sorted((*self.active, pod)))
