"""The RL loop: a sampler and a trainer on slices of their own, one ``@pw.program`` per step, placed by one argument.

    loop = pw.rl.Loop(pw.rl.asynchronous(k=1), sample=sample, train=train,
                      sampler=((2,), ("model",)), trainer=((2,), ("data",)),
                      sampler_specs=tp_specs, trainer_specs=dp_specs)
    loop.start(params, opt_state, consts=ref_params, key=jax.random.key(0))
    for n in range(steps):
        print(loop.step().read())            # reading is what waits; step() only dispatches

``sample(params, key, version) -> rollout`` and ``train(params, opt_state, rollout, consts) -> (params,
opt_state, metrics)`` are plain JAX functions; the loop compiles them on the sampler's and the trainer's slices.
Step n trains on rollout r_n, which was generated with the weights after ``placement.version(n)`` updates and
records that version (the ``version`` argument). A step is one program: the weights the sampler needs are
synced (trainer to sampler, host to host), the sampler generates, the trainer updates on the rollout (moved to
it by the train function's ``rollout_specs``). On-policy, the sampler generates r_n from the weights step n
starts from, and the trainer waits for it. Asynchronously (k >= 1), the sampler generates r_{n+k} from those
weights while the trainer trains on r_n, which it generated k steps earlier: the two islands run at once.
Nothing waits in the client: it dispatches steps ahead (``depth``) and blocks only to keep that many in flight.
Rollouts and rewards stay on the islands; only ``metrics`` come back, and only when read.

Failures: when the sampler's island dies, the steps that had not landed lose their rollouts; the loop waits for
the island's restart and generates them again (same keys, same weight versions) from the trainer's copies of the
weights, so the run goes on as it would have. When the trainer's island dies (colocated: the one island), the
training state is gone: the step raises ``IslandFailedError`` in bounded time, naming the last landed step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import put
from client.jit import jit
from client.program import ProgramFunction
from client.rl.placement import Mesh, Placement, placement
from client.session import current
from client.weight_sync import WeightSync
from pathways.errors import IslandFailedError, ProgramError

RESTART_TIMEOUT_S = 180.0  # how long a loop waits for its sampler's island to restart before it gives up
RESTART_POLL_S = 0.5


@dataclass(frozen=True)
class Event:
    """Something the loop did about a failure: ``kind`` "sampler_lost" or "redone", at ``step`` (steps landed)."""

    kind: str
    step: int
    detail: str
    at: float = field(default_factory=time.time)


class StepResult:
    """A dispatched step: ``step`` (0-based), ``version`` (the weight version its rollouts were generated with),
    and ``metrics``, the train function's metrics as pw.Array futures (``read()`` fetches them)."""

    def __init__(self, step: int, version: int, land: Callable[[StepResult], None]) -> None:
        self.step = step
        self.version = version
        self.metrics: Any = None
        self.attempts = 0  # more than 1: a failure made the loop dispatch it again
        self._land = land

    @property
    def staleness(self) -> int:
        """How many updates the rollout's weights lag the weights this step trains."""
        return self.step - self.version

    def read(self) -> dict:
        """The metrics as Python floats: waits for the step to land (dispatching it again if its sampler's island
        failed), then fetches them, the only bytes that come back to the client."""
        self._land(self)
        leaves = jax.tree.leaves(self.metrics)
        for leaf in leaves:
            leaf.copy_to_host_async()
        return jax.tree.map(lambda a: float(np.asarray(a.fetch()).mean()), self.metrics)


class Loop:
    """An RL loop over a sampler slice and a trainer slice, placed by ``placement``.

    Args:
        placement: ``pw.rl.colocated()``, ``pw.rl.disaggregated()``, ``pw.rl.asynchronous(k)``, or a name.
        sample: ``sample(params, key, version) -> rollout`` (a pytree; jnp), run on the sampler's slice.
        train: ``train(params, opt_state, rollout, consts) -> (params, opt_state, metrics)``, on the trainer's.
        sampler, trainer: each role's mesh, ``(shape, axis names)`` or a ``pw.rl.Mesh``.
        sampler_specs, trainer_specs: the parameters' PartitionSpecs (pytree prefixes) on each slice.
        opt_specs: the optimizer state's on the trainer (default replicated).
        rollout_specs: the rollout's on the trainer (default replicated).
        consts_specs: the constants' on the trainer (e.g. a reference policy's parameters; default
            ``trainer_specs``).
        depth: the most steps in flight (default 2: the islands always hold the next step while the client waits
            for the one before). The trainer keeps the parameters of every version from k before the last landed
            step on (k + depth + 1 copies at most), to generate lost rollouts again.
        name: the prefix of the computations' names in traces (``NAME_sample``, ``NAME_train``).
    """

    def __init__(self, placement_: Placement | str, *, sample: Callable, train: Callable, sampler: Any,
                 trainer: Any, sampler_specs: Any = None, trainer_specs: Any = None, opt_specs: Any = None,
                 rollout_specs: Any = None, consts_specs: Any = "trainer", depth: int | None = None,
                 name: str = "rl", restart_timeout: float = RESTART_TIMEOUT_S) -> None:
        if not callable(sample) or not callable(train):
            raise ProgramError("pw.rl.Loop needs sample and train functions (plain JAX functions)")
        self.placement = placement(placement_)
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"pw.rl.Loop: depth must be a positive int, got {depth!r}")
        self.depth = depth or 2
        self.restart_timeout = restart_timeout
        sampler_mesh, trainer_mesh = Mesh.of(sampler, "sampler"), Mesh.of(trainer, "trainer")
        self.sampler, self.trainer = self.placement.allocate(sampler_mesh, trainer_mesh)
        self.sampler_specs = P() if sampler_specs is None else sampler_specs
        self.trainer_specs = P() if trainer_specs is None else trainer_specs
        self.opt_specs = P() if opt_specs is None else opt_specs
        self.consts_specs = self.trainer_specs if isinstance(consts_specs, str) else consts_specs
        rollout_specs = P() if rollout_specs is None else rollout_specs
        self.name = name

        def sample_keyed(params: Any, key_data: jax.Array, version: jax.Array) -> Any:
            return sample(params, jax.random.wrap_key_data(key_data), version)

        self._sample = jit(sample_keyed, slice=self.sampler, in_specs=(self.sampler_specs, P(), P()),
                           name=f"{name}_sample")
        self._train_fn, self._rollout_specs = train, rollout_specs
        self.sync = WeightSync(self.sampler, self.sampler_specs, name=f"{name}_sync")  # trainer -> sampler
        self._on_policy = ProgramFunction(self._on_policy_step, name=f"{name}_step")
        self._async = ProgramFunction(self._async_step, name=f"{name}_step")
        self._generate = ProgramFunction(self._generate_body, name=f"{name}_generate")
        self.events: list[Event] = []
        self._started = False

    # -- the programs ----------------------------------------------------------------------------------
    def _on_policy_step(self, params: Any, opt: Any, consts: Any, key: Any, version: Any) -> tuple:
        rollout = self._sample(self.sync(params), key, version)
        return self._train(params, opt, rollout, consts)

    def _async_step(self, params: Any, opt: Any, consts: Any, rollout: Any, key: Any, version: Any) -> tuple:
        ahead = self._sample(self.sync(params), key, version)  # r_{n+k}, from the weights step n starts from
        params, opt, metrics = self._train(params, opt, rollout, consts)
        return params, opt, metrics, ahead

    def _generate_body(self, params: Any, key: Any, version: Any) -> Any:
        return self._sample(self.sync(params), key, version)

    # -- running -----------------------------------------------------------------------------------------
    def start(self, params: Any, opt_state: Any, consts: Any = (), key: Any = None, step: int = 0) -> None:
        """Place the parameters, optimizer state and constants (host values, or pw.Arrays) on the trainer and,
        asynchronously, generate the first k steps' rollouts. ``key``: a typed PRNG key (default key(0));
        step n's rollouts use ``fold_in(key, n)``. ``step``: the updates the state has had (when resuming from a
        checkpoint of ``state()``); no rollout is generated with weights older than it."""
        self._key = jax.random.key(0) if key is None else key
        self._params = {step: put(params, self.trainer, self.trainer_specs)}  # weight version -> params
        self._opts = {step: put(opt_state, self.trainer, self.opt_specs)}
        has_consts = bool(jax.tree.leaves(consts))
        self._consts = put(consts, self.trainer, self.consts_specs) if has_consts else consts
        self._train = jit(self._train_fn, slice=self.trainer, name=f"{self.name}_train",
                          in_specs=(self.trainer_specs, self.opt_specs, self._rollout_specs,
                                    self.consts_specs if has_consts else P()),
                          out_specs=(self.trainer_specs, self.opt_specs, P()))
        self._rollouts: dict[int, Any] = {}  # step -> its rollout, generated ahead (async)
        self._inflight: deque[StepResult] = deque()
        self._landed = self._next = self._first = step
        session = current()
        self._epochs = (session.epoch(self.sampler.island), session.epoch(self.trainer.island))
        self._started = True
        self._fill_ahead()

    def step(self) -> StepResult:
        """Dispatch the next step (waits only to keep ``depth`` steps in flight); its ``StepResult``."""
        if not self._started:
            raise ProgramError("pw.rl.Loop.step before start(params, opt_state)")
        pending = StepResult(self._next, self._version(self._next), self._land_through)
        self._next += 1
        self._inflight.append(pending)
        try:
            self._dispatch(pending)
        except IslandFailedError as exc:  # an island this step needs is known dead already
            self._recover(exc)
        while len(self._inflight) > self.depth:
            self._land_oldest()
        return pending

    def finish(self) -> None:
        """Wait until every dispatched step has landed (recovering from a sampler's failure on the way)."""
        while self._inflight:
            self._land_oldest()

    def params(self) -> Any:
        """The newest parameters on the trainer (pw.Array futures)."""
        return self._params[max(self._params)]

    def state(self) -> tuple[int, Any, Any]:
        """(steps done, parameters, optimizer state) after every dispatched step has landed."""
        self.finish()
        return self._landed, self._params[self._landed], self._opts[self._landed]

    def close(self) -> None:
        """Release both slices (arrays on them stay fetchable until dropped)."""
        self.sampler.release()
        self.trainer.release()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- inside ----------------------------------------------------------------------------------------------
    def _version(self, step: int) -> int:
        """The weight version step ``step``'s rollouts are generated with (none older than the start's)."""
        return max(self._first, self.placement.version(step))

    def _key_data(self, step: int) -> np.ndarray:
        return np.asarray(jax.random.key_data(jax.random.fold_in(self._key, step)))

    def _fill_ahead(self) -> None:
        """Generate the rollouts of steps next..next+k-1 not generated yet (each from its own weight version)."""
        for m in range(self._next, self._next + self.placement.staleness):
            if m not in self._rollouts:
                v = self._version(m)
                self._rollouts[m] = self._generate(self._params[v], self._key_data(m), np.int32(v))

    def _dispatch(self, pending: StepResult) -> None:
        n, k = pending.step, self.placement.staleness
        params, opt = self._params[n], self._opts[n]
        if k == 0:
            new_params, new_opt, metrics = self._on_policy(params, opt, self._consts, self._key_data(n), np.int32(n))
        else:
            new_params, new_opt, metrics, ahead = self._async(params, opt, self._consts, self._rollouts.pop(n),
                                                              self._key_data(n + k), np.int32(n))
            self._rollouts[n + k] = ahead
        self._params[n + 1], self._opts[n + 1] = new_params, new_opt
        pending.metrics, pending.attempts = metrics, pending.attempts + 1

    def _land_through(self, pending: StepResult) -> None:
        while pending in self._inflight:
            self._land_oldest()

    def _land_oldest(self) -> None:
        pending = self._inflight[0]
        try:
            for leaf in jax.tree.leaves(pending.metrics):
                leaf.block_until_ready()
        except IslandFailedError as exc:
            self._recover(exc)
            return
        self._inflight.popleft()
        self._landed = pending.step + 1
        keep = self._landed - self.placement.staleness  # regenerating lost rollouts needs versions from here on
        for v in [v for v in self._params if v < keep]:
            del self._params[v]
        for v in [v for v in self._opts if v < self._landed]:
            del self._opts[v]

    def _recover(self, error: IslandFailedError) -> None:
        """A step failed: if the sampler's island died (and the trainer's did not), wait for its restart and
        dispatch every step that had not landed again; else raise, naming the last landed step."""
        session = current()
        s, t = self.sampler.island, self.trainer.island
        if s == t or not session.refresh(t) or session.epoch(t) != self._epochs[1]:
            raise IslandFailedError(
                f"the RL trainer's island {t} failed ({error}); the parameters and optimizer state it held are "
                f"gone. The last landed step was {self._landed}: restart from a checkpoint of it "
                f"(Loop.state() before the failure), e.g. with Loop.start(params, opt_state, step=...)") from error
        if session.refresh(s) and session.epoch(s) == self._epochs[0]:
            raise error  # neither island failed: not a failure the loop can recover from
        self.events.append(Event("sampler_lost", self._landed, f"the sampler's island {s} failed: {error}"))
        deadline = time.monotonic() + self.restart_timeout
        while not (session.refresh(s) and session.epoch(s) > self._epochs[0]):
            if time.monotonic() > deadline:
                raise IslandFailedError(f"the RL sampler's island {s} failed ({error}) and did not restart within "
                                        f"{self.restart_timeout:.0f} s; {self._landed} steps had landed") from error
            time.sleep(RESTART_POLL_S)
        self._epochs = (session.epoch(s), self._epochs[1])
        redo = [p.step for p in self._inflight]
        for v in [v for v in self._params if v > self._landed]:
            del self._params[v]
        for v in [v for v in self._opts if v > self._landed]:
            del self._opts[v]
        self._rollouts, self._next = {}, self._landed
        self._fill_ahead()
        for pending in self._inflight:
            self._next = pending.step + 1
            self._dispatch(pending)
        self.events.append(Event("redone", self._landed, f"the sampler's island {s} restarted (restart "
                                                        f"{self._epochs[0]}); step(s) {redo} generated and "
                                                        "trained again"))
