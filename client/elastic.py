"""Elastic data parallelism: a training step over several pods that survives losing one and grows back.

A data-parallel step over N pods (islands, each with its own slice of the same shape) splits the global
batch into N shares. Every pod holds the same training state (parameters and optimizer state, bitwise
identical, as in PaLM's two-pod step), each share's gradients are computed on one pod, and every pod
applies the shares' gradients, taken in share order. ``DataParallel`` runs that step so that a pod may
die at any time, and the user writes no recovery code:

- A step never donates the state it starts from, and that state is kept until the step has landed on
  every pod that ran it. When a pod dies, the steps that had not landed run again on the survivors,
  from the latest landed state they hold: no checkpoint is read, and only the interrupted step is redone.
- With the default policy (``GLOBAL_BATCH``) the survivors compute every share, each with the same
  executable and shapes as before, and the update receives the gradients in the same share order, so the
  loss curve and the state stay bitwise identical to a run without the failure.
- With ``POD_BATCH`` the survivors compute only their own shares (the global batch shrinks) and the
  update gets ``lr_scale`` = live pods / N, so that it scales the learning rate with the batch.
- When the dead pod's island is back (the resource manager restarts it), the pod first warms up in the
  background: it receives a landed state and runs one share of a step on it, which compiles everything it
  will run, while the survivors go on training. Then, at the next step boundary, it receives the latest
  state host to host from a survivor (``pw.transfer`` inside a program); both pods fingerprint it bit by
  bit, and only a copy whose fingerprint matches rejoins.

    dp = pw.elastic.DataParallel(pods, grads=grads, update=update, batch_specs=P("data"))
    dp.start((params, opt_state), specs=(param_specs, opt_specs))
    for batch in batches:
        result = dp.result(dp.submit(batch))     # or submit step n+1 before reading step n
        print(result.step, result.metrics)

Costs: one more copy of the state on every pod than a donating step, one tiny computation per pod per
step (the probe that says a pod's new state exists), and, while a pod is out, the survivors' time for
its shares.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from client.array import Array, put
from client.elastic_pods import Pods
from client.elastic_programs import StepPrograms
from client.slices import VirtualSlice
from pathways.errors import IslandFailedError, ProgramError

GLOBAL_BATCH = "global_batch"  # survivors compute every share: bitwise the run without the failure
POD_BATCH = "pod_batch"  # survivors compute their own shares; the update scales the learning rate
POLICIES = (GLOBAL_BATCH, POD_BATCH)
RETURN_POLL_S = 0.5  # how often ``wait_for_pods`` asks whether a lost pod's island is back
log = logging.getLogger(__name__)


# -- who computes what -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One step's work: the pods that hold the state and update it, the pod that computes each data share
    (``(share, pod)`` in share order, the order the update receives the gradients in), and the learning
    rate scale the update is given."""

    pods: tuple[int, ...]
    shares: tuple[tuple[int, int], ...]
    lr_scale: float


def plan(active: Sequence[int], n: int, policy: str = GLOBAL_BATCH) -> Plan:
    """The step's plan when the pods ``active`` (of ``n``) hold the state.

    ``GLOBAL_BATCH``: every share; each pod computes its own, and the shares of pods that are out go, in
    share order, to the least loaded survivor (the lowest index on a tie). ``POD_BATCH``: only the live
    pods' own shares, with ``lr_scale`` = live / n.
    """
    pods = tuple(sorted(set(active)))
    if not pods or pods[0] < 0 or pods[-1] >= n:
        raise ValueError(f"the live pods {list(active)} must be a non-empty subset of 0..{n - 1}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    if policy == POD_BATCH:
        return Plan(pods, tuple((p, p) for p in pods), len(pods) / n)
    load = dict.fromkeys(pods, 1)
    owner = {s: s for s in pods}
    for share in range(n):
        if share not in owner:
            pod = min(pods, key=lambda p: (load[p], p))
            owner[share] = pod
            load[pod] += 1
    return Plan(pods, tuple((s, owner[s]) for s in range(n)), 1.0)


# -- what the runner reports -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """Something the runner did about its pods, in order (``DataParallel.events``, and ``on_event``).

    ``kind``: "pod_lost" (a pod failed; ``detail`` says how), "resumed" (the survivors re-ran the steps that
    had not landed; ``step`` is the landed step they continued from), "returned" (a lost pod's island is
    back and the pod warms up), "rejoining" (it is receiving the latest state; sent before the runner waits
    for it), "rejoined" or "rejoin_failed". ``step``: updates landed when it happened. ``pods``: the pods
    training after it.
    """

    kind: str
    pod: int | None
    step: int
    pods: tuple[int, ...]
    detail: str
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class StepResult:
    """A landed step: ``step`` updates are done. ``metrics`` holds what ``grads`` returned for each share it
    trained on (fetched to numpy), in share order; ``aux`` what ``update`` returned beside the state, from
    the first pod; ``attempts`` is more than 1 when a failure made the survivors run it again."""

    step: int
    metrics: list
    aux: Any
    pods: tuple[int, ...]
    shares: tuple[int, ...]
    lr_scale: float
    attempts: int


class Pending:
    """A submitted step: ``DataParallel.result`` makes it land (running it again if a pod failed)."""

    def __init__(self, step: int, batch: Any, transform: Callable | None) -> None:
        self.step = step
        self.batch = batch  # kept until the step lands: a failure runs it again
        self.transform = transform
        self.attempts = 0
        self.plan: Plan | None = None
        self.states: dict[int, Any] = {}
        self.metrics: list = []
        self.aux: Any = None
        self.ready: dict[int, Array] = {}
        self.result: StepResult | None = None
        self.dropped = False

    @property
    def done(self) -> bool:
        """Whether the step has landed."""
        return self.result is not None

    def __repr__(self) -> str:
        return f"Pending(step {self.step}, {'landed' if self.done else 'in flight'}, attempts {self.attempts})"


# -- the runner --------------------------------------------------------------------------------------------

class DataParallel:
    """A data-parallel training step over ``slices`` (one per pod, on distinct islands, all of one shape)
    that goes on through the loss of pods and takes them back when their islands restart.

    Args:
        slices: one slice per pod; pod ``p`` computes data share ``p`` while it is live.
        grads: ``grads(state, batch) -> (grads, metrics)``, traced into the step program: it calls
            ``pw.jit`` functions that take no slice (they run on the pod of their first argument), with
            ``state`` and ``batch`` (one share's rows, placed with ``batch_specs``) on the pod that computes
            the share.
        update: ``update(state, grads, lr_scale) -> (state, aux)``, traced likewise on every pod: ``grads``
            is the list of every share's gradients, already on this pod, in share order; it must combine
            them in that order (e.g. ``functools.reduce(add, grads) / len(grads)``) so that every pod
            computes the same bits. ``lr_scale`` is a Python float: 1.0, or with ``POD_BATCH`` the live
            fraction of the pods.
        batch_specs: a PartitionSpec prefix of the batch pytree on a pod (None: replicated).
        policy: ``GLOBAL_BATCH`` (default) or ``POD_BATCH``, what the survivors train on (module docstring).
        on_event: called with every ``Event`` as it happens (logging, or a test's hook).
        name: the step program's name (in traces and graphs).
    """

    def __init__(self, slices: Sequence[VirtualSlice], grads: Callable, update: Callable, *,
                 batch_specs: Any = None, policy: str = GLOBAL_BATCH,
                 on_event: Callable[[Event], None] | None = None, name: str = "elastic_step") -> None:
        slices = list(slices)
        if not slices or not all(isinstance(s, VirtualSlice) for s in slices):
            raise ProgramError("pw.elastic.DataParallel needs one pw.VirtualSlice per pod")
        if len({s.island for s in slices}) != len(slices):
            raise ProgramError(f"pw.elastic.DataParallel: each pod needs its own island, got islands "
                               f"{[s.island for s in slices]}")
        if len({(s.shape, s.axis_names) for s in slices}) != 1:
            raise ProgramError("pw.elastic.DataParallel: every pod's slice needs the same shape and axis names, so "
                               "that a survivor computes another pod's share with the same executable; got "
                               f"{[(s.shape, s.axis_names) for s in slices]}")
        if policy not in POLICIES:
            raise ProgramError(f"pw.elastic.DataParallel: unknown policy {policy!r}; choose one of {POLICIES}")
        if not callable(grads) or not callable(update):
            raise ProgramError("pw.elastic.DataParallel: grads and update must be functions (see the docstring)")
        self.slices = slices
        self.policy = policy
        self.batch_specs = batch_specs
        self.on_event = on_event
        self.events: list[Event] = []
        self._programs = StepPrograms(slices, grads, update, batch_specs, name)
        self._pods = Pods(slices)
        self._base: tuple[int, dict[int, Any]] | None = None  # the latest landed step and its state per pod
        self._inflight: deque[Pending] = deque()
        self._last_batch: Any = None  # what a warm-up computes on
        self._next = 0
        self._gone: str | None = None  # why the state is lost, once every pod holding it failed

    # -- public ------------------------------------------------------------------------------------------
    @property
    def pods(self) -> tuple[int, ...]:
        """The pods training now."""
        return self._pods.active

    @property
    def lost(self) -> tuple[int, ...]:
        """The pods out of the step, waiting for their islands to restart."""
        return tuple(sorted(self._pods.lost))

    def start(self, state: Any, specs: Any = None, step: int = 0) -> None:
        """Place ``state`` (a pytree of host values) on every live pod as the state after ``step`` updates,
        sharded by ``specs`` (a PartitionSpec prefix; None: replicated). Steps not landed yet are dropped.
        Call it again to replace the state (a rollback, a checkpoint after every pod holding it failed).

        Raises:
            IslandFailedError: no pod's island is alive.
        """
        for pending in self._inflight:
            pending.dropped = True
        self._inflight.clear()
        spec_tree = self._programs.start(state, specs)
        live = [p for p in range(len(self.slices)) if self._pods.alive(p)]
        if not live:
            raise IslandFailedError(f"pw.elastic start: none of the pods' islands "
                                    f"{[s.island for s in self.slices]} is alive")
        states = {p: put(state, self.slices[p], spec_tree) for p in live}
        self._pods.start(live)
        self._base, self._next, self._gone = (step, states), step, None

    def submit(self, batch: Any, transform: Callable | None = None) -> Pending:
        """Dispatch the next step on ``batch`` (a pytree of host arrays whose leading dimension, the global
        batch, splits into one share per pod) without waiting; returns at once. First, a lost pod whose island
        is back starts its warm-up, and one whose warm-up has landed receives the state and rejoins (which
        waits for the steps in flight).

        Args:
            batch: the global batch. With ``POD_BATCH`` the shares of pods that are out are skipped.
            transform: a traced function applied to every pod's state at the start of this step (as part of
                it, so a step that runs again applies it again), e.g. to edit parameters.
        """
        self._check_started()
        self._programs.check_batch(batch)
        self._last_batch = batch
        self._take_back_returned()
        self._next += 1
        pending = Pending(self._next, batch, transform)
        self._inflight.append(pending)
        try:
            self._dispatch(pending, self._latest(before=pending))
        except IslandFailedError as exc:
            self._recover(exc)
        return pending

    def result(self, pending: Pending) -> StepResult:
        """Wait until ``pending`` has landed (and every step before it); a pod failing meanwhile makes the
        survivors run the steps that had not landed again. Bounded by the session's fetch timeout per wait.

        Raises:
            IslandFailedError: every pod that held the state failed (restart from a checkpoint with
                ``start``), or the islands are alive but did not produce the step in time.
            ProgramError: the step was dropped by ``start``.
        """
        if pending.dropped:
            raise ProgramError(f"step {pending.step} was dropped by DataParallel.start before it landed")
        while pending.result is None:
            self._land_next()
        return pending.result

    def state(self, pod: int | None = None) -> tuple[int, Any]:
        """(step, state) of the latest landed step: its state as pw.Arrays on ``pod`` (default: the first pod
        that holds it), to checkpoint or evaluate. The arrays stay valid for as long as they are referenced."""
        self._check_started()
        step, states = self._base
        if pod is not None and pod not in states:
            raise ProgramError(f"pod {pod} does not hold the state of step {step}; the pods that do: {sorted(states)}")
        return step, states[min(states) if pod is None else pod]

    def wait_for_pods(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until every lost pod's island is back and the pod rejoined;
        whether they all did. Steps in flight land first."""
        self._check_started()
        deadline = time.monotonic() + timeout
        while True:
            self._take_back_returned()
            if not self._pods.lost or time.monotonic() >= deadline:
                return not self._pods.lost
            time.sleep(min(RETURN_POLL_S, max(0.0, deadline - time.monotonic())))

    # -- the step program --------------------------------------------------------------------------------
    def _dispatch(self, pending: Pending, states: dict[int, Any]) -> None:
        step_plan = plan(self._pods.active, len(self.slices), self.policy)
        batches = [self._programs.share(pending.batch, share, pod) for share, pod in step_plan.shares]
        new, metrics, aux, ready = self._programs.step([states[p] for p in step_plan.pods], batches, step_plan,
                                                       pending.transform)
        pending.plan, pending.attempts = step_plan, pending.attempts + 1
        pending.states, pending.ready = dict(zip(step_plan.pods, new)), dict(zip(step_plan.pods, ready))
        pending.metrics, pending.aux = metrics, aux[0]

    def _latest(self, before: Pending | None = None) -> dict[int, Any]:
        """The state per pod after the last step dispatched before ``before`` (or the landed one)."""
        states = self._base[1]
        for pending in self._inflight:
            if pending is before:
                break
            states = pending.states
        return states

    # -- landing ---------------------------------------------------------------------------------------
    def _land_next(self) -> None:
        """Make the oldest step in flight land, or recover from a pod's failure."""
        self._check_started()
        pending = self._inflight[0]
        try:
            self._land(pending)
        except IslandFailedError as exc:
            self._recover(exc)

    def _land(self, pending: Pending) -> None:
        for ready in pending.ready.values():
            ready.fetch()  # computed from every leaf of that pod's new state: all of it exists
        leaves = jax.tree.leaves((pending.metrics, pending.aux))
        for leaf in leaves:
            leaf.copy_to_host_async()
        metrics, aux = jax.tree.map(lambda a: a.fetch(), (pending.metrics, pending.aux))
        for state in pending.states.values():
            _settle(state)
        step_plan = pending.plan
        pending.result = StepResult(pending.step, metrics, aux, step_plan.pods,
                                    tuple(s for s, _ in step_plan.shares), step_plan.lr_scale, pending.attempts)
        self._base = (pending.step, pending.states)
        self._inflight.popleft()
        pending.batch = pending.metrics = pending.aux = pending.transform = None
        pending.states, pending.ready = {}, {}

    # -- losing pods --------------------------------------------------------------------------------------
    def _recover(self, error: IslandFailedError) -> None:
        """Continue on the pods that still hold the latest landed state: run every step in flight again."""
        while True:
            step, states = self._base
            holders = [p for p in self._pods.active if self._pods.holds_state(p)]
            lost = [p for p in self._pods.active if p not in holders]
            if not lost:  # every pod is there: not a pod failure (an island alive but stuck, say)
                raise error
            self._lose(lost, error)
            if not holders:
                self._gone = (f"every pod that held the training state failed (pods {sorted(states)}; the last: "
                              f"{error}); its latest landed step was {step}: restore it from a checkpoint with "
                              f"DataParallel.start")
                raise IslandFailedError(self._gone) from error
            self._base = (step, {p: states[p] for p in holders})
            previous = self._base[1]
            try:
                for pending in self._inflight:
                    self._dispatch(pending, previous)
                    previous = pending.states
            except IslandFailedError as exc:  # a survivor failed too: look again
                error = exc
                continue
            redo = [p.step for p in self._inflight]
            self._emit("resumed", None, f"pods {list(holders)} continue from step {step} and run "
                                        f"step(s) {redo} again")
            return

    def _lose(self, pods: list[int], error: Exception) -> None:
        self._pods.lose(pods)
        for pod in pods:
            self._emit("pod_lost", pod, f"pod {pod} (island {self.slices[pod].island}) failed: {error}")

    # -- taking pods back ---------------------------------------------------------------------------------
    def _take_back_returned(self) -> None:
        """Warm up every lost pod whose island has restarted since it was lost; rejoin, at this step boundary,
        every pod whose warm-up has landed."""
        if not self._pods.lost:
            return
        for pod in self._pods.back():
            self._warm(pod)
        ready, failed = self._pods.warmed()
        for pod, error in failed:
            self._emit("rejoin_failed", pod, f"pod {pod} failed while warming up ({error}); nothing of it is "
                                             "used, and it rejoins once its island restarts again")
        if not ready:
            return
        while self._inflight:  # the state a pod receives is a landed one
            self._land_next()
        for pod in ready:
            if pod in self._pods.lost:
                self._rejoin(pod)

    def _warm(self, pod: int) -> None:
        """Start ``pod``'s warm-up (``StepPrograms.warm_up``) and a thread that waits for it, and return at
        once."""
        epoch = self._pods.epoch(pod)
        landing: Future = Future()
        if self._last_batch is None:  # nothing to warm up on yet: the first step compiles
            landing.set_result(None)
        else:
            _, states = self._base
            joint = plan((*self._pods.active, pod), len(self.slices), self.policy)
            share = self._programs.share(self._last_batch, pod, pod)
            try:
                outputs = self._programs.warm_up(states[min(states)], share, pod, len(joint.shares),
                                                 joint.lr_scale)
            except IslandFailedError as exc:
                landing.set_exception(exc)
            else:  # a thread waits for it, so that the survivors need not
                threading.Thread(target=_land_into, args=(outputs, landing), name="pw-elastic-warm-up",
                                 daemon=True).start()
        self._pods.warming(pod, epoch, landing)
        self._emit("returned", pod, f"pod {pod}'s island is back (restart {epoch}); it warms up while pods "
                                    f"{list(self._pods.active)} go on")

    def _rejoin(self, pod: int) -> None:
        epoch = self._pods.epoch(pod)
        step, states = self._base
        source = min(states)
        started = time.monotonic()
        try:
            moved, want, got = self._programs.copy(states[source], pod)
            self._emit("rejoining", pod, f"pod {pod} receives the state of step {step} from pod {source}")
            want, got = want.fetch(), got.fetch()
        except IslandFailedError as exc:
            if not self._pods.holds_state(source):  # the source failed: the survivors' rules apply
                self._recover(exc)
                if self._pods.holds_island(pod, epoch):
                    return  # the pod is fine: it warms up again from the survivors' state
            self._pods.failed_again(pod, epoch)
            self._emit("rejoin_failed", pod, f"pod {pod} failed while receiving the state from pod {source} "
                                             f"({exc}); nothing of it is used, and it rejoins once its island "
                                             f"restarts again")
            return
        if not np.array_equal(want, got):
            self._pods.failed_again(pod, epoch)
            self._emit("rejoin_failed", pod, f"the state pod {pod} received from pod {source} differs from the "
                                             f"source's (fingerprints of {int(np.sum(want != got))} of "
                                             f"{want.size} leaves differ); it is not used")
            return
        _settle(moved)
        states[pod] = moved
        self._pods.rejoined(pod, epoch)
        self._emit("rejoined", pod, f"pod {pod} rejoined at step {step} with the state of pod {source} "
                                    f"(copied and checked in {time.monotonic() - started:.2f} s)")

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _check_started(self) -> None:
        if self._gone is not None:
            raise IslandFailedError(self._gone)
        if self._base is None:
            raise ProgramError("pw.elastic: call DataParallel.start(state, specs) before training")

    def _emit(self, kind: str, pod: int | None, detail: str) -> None:
        event = Event(kind, pod, self._base[0], self._pods.active, detail)
        self.events.append(event)
        (log.warning if kind in ("pod_lost", "rejoin_failed") else log.info)("pw.elastic: %s", detail)
        if self.on_event is not None:
            self.on_event(event)


def _land_into(arrays: list[Array], landing: Future) -> None:
    """Wait until every array of ``arrays`` is computed (fetching it), then resolve ``landing``: with None, or
    with what a fetch raised. A daemon thread runs it: a warm-up still compiling never holds up an exit."""
    try:
        for array in arrays:
            array.fetch()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the runner reads it from ``landing``
        landing.set_exception(exc)
    else:
        landing.set_result(None)


def _settle(tree: Any) -> None:
    """The values of ``tree`` are known to be computed: each depends on its own island alone from now on."""
    for leaf in jax.tree.leaves(tree):
        leaf._settle()
