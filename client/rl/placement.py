"""Where an RL job's sampler and trainer run, as one argument: colocated, disaggregated, or asynchronous.

The sampler (generation) and the trainer (the policy update) are two virtual slices with meshes of their own.

- ``colocated()``: both slices on one island. They share its devices and take turns: the island's scheduler
  runs one computation at a time, and generation's KV cache lives inside the generate computation, so it is
  freed before the training computation starts.
- ``disaggregated()``: each on an island of its own; a step generates, then trains (on-policy).
- ``asynchronous(k)``: islands of their own, and the rollouts a step trains on were generated with weights at
  most ``k`` updates old, so the sampler generates step n+1's rollouts while the trainer runs step n. Each
  rollout records the weight version it was generated with; the loss corrects for the difference.

The placement changes nothing in the model or the loss: only where the slices go and which weights a rollout
is generated with (``Placement.version``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from client.session import current
from client.slices import VirtualSlice
from client.slices import slice as allocate
from pathways.errors import ResourceError

COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"
ASYNC = "async"
KINDS = (COLOCATED, DISAGGREGATED, ASYNC)
ALIASES = {"asynchronous": ASYNC, "colocate": COLOCATED, "disaggregate": DISAGGREGATED}


@dataclass(frozen=True)
class Mesh:
    """A role's mesh: its shape and axis names, as ``pw.slice`` takes them."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]

    @classmethod
    def of(cls, given: Mesh | tuple, role: str) -> Mesh:
        """A ``Mesh``, or ``(shape, axes)`` as a tuple, checked (ValueError naming ``role`` otherwise)."""
        if isinstance(given, Mesh):
            return given
        try:
            shape, axes = given
            mesh = cls(tuple(int(n) for n in shape), tuple(str(a) for a in axes))
        except (TypeError, ValueError):
            raise ValueError(f"the {role}'s mesh must be (shape, axis names), e.g. ((2,), ('data',)), "
                             f"got {given!r}") from None
        if len(mesh.shape) != len(mesh.axes) or not mesh.shape or min(mesh.shape) < 1:
            raise ValueError(f"the {role}'s mesh {given!r} needs one positive size per axis name")
        return mesh

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Placement:
    """Where the sampler and the trainer run, and how stale a rollout's weights may be.

    ``kind``: ``"colocated"``, ``"disaggregated"`` or ``"async"``. ``staleness``: k, the most updates the
    weights a rollout was generated with may lag the weights it trains (0 unless ``"async"``).
    ``sampler_island`` and ``trainer_island``: the islands (the same one when colocated).
    """

    kind: str
    staleness: int = 0
    sampler_island: int = 1
    trainer_island: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown RL placement {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name in ("staleness", "sampler_island", "trainer_island"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RL placement: {name} must be an int of at least 0, got {value!r}")
        if self.kind != ASYNC and self.staleness:
            raise ValueError(f"a {self.kind} placement is on-policy (staleness 0); use pw.rl.asynchronous(k="
                             f"{self.staleness}) for rollouts up to {self.staleness} updates old")
        if self.kind == ASYNC and self.staleness < 1:
            raise ValueError("pw.rl.asynchronous needs k >= 1 (k = 0 is pw.rl.disaggregated())")
        same = self.sampler_island == self.trainer_island
        if (self.kind == COLOCATED) != same:
            raise ValueError(f"a {self.kind} placement puts the sampler and the trainer on "
                             f"{'one island' if self.kind == COLOCATED else 'islands of their own'}, got "
                             f"sampler island {self.sampler_island}, trainer island {self.trainer_island}")

    def version(self, step: int) -> int:
        """The weight version (updates applied) that step ``step``'s rollouts are generated with."""
        return max(0, step - self.staleness)

    def allocate(self, sampler: Mesh, trainer: Mesh) -> tuple[VirtualSlice, VirtualSlice]:
        """The sampler's and the trainer's slices, on this placement's islands (ResourceError when the islands
        do not exist or the meshes do not fit them)."""
        topology = current().topology
        per_island = topology.hosts_per_island * topology.devices_per_host
        for role, mesh, island in (("sampler", sampler, self.sampler_island),
                                   ("trainer", trainer, self.trainer_island)):
            if island >= topology.islands:
                raise ResourceError(f"the RL {role} is placed on island {island}, which does not exist: the "
                                    f"cluster has {topology.islands} island(s) (0..{topology.islands - 1})")
            if mesh.size > per_island:
                raise ResourceError(f"the RL {role}'s mesh {mesh.shape} needs {mesh.size} devices; island "
                                    f"{island} has {per_island}: use a smaller mesh")
        s = allocate(sampler.shape, sampler.axes, island=self.sampler_island)
        try:
            t = allocate(trainer.shape, trainer.axes, island=self.trainer_island)
        except BaseException:
            s.release()
            raise
        return s, t

    def __str__(self) -> str:
        where = (f"island {self.trainer_island}" if self.kind == COLOCATED
                 else f"sampler island {self.sampler_island}, trainer island {self.trainer_island}")
        return f"{self.kind}{f' (k={self.staleness})' if self.kind == ASYNC else ''}, {where}"


def colocated(island: int = 0) -> Placement:
    """Sampler and trainer on one island, taking turns on its devices."""
    return Placement(COLOCATED, 0, island, island)


def disaggregated(sampler: int = 1, trainer: int = 0) -> Placement:
    """Sampler and trainer on islands of their own; on-policy (each step generates with the newest weights)."""
    return Placement(DISAGGREGATED, 0, sampler, trainer)


def asynchronous(k: int = 1, sampler: int = 1, trainer: int = 0) -> Placement:
    """Islands of their own, rollouts generated with weights at most ``k`` updates old (k >= 1), so that the
    sampler generates the next steps' rollouts while the trainer trains."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pw.rl.asynchronous: the staleness bound k must be an int of at least 1, got {k!r} "
                         "(k = 0 is pw.rl.disaggregated())")
    return Placement(ASYNC, k, sampler, trainer)


def placement(given: Placement | str, staleness: int = 1, islands: Sequence[int] | None = None) -> Placement:
    """A ``Placement``, or one named: ``"colocated"``, ``"disaggregated"``, ``"async"`` (with ``staleness``).
    ``islands``: (sampler, trainer) islands, default (1, 0) (colocated: island 0)."""
    if isinstance(given, Placement):
        return given
    if not isinstance(given, str):
        raise ValueError(f"an RL placement is pw.rl.colocated(), pw.rl.disaggregated(), pw.rl.asynchronous(k) "
                         f"or one of their names {KINDS}, got {given!r}")
    kind = ALIASES.get(given.lower(), given.lower())
    sampler, trainer = (1, 0) if islands is None else islands
    if kind == COLOCATED:
        return colocated(trainer if islands is not None else 0)
    if kind == DISAGGREGATED:
        return disaggregated(sampler, trainer)
    if kind == ASYNC:
        return asynchronous(staleness, sampler, trainer)
    raise ValueError(f"unknown RL placement {given!r}; choose one of {', '.join(KINDS)}")
