"""What each tenant's programs cost on an island, learned from how long they ran, and the programs its op_ms
budget refuses.

Estimates only decide how much goes in flight at once (what a tenant is charged is measured, never estimated).
They are kept per tenant and template, per op, learned from run times without compiling, up at once and down
slowly, so cheap calls of one program never make another look cheap, and a program that turned long is not taken
for cheap again on the strength of one quick run.

A computation cannot be stopped once it runs, so a program one of whose computations ran longer than its tenant's
``op_ms`` budget (host 0 measures) is refused from then on: its later calls, those already queued included, are
released as refusals that name the budget, until the admin raises the budget above what it took.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from pathways.errors import ResourceError, to_wire
from pathways.ops import Template
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure

COSTS = 4096  # (tenant, template) costs kept, least recently used out first

Key = tuple[str, Template | None]  # (tenant, template)


class Costs:
    """The island's learned costs and over-budget programs, the least recently used forgotten first. Not
    thread-safe: the scheduler owns it and calls it under its own lock."""

    def __init__(self) -> None:
        # seconds per op; the scheduler's release loop reads it as ``of`` does (get, then move_to_end on a hit), to
        # spare a call per place, and never changes it otherwise
        self.per_op: OrderedDict[Key, float] = OrderedDict()
        self.over: OrderedDict[Key, float] = OrderedDict()  # over its op_ms budget -> its longest computation

    def of(self, entry: Admitted) -> float | None:
        """Seconds per op of the entry's template for its tenant; None if never measured. A message that runs no
        computations (a put, a free, a refusal) costs nothing here."""
        if not entry.counts:
            return 0.0
        key = (entry.tenant, entry.template)
        cost = self.per_op.get(key)
        if cost is not None:
            self.per_op.move_to_end(key)
        return cost

    def learn(self, key: Key, per_op: float) -> None:
        """A template's cost per op: up at once to what it just took, down slowly, so that work which turned
        long is not taken for cheap again on the strength of one quick run."""
        old = self.per_op.get(key)
        self.per_op[key] = per_op if old is None or per_op > old else old + 0.2 * (per_op - old)
        self.per_op.move_to_end(key)
        while len(self.per_op) > COSTS:
            self.per_op.popitem(last=False)

    def ran_over(self, key: Key, longest: float) -> None:
        """A computation of ``key`` ran ``longest`` seconds, over its tenant's op_ms budget: refuse its later calls."""
        self.over[key] = max(longest, self.over.pop(key, 0.0))
        while len(self.over) > COSTS:
            self.over.popitem(last=False)

    def refuse(self, entry: Admitted, cap: int, island: int) -> Admitted:
        """``entry`` (of a program over budget) refused for its tenant's op_ms budget ``cap`` on ``island`` (its
        outputs fail with the reason on every host), or as it is if the admin raised the budget above what its
        computation took since."""
        key = (entry.tenant, entry.template)
        took = self.over[key]
        if took * 1e3 <= cap:
            del self.over[key]
            return entry
        template = entry.template
        error = ResourceError(
            f"over your op_ms budget: a computation of program {template.program!r} ran {took * 1e3:.0f} ms on island "
            f"{island}, over the limit of {cap} ms, and a running computation cannot be stopped, so the program "
            "is refused from now on (and your other work there is held to your share of the island's time for a "
            "while); split the work into shorter computations (fewer loop iterations or layers per call), or ask "
            "the cluster's admin to raise it (pathways tenants set NAME --budget op_ms=N)")
        base = entry.request.base
        return replace(entry, refusal=Failure(*to_wire(error)), fail_lo=base, fail_hi=base + template.n_values)
