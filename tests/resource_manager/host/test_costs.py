"""Learned costs and over-budget programs on their own (resource_manager/host/costs.py): up at once, down slowly,
per tenant and template, bounded; a program over op_ms refused until the admin raises the budget."""

from __future__ import annotations

from pathways.messages import Call
from pathways.ops import Exec, Template
from resource_manager.host import costs as costs_module
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.costs import Costs


def template(name: str) -> Template:
    op = Exec("0" * 64, "s", (0,), (1,), ((),), ((),), name)
    return Template(name, 1, 2, {}, (op,))


P, Q = template("p"), template("q")


def call(tenant: str, fragment: Template, base: int = 7) -> Admitted:
    message = Call(b"", base, (), {}, ())
    return Admitted(1, tenant, message.encode(), message, fragment)


def test_a_cost_goes_up_at_once_and_down_slowly_per_tenant_and_template():
    costs = Costs()
    assert costs.of(call("a", P)) is None  # never measured
    costs.learn(("a", P), 1.0)
    costs.learn(("a", P), 0.5)
    assert costs.of(call("a", P)) == 0.9  # one quick run takes a fifth of the way down
    costs.learn(("a", P), 3.0)
    assert costs.of(call("a", P)) == 3.0
    assert costs.of(call("b", P)) is None and costs.of(call("a", Q)) is None  # no one else's, no other program's
    refusal = Admitted(1, "a", b"", None, refusal=Failure("ProgramError", "refused"))
    assert costs.of(refusal) == 0.0  # runs nothing


def test_the_least_recently_used_costs_go_first_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(costs_module, "COSTS", 2)
    costs = Costs()
    costs.learn(("a", P), 1.0)
    costs.learn(("b", P), 1.0)
    assert costs.of(call("a", P)) == 1.0  # a use keeps it
    costs.learn(("c", P), 1.0)
    assert list(costs.per_op) == [("a", P), ("c", P)]
    costs.ran_over(("a", P), 1.0)
    costs.ran_over(("b", P), 1.0)
    costs.ran_over(("c", P), 1.0)
    assert list(costs.over) == [("b", P), ("c", P)]


def test_a_program_over_op_ms_is_refused_with_the_budget_named_until_it_is_raised():
    costs = Costs()
    costs.ran_over(("a", P), 0.25)
    costs.ran_over(("a", P), 0.125)  # the longest computation counts
    entry = call("a", P, base=40)
    refused = costs.refuse(entry, 100, 3)
    assert refused.refusal is not None and not refused.counts
    assert (refused.fail_lo, refused.fail_hi) == (40, 40 + P.n_values)
    message = refused.refusal.message
    assert "op_ms budget" in message and "250 ms on island 3" in message and "limit of 100 ms" in message
    assert "pathways tenants set NAME --budget op_ms=N" in message
    assert costs.refuse(entry, 300, 3) is entry  # the admin raised it above what it took: forgotten
    assert not costs.over
