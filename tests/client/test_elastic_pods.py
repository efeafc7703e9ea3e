"""Where each pod of an elastic run stands (client/elastic_pods.py), on the session's live islands: a live pod
holds the state of its island's instance, a lost one is remembered with that instance's epoch, a warm-up that
lands makes a pod ready, one that fails loses it again (unless a survivor, not the pod, failed), and a pod that
rejoins trains again."""

from __future__ import annotations

from concurrent.futures import Future

from client.elastic_pods import Pods
from client.slices import VirtualSlice
from pathways.errors import IslandFailedError, ProgramError


def _slice(island: int) -> VirtualSlice:
    return VirtualSlice(None, {"key": f"pods{island}", "shape": [2], "axes": ["data"], "island": island,
                               "devices": [[0, d] for d in range(2)], "tenant": "t"})


def _landed(error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


def test_pods_are_lost_warm_up_and_rejoin(cluster):
    pods = Pods([_slice(0), _slice(1)])
    epochs = [cluster.epoch(0), cluster.epoch(1)]
    assert pods.alive(0) and pods.alive(1) and [pods.epoch(0), pods.epoch(1)] == epochs
    pods.start([0])
    assert pods.active == (0,) and pods.lost == {1: epochs[1]}
    assert pods.holds_state(0) and not pods.holds_state(1)  # pod 1 never received it
    assert pods.holds_island(1, epochs[1]) and not pods.holds_island(1, epochs[1] + 1)
    assert pods.back() == []  # its island has not restarted since it was lost
    pods.warming(1, epochs[1], Future())
    assert pods.warmed() == ([], [])  # not landed yet
    pods.rejoined(1, epochs[1])
    assert pods.active == (0, 1) and pods.lost == {} and pods.holds_state(1)
    pods.lose([0])
    assert pods.active == (1,) and pods.lost == {0: epochs[0]}


def test_a_warm_up_that_lands_fails_or_loses_its_source(cluster):
    pods = Pods([_slice(0), _slice(1)])
    pods.start([0])
    epoch = pods.epoch(1)
    pods.warming(1, epoch, _landed())
    assert pods.warmed() == ([1], []) and pods.warmed() == ([], [])  # each landing is taken once
    broken = ProgramError("the warm-up failed on the pod")
    pods.warming(1, epoch, _landed(broken))
    pods.lost.pop(1)
    assert pods.warmed() == ([], [(1, broken)]) and pods.lost == {1: epoch}  # lost again as that instance
    pods.warming(1, epoch, _landed(IslandFailedError("the source pod failed")))
    pods.lost.pop(1)
    assert pods.warmed() == ([], []) and 1 not in pods.lost  # the pod itself is fine: it warms up again
    pods.failed_again(1, epoch)
    assert pods.lost == {1: epoch} and pods.active == (0,)
