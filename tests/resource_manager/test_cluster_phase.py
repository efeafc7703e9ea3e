"""The cluster's phase: refused requests while it is not running, and a generation that every move moves on."""

from __future__ import annotations

import threading

import pytest

from pathways.errors import ClusterSuspendedError
from resource_manager.phase import PHASES, RESUMING, RUNNING, SUSPENDED, SUSPENDING, ClusterPhase


def test_a_new_cluster_runs_at_generation_zero_and_refuses_nothing():
    phase = ClusterPhase()
    assert phase.read() == (RUNNING, 0) and phase.now == RUNNING and phase.generation == 0
    phase.refuse("opening a session")


@pytest.mark.parametrize("state", [SUSPENDING, SUSPENDED, RESUMING])
def test_while_not_running_a_request_is_refused_saying_what_and_how_to_go_on(state):
    phase = ClusterPhase()
    phase.move(state)
    with pytest.raises(ClusterSuspendedError, match=f"placing a slice: the cluster is {state} by its admin.*"
                                                    "pathways resume"):
        phase.refuse("placing a slice")


def test_every_move_is_a_new_generation_even_to_the_same_phase():
    phase = ClusterPhase()
    assert [phase.move(p) for p in (SUSPENDING, RUNNING, RUNNING)] == [1, 2, 3]
    assert phase.read() == (RUNNING, 3)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="no cluster phase 'paused'"):
        ClusterPhase().move("paused")
    assert set(PHASES) == {RUNNING, SUSPENDING, SUSPENDED, RESUMING}


def test_moves_from_many_threads_each_get_a_generation_of_their_own():
    phase = ClusterPhase()
    seen: list[int] = []
    threads = [threading.Thread(target=lambda: seen.extend(phase.move(RUNNING) for _ in range(200))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == list(range(1, 801)) and phase.generation == 800
