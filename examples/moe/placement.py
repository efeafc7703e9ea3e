"""Which island holds which expert, and the controller's policy for changing it between steps.

A ``Placement`` gives, for each MoE layer and each island, the island's expert **slots**: a slot holds one
expert's weights and takes up to ``capacity`` tokens from each group that uses it. An expert may have a copy
on several islands (kept identical: their gradients are summed). The groups of island ``i`` use, for expert
``e``, the copy on island ``i`` when there is one, else the copy on the first island holding ``e``: so a
replicated expert serves each island's tokens where they are, and only experts without a local copy cost
bytes across islands. Static shapes follow from the capacities: island ``i`` sends island ``j`` a
[groups, sum of the capacities of j's slots that i uses, D] buffer per MoE layer.

The policy (``rebalance``), from the tokens each island's router sent each expert in recent steps:

1. Size every copy to its measured demand (times ``headroom``), instead of the same capacity for all.
   A capacity is a buffer shape, so this moves capacity from cold experts to hot ones without adding any:
   each island's expert work (capacity x groups served) stays within what the uniform placement gives it.
2. An expert that gets more than ``hot_factor`` times its fair share (1/E) of the layer's tokens is replicated on
   every island, each copy sized to its own island's demand: the hot expert's tokens, most of the traffic,
   never leave their island.
3. The other experts keep one copy each, placed largest first on the island with the most room left (ties:
   the island whose tokens use it most), so both islands do the same expert work.
4. Each island's capacities are then scaled, in proportion, to fill its budget exactly (rounded down, never
   below 1): measured demand is a mean over groups and a group's own demand varies around it, so the
   capacity the budget allows beyond the mean is spent where tokens go.

Why: with static shapes, capacity is what a step computes and sends, whether a position is filled or not.
Under a skewed router a uniform capacity drops the hot experts' tokens and ships the cold experts' empty
positions; sizing capacity by demand drops fewer tokens for the same work, and a local copy of each hot
expert keeps its tokens home. The controller changes the placement only when it predicts a gain of at least
``min_gain`` of the tokens (each new placement compiles new shapes once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from examples.moe.routing import Table


@dataclass(frozen=True)
class Slot:
    """One expert's copy on an island: its expert id and its capacity per group."""

    expert: int
    capacity: int


Layout = tuple[tuple[Slot, ...], ...]  # per island, its slots


@dataclass(frozen=True)
class Placement:
    """Per MoE layer, per island, the slots (``layers[m][j]``)."""

    layers: tuple[Layout, ...]
    n_experts: int

    def __post_init__(self) -> None:
        for m, layout in enumerate(self.layers):
            if len(layout) != self.islands:
                raise ValueError(f"MoE layer {m} places experts on {len(layout)} islands, layer 0 on {self.islands}")
            held = {slot.expert for slots in layout for slot in slots}
            if held != set(range(self.n_experts)):
                missing = sorted(set(range(self.n_experts)) - held)
                raise ValueError(f"MoE layer {m}: every expert needs a copy somewhere; experts {missing} have none"
                                 if missing else f"MoE layer {m} holds experts outside 0..{self.n_experts - 1}")
            for j, slots in enumerate(layout):
                experts = [slot.expert for slot in slots]
                if len(set(experts)) != len(experts):
                    raise ValueError(f"MoE layer {m} island {j} holds an expert twice: {experts}")
                if any(slot.capacity < 1 for slot in slots):
                    raise ValueError(f"MoE layer {m} island {j}: every slot needs a capacity of at least 1")

    @classmethod
    def uniform(cls, n_experts: int, islands: int, capacity: int, n_moe: int) -> Placement:
        """GShard's placement: experts split evenly in order over the islands, each with ``capacity``."""
        if islands < 1 or n_experts % islands:
            raise ValueError(f"{n_experts} experts do not split evenly over {islands} islands")
        per = n_experts // islands
        layout = tuple(tuple(Slot(e, capacity) for e in range(j * per, (j + 1) * per)) for j in range(islands))
        return cls((layout,) * n_moe, n_experts)

    @property
    def islands(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def copy_used(self, m: int, source: int, expert: int) -> tuple[int, int]:
        """(island, slot index) of the copy of ``expert`` that island ``source``'s groups use in MoE layer m."""
        layout = self.layers[m]
        order = [source] + [j for j in range(self.islands) if j != source]
        for j in order:
            for s, slot in enumerate(layout[j]):
                if slot.expert == expert:
                    return j, s
        raise ValueError(f"expert {expert} has no copy in MoE layer {m}")

    def used_slots(self, m: int, source: int, dest: int) -> list[int]:
        """The slots of island ``dest`` that island ``source``'s groups use, in slot order."""
        used = {self.copy_used(m, source, e) for e in range(self.n_experts)}
        return [s for s in range(len(self.layers[m][dest])) if (dest, s) in used]

    def users(self, m: int, dest: int, s: int) -> list[int]:
        """The islands whose groups use slot ``s`` of island ``dest``, in island order."""
        return [i for i in range(self.islands) if s in self.used_slots(m, i, dest)]

    def table(self, m: int, source: int) -> Table:
        """The capacity axis of island ``source``'s groups: each destination island's used slots, in order."""
        offset, cap, width = [0] * self.n_experts, [0] * self.n_experts, 0
        for dest in range(self.islands):
            for s in self.used_slots(m, source, dest):
                slot = self.layers[m][dest][s]
                offset[slot.expert], cap[slot.expert] = width, slot.capacity
                width += slot.capacity
        return Table(tuple(offset), tuple(cap), width)

    def width(self, m: int, source: int, dest: int) -> int:
        """Positions per group that island ``source`` sends island ``dest`` in MoE layer m."""
        return sum(self.layers[m][dest][s].capacity for s in self.used_slots(m, source, dest))

    def replicated(self, m: int, expert: int) -> list[tuple[int, int]]:
        """Every copy of ``expert`` in MoE layer m: (island, slot), in island order."""
        return [(j, s) for j, slots in enumerate(self.layers[m]) for s, slot in enumerate(slots)
                if slot.expert == expert]

    def work(self, m: int, dest: int, groups: Sequence[int]) -> int:
        """Token positions island ``dest``'s experts process in MoE layer m, given each island's group count."""
        return sum(self.layers[m][dest][s].capacity * sum(groups[i] for i in self.users(m, dest, s))
                   for s in range(len(self.layers[m][dest])))

    def bytes_across(self, groups: Sequence[int], d_model: int, itemsize: int = 4) -> int:
        """Token bytes crossing islands per training step: each MoE layer's dispatch and its return, forward and
        backward (the cotangents take the same shapes), for every pair of islands."""
        total = 0
        for m in range(len(self.layers)):
            for i in range(self.islands):
                for j in range(self.islands):
                    if i != j:
                        total += 4 * groups[i] * self.width(m, i, j) * d_model * itemsize
        return total


def predicted_drops(placement: Placement, demand: np.ndarray) -> float:
    """Fraction of routing choices a placement would drop, from per-group demand [M, islands, E] (mean tokens
    per group each island's router sends each expert; spread between groups is ignored)."""
    dropped = total = 0.0
    for m in range(len(placement.layers)):
        for i in range(placement.islands):
            cap = placement.table(m, i).cap
            dropped += float(np.maximum(demand[m, i] - np.asarray(cap), 0.0).sum())
            total += float(demand[m, i].sum())
    return dropped / total if total else 0.0


@dataclass(frozen=True)
class Policy:
    """The controller's knobs (see the module docstring)."""

    headroom: float = 1.25  # capacity = headroom x measured demand per group (GShard's capacity factor)
    hot_factor: float = 1.5  # an expert with this many times its fair share of choices gets a copy on every island
    min_gain: float = 0.01  # re-place only to save at least this fraction of the choices from being dropped


def rebalance(reference: Placement, demand: np.ndarray, groups: Sequence[int], policy: Policy = Policy()
              ) -> Placement:
    """A placement for the measured per-group ``demand`` [M, islands, E], giving no island more expert work than
    the mean of what ``reference`` (the uniform placement) gives each island."""
    islands, experts = reference.islands, reference.n_experts
    if demand.shape != (len(reference.layers), islands, experts):
        raise ValueError(f"demand has shape {demand.shape}, expected (MoE layers, islands, experts) = "
                         f"{(len(reference.layers), islands, experts)}")
    layers = []
    for m in range(len(reference.layers)):
        budget = sum(reference.work(m, j, groups) for j in range(islands)) / islands
        layers.append(_place_layer(demand[m], groups, budget, policy))
    return Placement(tuple(layers), experts)


def _place_layer(demand: np.ndarray, groups: Sequence[int], budget: float, policy: Policy) -> Layout:
    islands, experts = demand.shape
    share = demand.sum(axis=0) / max(demand.sum(), 1e-9)
    slots: list[list[Slot]] = [[] for _ in range(islands)]
    work = [0.0] * islands
    hot = [e for e in np.argsort(-share) if share[e] > policy.hot_factor / experts]
    for e in hot:
        for j in range(islands):
            cap = max(1, math.ceil(policy.headroom * demand[j, e]))
            slots[j].append(Slot(int(e), cap))
            work[j] += cap * groups[j]
    cold = [int(e) for e in np.argsort(-share, kind="stable") if e not in hot]
    for e in cold:
        cap = max(1, math.ceil(policy.headroom * float(demand[:, e].max())))
        j = min(range(islands), key=lambda k: (work[k], -demand[k, e], k))
        slots[j].append(Slot(e, cap))
        work[j] += cap * sum(groups)
    layout = []
    for j in range(islands):
        placed = sorted(slots[j], key=lambda slot: slot.expert)
        if work[j]:
            scale = budget / work[j]
            placed = [Slot(slot.expert, max(1, math.floor(slot.capacity * scale))) for slot in placed]
        layout.append(tuple(placed))
    return tuple(layout)


class Controller:
    """Keeps the recent per-expert token counts the steps return and decides, between steps, whether to place
    the experts anew (``decide``). It never touches the model: a placement only changes where experts run
    and how much each copy takes."""

    def __init__(self, placement: Placement, groups: Sequence[int], policy: Policy = Policy(),
                 window: int = 4) -> None:
        self.reference = self.placement = placement  # the budget: no island does more expert work than here
        self.groups, self.policy, self.window = list(groups), policy, window
        self.history: list[np.ndarray] = []

    def observe(self, demand: Sequence[np.ndarray]) -> None:
        """One step's demand: per island, [M, E] choices its router made (before capacity)."""
        per_group = np.stack([np.asarray(d, np.float64) / g for d, g in zip(demand, self.groups)], axis=1)
        self.history = (self.history + [per_group])[-self.window:]

    def decide(self) -> Placement | None:
        """A new placement when it is predicted to drop ``policy.min_gain`` fewer choices, else None."""
        if not self.history:
            return None
        demand = np.mean(self.history, axis=0)
        candidate = rebalance(self.reference, demand, self.groups, self.policy)
        gain = predicted_drops(self.placement, demand) - predicted_drops(candidate, demand)
        if candidate == self.placement or gain < self.policy.min_gain:
            return None
        self.placement = candidate
        return candidate
