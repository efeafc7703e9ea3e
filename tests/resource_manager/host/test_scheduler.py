"""An island's scheduler (resource_manager/host/scheduler.py): one total order, a window of fragments in flight,
weighted fair share between tenants in every stretch of time, charges that are measured and never claimed, long
fragments in parts, blocked fragments leaving the window, and a parked fragment resumed ahead of new work once
every host has its data."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import pytest

from pathways.messages import CLIENT_ID_BITS, Call
from pathways.ops import Aval, Exec, Recv, Template
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.scheduler import Continue, Group, Resume, Scheduler


def template(name: str = "p", ops: int = 1) -> Template:
    """A fragment template of ``ops`` computations (what they compute does not matter to the scheduler)."""
    op = Exec("0" * 64, "s", (0,), (1,), ((),), ((),), name)
    return Template(name, 1, 2, {}, (op,) * ops)


ONE = template()


def admitted(client: int, tenant: str, k: int, fragment: Template = ONE) -> Admitted:
    """Message ``k`` of a client: a call (it runs computations, so it counts against the tenant's share)."""
    call = Call(b"", (client << CLIENT_ID_BITS) + k, (), {}, ())
    return Admitted(client, tenant, call.encode(), call, fragment)


def refused(client: int, tenant: str) -> Admitted:
    """A message admission refused: it takes a place in the order but runs nothing."""
    return Admitted(client, tenant, b"", None, refusal=Failure("ProgramError", "refused"))


def seqs(released) -> list[int]:
    return [seq for seq, _ in released]


def tenants_of(released) -> list[str]:
    return [item.tenant for _, item in released]


def run_to_the_end(scheduler: Scheduler, released: list, total: int, busy: float = 1e-3) -> list:
    """The island runs everything in flight, ``busy`` seconds each, and reports it at once, until ``total``
    fragments were released."""
    done = 0
    while done < total:
        pending = released[done:]
        assert pending, f"nothing in flight after {done} of {total}: the scheduler stalled"
        done = len(released)
        released += scheduler.completed([[seq, busy] for seq, _ in pending])
    return released


def measured(scheduler: Scheduler, tenants: dict[str, int], busy: float = 1e-3, fragment: Template = ONE) -> None:
    """Each tenant (by client) ran one fragment of ``fragment`` already, so its cost is known; the island is idle."""
    released = []
    for tenant, client in tenants.items():
        released += scheduler.queue([admitted(client, tenant, 10**6, fragment)])
    run_to_the_end(scheduler, released, len(tenants), busy)


def weighted(weights: dict[str, float], busy: float) -> tuple[Scheduler, dict[str, int]]:
    """A grouping scheduler with these tenants' weights, each tenant (one client each) measured at ``busy``."""
    scheduler = Scheduler(0, 1, group=32)
    for tenant, weight in weights.items():
        scheduler.set_weight(tenant, weight)
    clients = {t: k for k, t in enumerate(weights, start=1)}
    measured(scheduler, clients, busy=busy)
    return scheduler, clients


class Island:
    """A one-host island in simulated time: it runs what the scheduler released one at a time in sequence order
    (``cost(tenant, template)`` seconds per op) and reports each completion at once."""

    def __init__(self, scheduler: Scheduler, cost: Callable[[str, Template], float]) -> None:
        self.scheduler, self.cost = scheduler, cost
        self.pending: deque = deque()
        self.first: dict[int, Admitted] = {}  # long fragments' first parts, for their continuations
        self.continued: list[Continue] = []
        self.clock = 0.0
        self.log: list[tuple[float, float, str, int]] = []  # (start, end, tenant, seq)

    def queue(self, entries: list[Admitted]) -> None:
        self.pending.extend(self.scheduler.queue(entries))

    def step(self) -> None:
        seq, item = self.pending.popleft()
        if isinstance(item, Group):
            entry, ops = item.entries[0], sum(len(e.template.ops) for e in item.entries)
        elif isinstance(item, Continue):
            entry, ops = self.first[item.seq], item.hi - item.lo
            self.continued.append(item)
        else:
            entry, ops = item, (item.end or len(item.template.ops)) if item.counts else 0
            if item.end is not None:
                self.first[seq] = item
        if ops:
            busy = ops * self.cost(entry.tenant, entry.template)
            self.log.append((self.clock, self.clock + busy, entry.tenant, seq))
            self.clock += busy
            self.pending.extend(self.scheduler.completed([[seq, busy]]))

    def run(self, seconds: float) -> None:
        """Run for ``seconds`` more of simulated time (or until nothing is left)."""
        until = self.clock + seconds
        while self.pending and self.clock < until:
            self.step()

    def time(self, tenant: str, start: float, end: float) -> float:
        """Island seconds ``tenant`` got between ``start`` and ``end``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b, t, _ in self.log if t == tenant)


def test_the_scheduler_keeps_one_order_and_shares_by_weight():
    scheduler = Scheduler(0, 1, window=8, eager=2)
    measured(scheduler, {"light": 1, "heavy": 2})
    released = []
    for client, (tenant, weight) in enumerate({"light": 1.0, "heavy": 3.0}.items(), start=1):
        scheduler.set_weight(tenant, weight)
        for k in range(200):
            released += scheduler.queue([admitted(client, tenant, k)])
    assert 0 < len(released) <= 8, "the window bounds what is in flight"
    done = 0
    while done < 400:  # the island runs everything in flight, 1 ms each, and reports it at once
        pending = released[done:]
        assert 0 < len(pending) <= 8
        done = len(released)
        released += scheduler.completed([[seq, 1e-3] for seq, _ in pending])
    assert seqs(released) == list(range(2, 402))
    tenants = tenants_of(released[8:200])  # after the first window, sent before heavy arrived
    assert 2.7 < tenants.count("heavy") / tenants.count("light") < 3.3  # weights 3:1
    for tenant in ("light", "heavy"):  # each client's messages keep their order
        bases = [item.request.base for _, item in released if item.tenant == tenant]
        assert bases == sorted(bases)


def test_equal_weights_alternate_and_every_message_is_released_once_in_sequence():
    scheduler = Scheduler(0, 1, window=4, eager=4)
    measured(scheduler, {"a": 1, "b": 2})
    released = scheduler.queue([admitted(1, "a", k) for k in range(50)] + [admitted(2, "b", k) for k in range(50)])
    released = run_to_the_end(scheduler, released, 100)
    assert seqs(released) == list(range(2, 102))
    assert sorted((item.client, item.request.base) for _, item in released) == sorted(
        (c, (c << CLIENT_ID_BITS) + k) for c in (1, 2) for k in range(50))
    middle = tenants_of(released[10:90])
    assert abs(middle.count("a") - middle.count("b")) <= 4, middle


def test_the_window_bounds_the_fragments_in_flight():
    scheduler = Scheduler(0, 1, window=3, window_s=10.0, eager=100)
    measured(scheduler, {"a": 1})
    released = scheduler.queue([admitted(1, "a", k) for k in range(10)])
    assert seqs(released) == [1, 2, 3]
    assert scheduler.stats()["inflight"] == 3 and scheduler.stats()["queued"] == 7
    assert seqs(scheduler.completed([[1, 1e-3]])) == [4]  # one left the window, one more enters


def test_the_window_also_bounds_the_estimated_island_time_in_flight():
    # the template takes 1 ms: 2.5 ms admit three (the window is reached after the 3rd)
    scheduler = Scheduler(0, 1, window=64, window_s=0.0025, eager=100)
    measured(scheduler, {"a": 1})
    assert len(scheduler.queue([admitted(1, "a", k) for k in range(10)])) == 3


def test_while_several_tenants_have_work_queued_the_window_is_halved():
    """What a tenant has in flight is charged when it completes, all at once: it is how far its charged time can be
    from its share at any moment, so while tenants wait for each other half the window's island time goes at once."""
    # the template takes 1 ms: alone, 6 ms admit six; with another tenant waiting, 3 ms admit three
    scheduler = Scheduler(0, 1, window=64, window_s=0.006, eager=100)
    measured(scheduler, {"a": 1, "b": 2})
    assert len(scheduler.queue([admitted(1, "a", k) for k in range(10)])) == 6
    scheduler = Scheduler(0, 1, window=64, window_s=0.006, eager=100)
    measured(scheduler, {"a": 1, "b": 2})
    released = scheduler.queue([admitted(1, "a", k) for k in range(10)] + [admitted(2, "b", k) for k in range(10)])
    assert len(released) == 3 and set(tenants_of(released)) == {"a", "b"}


def test_a_lone_fragment_longer_than_the_window_still_runs():
    scheduler = Scheduler(0, 1, window=64, window_s=0.001, eager=100)
    measured(scheduler, {"a": 1}, busy=5.0)  # the template's estimate is far over the window
    assert seqs(scheduler.queue([admitted(1, "a", 1), admitted(1, "a", 2)])) == [1]


def test_once_eager_fragments_are_in_flight_new_messages_wait_for_a_completion():
    scheduler = Scheduler(0, 1, window=64, eager=2)
    measured(scheduler, {"a": 1})
    assert seqs(scheduler.queue([admitted(1, "a", 0), admitted(1, "a", 1)])) == [1, 2]
    assert scheduler.queue([admitted(1, "a", 2)]) == [] and scheduler.queue([admitted(1, "a", 3)]) == []
    assert seqs(scheduler.completed([[1, 1e-3]])) == [3, 4]  # released together, with the report


def test_messages_that_run_nothing_take_a_place_in_the_order_but_not_in_the_window():
    scheduler = Scheduler(0, 1, window=1, eager=100)
    released = scheduler.queue([admitted(1, "a", 0), refused(1, "a"), refused(1, "a")])
    assert seqs(released) == [0]  # the call fills the window of one
    released = scheduler.completed([[0, 1e-3]])
    assert seqs(released) == [1, 2] and scheduler.stats()["inflight"] == 0
    assert scheduler.stats()["fragments"] == {"a": 1}


def test_island_time_used_is_charged_to_the_tenant_by_its_weight():
    """A tenant whose fragments take 3x as long gets a third as many of them at equal weights."""
    scheduler = Scheduler(0, 1, window=2, eager=2)
    released = scheduler.queue([admitted(1, "slow", k) for k in range(200)] +
                               [admitted(2, "fast", k) for k in range(200)])
    done = 0
    while done < 240:
        pending = released[done:]
        done = len(released)
        released += scheduler.completed([[seq, 3e-3 if item.tenant == "slow" else 1e-3] for seq, item in pending])
    later = tenants_of(released[40:240])  # once the estimates have learned each tenant's time
    assert 2.5 < later.count("fast") / later.count("slow") < 3.5, (later.count("fast"), later.count("slow"))
    stats = scheduler.stats()
    assert stats["tenant_time_s"]["slow"] == pytest.approx(3e-3 * stats["fragments"]["slow"], rel=0.05)


def test_a_fragment_that_ran_longer_than_its_estimate_is_charged_what_it_used():
    """Charged at release by its estimate, corrected by the time it reported: a 50 ms fragment of a 1 ms template
    puts its tenant behind the other one by about 49 ms of the other's fragments (its debt), while the other
    keeps waiting for work."""
    scheduler = Scheduler(0, 1, window=2, eager=2)
    measured(scheduler, {"a": 1, "b": 2})
    released = scheduler.queue([admitted(1, "a", k) for k in range(30)] + [admitted(2, "b", k) for k in range(60)])
    assert tenants_of(released) == ["a", "b"]
    released = scheduler.completed([[released[0][0], 0.05], [released[1][0], 1e-3]])
    done = 0
    while done < len(released) and len(released) < 48:
        pending = released[done:]
        done = len(released)
        released += scheduler.completed([[seq, 1e-3] for seq, _ in pending])
    assert tenants_of(released[:48]).count("b") >= 46


def test_the_starving_order_of_the_tenancy_benchmark_starves_no_one():
    """What ``benchmarks.tenancy`` hit in one run of three: each tenant's first call compiled its executable
    (charged 0.30, 0.20, 0.23 and 0.12 s of island time to the tenants of weights 1, 2, 4 and 8), the island went
    idle until the measurement began, and then all four kept it busy, the weight-1 tenant's first messages
    arriving last. Its compile had put it ~0.3 s of pass ahead, which the others would have needed 14 x 0.3 s of
    island time to catch up: it got nothing for over 4 s. A debt is owed only while someone waits; the busy
    period that ended forgave it, and now every tenant gets its share in every half second from the start."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    compile_s = {"w1": 0.299, "w2": 0.198, "w8": 0.125, "w4": 0.230}
    scheduler = Scheduler(0, 1)
    for tenant, weight in weights.items():
        scheduler.set_weight(tenant, weight)
    clients = {t: k for k, t in enumerate(weights, start=1)}
    island = Island(scheduler, lambda tenant, _: 1.6e-3)
    startup = []
    for tenant in compile_s:  # the order their first calls came in
        startup += scheduler.queue([admitted(clients[tenant], tenant, 0)])
    for seq, item in startup:
        scheduler.completed([[seq, compile_s[item.tenant], compile_s[item.tenant]]])  # all of it compiling
    for tenant in ("w4", "w8", "w2", "w1"):  # the backlogs, weight-1 last
        island.queue([admitted(clients[tenant], tenant, k) for k in range(1, 2000)])
    island.run(3.0)
    total = sum(weights.values())
    for start in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5):  # each half second: the weight-1 tenant's share is 21 fragments
        used = {t: island.time(t, start, start + 0.5) for t in weights}
        for tenant, weight in weights.items():
            share = used[tenant] / sum(used.values())
            assert share == pytest.approx(weight / total, rel=0.1), (start, tenant, used)


def test_a_debt_is_kept_while_others_wait_and_forgiven_when_the_island_goes_idle():
    scheduler = Scheduler(0, 1)
    measured(scheduler, {"a": 1, "b": 2})
    island = Island(scheduler, lambda tenant, _: 1e-3)
    island.queue([admitted(1, "a", 0)])
    island.queue([admitted(2, "b", k) for k in range(1000)])
    seq, item = island.pending.popleft()  # a's fragment ran 0.2 s where 1 ms was expected, while b waited
    assert item.tenant == "a"
    island.pending.extend(scheduler.completed([[seq, 0.2]]))
    island.queue([admitted(1, "a", k) for k in range(1, 1000)])
    island.run(0.19)
    assert island.time("a", 0, 0.19) < 0.01  # a pays: b catches up first
    island.run(5.0)
    assert not island.pending  # the island went idle
    assert scheduler.stats()["tenants"]["a"]["lag_s"] <= 0  # ... and no debt is carried into the next busy period


def test_a_tenant_joining_while_others_are_backlogged_gets_its_share_within_one_quantum():
    scheduler = Scheduler(0, 1)
    for tenant, weight in {"a": 1.0, "b": 1.0, "late": 2.0}.items():
        scheduler.set_weight(tenant, weight)
    measured(scheduler, {"a": 1, "b": 2, "late": 3})
    island = Island(scheduler, lambda tenant, _: 1e-3)
    island.queue([admitted(1, "a", k) for k in range(5000)])
    island.queue([admitted(2, "b", k) for k in range(5000)])
    island.run(2.0)  # a and b ran alone for 2 s: that banks "late" nothing
    joined = island.clock
    island.queue([admitted(3, "late", k) for k in range(5000)])
    island.run(1.0)
    first = next(start for start, _, tenant, _ in island.log if tenant == "late")
    assert first - joined <= scheduler.window_s + 2e-3  # what was in flight when it came, no more
    assert island.time("late", joined, joined + 1.0) == pytest.approx(0.5, rel=0.05)  # weight 2 of 4
    for start in (joined + 0.2, joined + 0.45, joined + 0.7):  # and so in every quarter second once it caught up
        assert island.time("late", start, start + 0.25) == pytest.approx(0.125, rel=0.05)


def test_an_idle_tenant_banks_at_most_one_quantum_of_credit():
    """A tenant that was away while another used the island comes back at most its share of ``credit_s`` of island
    time behind it: it goes first for a moment (a tenant that sends now and then keeps a low latency), but it does
    not get the whole island for as long as it was away."""
    scheduler = Scheduler(0, 1, credit_s=0.05)
    measured(scheduler, {"busy": 1, "away": 2})
    island = Island(scheduler, lambda tenant, _: 1e-3)
    island.queue([admitted(1, "busy", k) for k in range(20000)])
    island.run(5.0)
    back = island.clock
    island.queue([admitted(2, "away", k) for k in range(20000)])
    island.run(1.0)
    ahead = island.time("away", back, back + 1.0) - island.time("busy", back, back + 1.0)
    assert ahead <= 0.025 + 2e-3  # half of one quantum (its weight's share) more than the other, not 5 s
    # served once what was in flight when it came back ran (a window, 50 ms): its credit first, then half
    assert island.time("away", back, back + 0.1) >= 0.025 + 0.0125 - 2e-3
    assert island.time("away", back + 0.5, back + 1.0) == pytest.approx(0.25, rel=0.05)


def test_a_long_fragment_runs_in_parts_each_with_its_own_place_in_the_order():
    scheduler = Scheduler(0, 1, first_part_ops=100, part_s=0.01)
    big = template("big", 1000)
    measured(scheduler, {"small": 2})
    island = Island(scheduler, lambda tenant, _: 1e-3 if tenant == "small" else 1e-4)
    island.queue([admitted(1, "huge", 0, big)])
    island.queue([admitted(2, "small", k) for k in range(2)])
    first_seq, first = island.pending[0]
    assert first.end == 100  # not measured yet: a first part of ``first_part_ops`` ops
    island.run(10.0)
    assert {c.seq for c in island.continued} == {first_seq}
    spans = [(0, 100)] + [(c.lo, c.hi) for c in island.continued]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == 1000  # every op, once, in order
    assert all(hi - lo == 100 for lo, hi in spans[1:])  # measured at 0.1 ms per op: parts of 10 ms
    small = [start for start, _, tenant, _ in island.log if tenant == "small"]
    assert small[0] < 0.011 and small[1] < 0.05  # neither waited for the whole 0.1 s program


def calls_of(released) -> list[Admitted]:
    """The calls released, a group's each in its order."""
    return [entry for _, item in released for entry in (item.entries if isinstance(item, Group) else (item,))]


def test_calls_of_one_program_queued_back_to_back_share_one_place_in_the_order():
    scheduler = Scheduler(0, 1, window=20, window_s=10.0, eager=100, part_s=1.0, group=8)
    measured(scheduler, {"a": 1})
    released = scheduler.queue([admitted(1, "a", k) for k in range(30)])
    assert [len(item.entries) for _, item in released] == [8, 8, 4]  # the window counts each call
    assert seqs(released) == [1, 2, 3]
    assert [c.request.base for c in calls_of(released)] == [(1 << CLIENT_ID_BITS) + k for k in range(20)]
    assert scheduler.stats()["inflight"] == 20 and scheduler.stats()["fragments"]["a"] == 21
    more = scheduler.completed([[1, 8e-3]])  # one group done: its 8 calls leave the window
    assert seqs(more) == [4] and len(more[0][1].entries) == 8
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(9e-3)


def test_a_group_stays_within_one_part_and_never_mixes_programs_or_unmeasured_calls():
    scheduler = Scheduler(0, 1, window=64, window_s=10.0, eager=100, part_s=0.0035, group=32)
    other = template("other")
    measured(scheduler, {"a": 1})  # ONE: 1 ms per call, so a part of 3.5 ms holds 3 calls
    released = scheduler.queue([admitted(1, "a", k) for k in range(5)] + [admitted(1, "a", 5, other)]
                               + [admitted(1, "a", k) for k in range(6, 8)])
    assert [len(item.entries) if isinstance(item, Group) else 1 for _, item in released] == [3, 2, 1, 2]
    assert released[2][1].template is other  # never measured: alone
    receives = Template("recv", 0, 1, {}, (Recv(0, "s", ((),), Aval((4,), "float32"), 1, ()),))
    scheduler = Scheduler(0, 1, window=64, window_s=10.0, eager=100, group=32)
    measured(scheduler, {"a": 1}, fragment=receives)
    released = scheduler.queue([admitted(1, "a", k, receives) for k in range(4)])
    assert seqs(released) == [1, 2, 3, 4]  # a fragment that may park is never grouped


def test_grouped_calls_share_the_island_by_weight():
    scheduler = Scheduler(0, 1, group=32)
    measured(scheduler, {"light": 1, "heavy": 2}, busy=1e-4)
    scheduler.set_weight("heavy", 3.0)
    island = Island(scheduler, lambda tenant, _: 1e-4)
    island.queue([admitted(1, "light", k) for k in range(20000)])
    island.queue([admitted(2, "heavy", k) for k in range(20000)])
    island.run(1.0)
    assert island.time("heavy", 0.1, 1.0) / island.time("light", 0.1, 1.0) == pytest.approx(3.0, rel=0.1)
    assert max(end - start for start, end, _, _ in island.log) <= scheduler.part_s + 1e-9


def test_while_tenants_wait_each_place_is_its_weights_share_of_the_shared_part():
    """A place is the unit a tenant can be ahead or behind of its share by; on a busy machine a weight-1 tenant among
    1:2:4:8 gets about 0.13 s of island time in 6 s, so a place of its share of the whole part (1.7 ms) moved its
    measured share by over 2% from one reading to the next. Places of the shared part keep it within about 1%."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    call_s = 1e-3
    scheduler, clients = weighted(weights, call_s)
    island = Island(scheduler, lambda tenant, _: call_s)
    for tenant, client in clients.items():
        island.queue([admitted(client, tenant, k) for k in range(8000)])
    island.run(4.0)
    total = sum(weights.values())
    for tenant, weight in weights.items():
        places = [b - a for a, b, t, _ in island.log if t == tenant and a > 0.1]
        assert max(places) <= scheduler.shared_part_s * weight / total + call_s + 1e-9
    assert max(b - a for a, b, t, _ in island.log if t == "w8") >= 5 * call_s  # grouped, not call by call
    assert scheduler.shared_part_s < scheduler.part_s
    for start in (0.2, 1.1, 2.9):  # any stretch of 0.5 s: each tenant within one place of its share
        for tenant, weight in weights.items():
            got = island.time(tenant, start, start + 0.5)
            assert got == pytest.approx(0.5 * weight / total, abs=scheduler.shared_part_s * weight / total + call_s)


def test_admission_work_is_charged_to_the_tenant_that_caused_it():
    scheduler = Scheduler(0, 1)
    measured(scheduler, {"a": 1, "b": 2})
    island = Island(scheduler, lambda tenant, _: 1e-3)
    island.queue([admitted(1, "a", k) for k in range(2000)])
    island.queue([admitted(2, "b", k) for k in range(2000)])
    scheduler.charge("a", 0.1)  # decoding a's messages took 0.1 s of the island
    island.run(0.3)
    assert island.time("a", 0, 0.3) == pytest.approx(0.1, abs=0.02)  # 0.1 s + 0.1 s = b's 0.2 s (not 0.15)
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(0.1 + island.time("a", 0, 0.3) + 1e-3, abs=2e-3)


def test_admission_work_for_a_batch_is_charged_with_each_message_as_it_takes_its_place():
    """A client's batch is admitted at once; its admission work is charged a like part per message as they are
    released, not in one lump that would put a tenant with a small share behind for a while, then ahead. The last
    call of the batch before completing while the next batch is admitted does not make the tenant look idle."""
    scheduler = Scheduler(0, 1, window=1)
    measured(scheduler, {"a": 1})
    before = scheduler.stats()["tenant_time_s"]["a"]
    released = scheduler.queue([admitted(1, "a", k) for k in range(64)], "a", 0.064)
    assert len(released) == 1  # the window takes one call
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(before + 1e-3)
    for _ in range(63):
        released = scheduler.completed([[released[0][0], 1e-3]])
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(before + 0.064 + 63e-3)
    assert scheduler.queue([admitted(1, "a", k) for k in range(64, 96)], "a", 0.064) == []  # the window is full
    scheduler.completed([[released[0][0], 1e-3]])  # the first batch's last call: a's next is released
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(before + 0.066 + 64e-3)
    assert scheduler.queue([], "a", 0.005) == []  # no message: charged at once
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(before + 0.071 + 64e-3)
    assert scheduler.queue([], "a", 0.010, messages=10) == []  # held for a gap in the stream: charged as they go
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(before + 0.071 + 64e-3)


def test_a_template_never_measured_has_one_fragment_of_its_tenant_in_flight():
    scheduler = Scheduler(0, 1, eager=100)
    released = scheduler.queue([admitted(1, "a", k) for k in range(5)] + [admitted(2, "b", k) for k in range(5)])
    assert tenants_of(released) == ["a", "b"]  # one each, until each has a measurement
    released = scheduler.completed([[0, 1e-3]])
    assert tenants_of(released).count("a") == 4  # a's template is measured now: the window takes the rest


def test_cheap_calls_do_not_make_a_long_program_look_cheap():
    """A tenant keeps its estimate low with many tiny calls and sends bursts of long computations: estimated per
    tenant, each burst filled the window and a weight-3 tenant waited 18.8 s. Estimated per template, the long
    program is measured once and then costs what it takes; the other tenant waits for at most one of them."""
    weights = {"abuser": 1.0, "victim": 3.0}
    scheduler = Scheduler(0, 1)
    for tenant, weight in weights.items():
        scheduler.set_weight(tenant, weight)
    cheap, long = template("cheap"), template("long")
    island = Island(scheduler, lambda tenant, t: 0.5 if t is long else 1e-4)
    measured(scheduler, {"victim": 2})
    for burst in range(5):
        island.queue([admitted(1, "abuser", 100 * burst + k, cheap) for k in range(50)])
        island.queue([admitted(1, "abuser", 100 * burst + 50 + k, long) for k in range(20)])
    waits = []
    for k in range(40):  # the victim: one small call, then a quarter of a second of thinking, 40 times
        arrive = island.clock
        island.queue([admitted(2, "victim", k)])
        while not any(t == "victim" and start >= arrive for start, _, t, _ in island.log):
            island.step()
        waits.append(island.log[-1][1] - arrive)
        island.run(0.25)
    assert max(waits) <= 0.5 + 0.05  # one long computation in flight, never a window of them


def test_a_blocked_fragment_leaves_the_window_and_is_still_charged_when_it_completes():
    scheduler = Scheduler(0, 1, window=2, eager=100)
    measured(scheduler, {"a": 1})
    released = scheduler.queue([admitted(1, "a", k) for k in range(5)])
    assert seqs(released) == [1, 2]
    assert seqs(scheduler.blocked([1])) == [3]  # waiting on another island's transfer: it makes room
    stats = scheduler.stats()
    assert (stats["inflight"], stats["blocked"]) == (2, 1)
    assert seqs(scheduler.completed([[1, 0.5]])) == []  # it was out of the window: no room made
    assert scheduler.stats()["blocked"] == 0 and scheduler.stats()["tenant_time_s"] == {"a": 0.5 + 1e-3}


def test_blocked_and_completed_reports_of_unknown_fragments_change_nothing():
    scheduler = Scheduler(0, 1, window=2, eager=100)
    measured(scheduler, {"a": 1})
    scheduler.queue([admitted(1, "a", k) for k in range(3)])
    assert scheduler.blocked([99]) == [] and scheduler.completed([[98, 1.0]]) == []
    assert scheduler.stats()["tenant_time_s"] == {"a": 1e-3} and scheduler.stats()["inflight"] == 2


def test_a_parked_receive_resumes_only_once_every_host_has_its_data():
    scheduler = Scheduler(0, n_hosts=3, window=4, eager=100)
    scheduler.queue([admitted(1, "a", 0)])
    assert scheduler.landed(0, [(0, 2)]) == []
    assert scheduler.landed(0, [(0, 2)]) == []  # the same host again does not count twice
    assert scheduler.landed(2, [(0, 2)]) == [] and scheduler.stats()["parked"] == 1
    assert scheduler.landed(1, [(0, 2)]) == [(1, Resume(0, 2))]
    assert scheduler.stats()["parked"] == 0


def test_a_resume_goes_ahead_of_new_work_and_takes_no_place_in_the_window():
    scheduler = Scheduler(0, n_hosts=2, window=8, eager=1)
    measured(scheduler, {"a": 1, "b": 2})
    scheduler.queue([admitted(1, "a", 0)])  # seq 2, parks at its receive (op 1)
    assert scheduler.queue([admitted(2, "b", k) for k in range(3)]) == []  # eager: they wait
    scheduler.landed(0, [(2, 1)])
    released = scheduler.landed(1, [(2, 1)])
    assert released[0] == (3, Resume(2, 1))
    assert seqs(released) == [3, 4, 5, 6] and tenants_of(released[1:]) == ["b", "b", "b"]
    assert scheduler.stats()["inflight"] == 4  # the fragment of seq 2 and b's three; the resume is not one


def test_weights_come_from_set_weight():
    scheduler = Scheduler(0, 1)
    scheduler.set_weight("a", 2.5)
    assert scheduler.stats()["weights"] == {"a": 2.5}


def test_the_admin_sees_how_long_a_tenant_had_nothing_queued_or_in_flight():
    scheduler = Scheduler(0, 1)
    measured(scheduler, {"a": 1})
    time.sleep(0.05)
    assert scheduler.stats()["tenants"]["a"]["idle_s"] >= 0.05
    released = scheduler.queue([admitted(1, "a", 1)])
    idle = scheduler.stats()["tenants"]["a"]["idle_s"]
    time.sleep(0.05)
    assert scheduler.stats()["tenants"]["a"]["idle_s"] == idle  # backlogged: the count stands still
    scheduler.completed([[released[0][0], 1e-3]])
    time.sleep(0.02)
    assert scheduler.stats()["tenants"]["a"]["idle_s"] >= idle + 0.02


def test_a_program_whose_computation_ran_over_op_ms_is_refused_from_then_on():
    """A running computation cannot be stopped: once one ran past its tenant's op_ms budget, its program's later
    calls (those already queued too) are released as refusals naming the budget; the tenant's other programs and
    other tenants' calls run as before, and raising the budget lets the program run again."""
    caps = {"a": 100, "b": 100}
    scheduler = Scheduler(0, 1, window=64, eager=100, op_cap_ms=caps.__getitem__)
    long, short = template("long"), template("short")
    first = scheduler.queue([admitted(1, "a", k, long) for k in range(3)])
    assert seqs(first) == [0]  # never measured: one in flight
    late = scheduler.completed([[0, 0.35, 0.05, 0.3]])  # compiled 50 ms, then computed 300 ms in one computation
    later = scheduler.queue([admitted(1, "a", 3, short), admitted(2, "b", 0, long)])
    refusals = [item for _, item in late + later if item.refusal is not None]
    assert [item.request.base & 0xFFFF for item in refusals] == [1, 2]  # a's two queued calls of "long"
    for item in refusals:
        assert item.refusal.kind == "ResourceError" and "op_ms" in item.refusal.message
        assert "300 ms" in item.refusal.message and "long" in item.refusal.message
        assert (item.fail_lo, item.fail_hi) == (item.request.base, item.request.base + long.n_values)
    ran = [(item.tenant, item.template.program) for _, item in late + later if item.counts]
    assert ("a", "short") in ran and ("b", "long") in ran  # its other program, and b's copy of it, run
    caps["a"] = 1000  # the admin raised a's budget over what the computation took
    again = run_to_the_end(scheduler, scheduler.queue([admitted(1, "a", 4, long)]), 1)
    assert [item.counts for _, item in again if item.tenant == "a"] == [True]


def test_a_computation_within_op_ms_or_a_long_compile_is_not_refused():
    scheduler = Scheduler(0, 1, window=64, eager=100, op_cap_ms=lambda tenant: 100)
    assert seqs(scheduler.queue([admitted(1, "a", 0), admitted(1, "a", 1)])) == [0]
    released = scheduler.completed([[0, 2.05, 2.0, 0.05]])  # two seconds compiling, 50 ms computing
    assert [item.refusal for _, item in released] == [None]


def test_the_recent_island_time_covers_the_last_ten_seconds_in_bounded_memory(monkeypatch):
    """What status shows as each tenant's recent share: the island time of about the last ``RECENT_S`` seconds,
    kept per second, so a tenant's thousands of fragments a second cost the scheduler a few buckets."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    scheduler = Scheduler(0, 1)
    for k in range(20000):  # 1,000 charges a second for 20 s, three in four of them a's
        clock[0] = 1000.0 + k * 1e-3
        scheduler.charge("b" if k % 4 == 0 else "a", 1e-3)
    recent = scheduler.stats()["tenant_time_recent_s"]
    assert abs(recent["a"] - 7.5) <= 0.8 and abs(recent["b"] - 2.5) <= 0.3, recent
    assert len(scheduler._usage._recent) <= 12
    assert scheduler.stats()["tenant_time_s"]["a"] == pytest.approx(15.0)


class Busy(Island):
    """An ``Island`` whose clock is the scheduler's (``time.monotonic``), with a tenant that calls every ``period``
    seconds (its calls are queued at the moment they arrive, even in the middle of another tenant's computation), and
    that waits for a throttled tenant's hold to end when it has nothing to run."""

    def __init__(self, scheduler: Scheduler, cost: Callable[[str, Template], float], monkeypatch,
                 compiling: frozenset[str] = frozenset()) -> None:
        super().__init__(scheduler, cost)
        monkeypatch.setattr(time, "monotonic", lambda: self.clock)
        self.compiling = compiling  # tenants whose island time is all compiling (each program compiles long)
        self.callers: list[list] = []  # [next arrival, period, tenant, client, calls so far]
        self.arrivals: dict[str, list[float]] = {}

    def every(self, period: float, tenant: str, client: int) -> None:
        self.callers.append([self.clock, period, tenant, client, 0])

    def _arrive(self, until: float) -> None:
        """Queue every call that arrives up to ``until``, each at its own moment."""
        end = self.clock
        for caller in sorted(self.callers):
            while caller[0] <= until:
                self.clock = caller[0]
                self.arrivals.setdefault(caller[2], []).append(caller[0])
                self.queue([admitted(caller[3], caller[2], caller[4])])
                caller[0] += caller[1]
                caller[4] += 1
        self.clock = max(end, self.clock)

    def step(self) -> None:
        seq, item = self.pending.popleft()
        entries = item.entries if isinstance(item, Group) else (item,)
        ops = sum(len(e.template.ops) for e in entries if e.counts)
        if not ops:
            return
        tenant = entries[0].tenant
        start = self.clock
        busy = ops * self.cost(tenant, entries[0].template)
        self._arrive(start + busy)  # the calls that come while it runs wait in the queues
        self.clock = start + busy
        self.log.append((start, self.clock, tenant, seq))
        report = [seq, busy, busy, 0.0] if tenant in self.compiling else [seq, busy, 0.0, busy / ops]
        self.pending.extend(self.scheduler.completed([report]))

    def run(self, seconds: float) -> None:
        until = self.clock + seconds
        while self.clock < until:
            if self.pending:
                self.step()
                continue
            due = self.scheduler.due()
            arrival = min((c[0] for c in self.callers), default=until)
            nxt = min(arrival, until if due is None else max(due, self.clock))
            self._arrive(nxt)
            self.clock = nxt
            self.pending.extend(self.scheduler.wait_due(0.0))

    def waits(self, tenant: str) -> list[float]:
        """How long each of ``tenant``'s calls took from its arrival to its end (calls of one tenant run in order)."""
        ends = [b for _, b, t, _ in self.log if t == tenant]
        return [end - arrived for arrived, end in zip(self.arrivals[tenant], ends)]


def fresh(k: int, ops: int = 1) -> Template:
    """A program never seen before (what a tenant gets around a per-program rule with: another constant)."""
    return template(f"fresh-{k}", ops)


@pytest.mark.parametrize("kind", ["computation", "compile"])
def test_fresh_long_programs_under_op_ms_are_held_to_the_tenants_share(monkeypatch, kind):
    """A tenant sends a fresh 2 s program after another for a minute under op_ms = 1 s (each runs 2 s, or each
    compiles 2 s: a compile holds the island alike) while another calls every 100 ms. Refusing the program helps
    nothing: the next one is new. Throttled, the abuser waits after each for the island time its weight allows
    against the victim's, so it gets half of the island and the victim never waits longer than one of them."""
    scheduler = Scheduler(0, 1, op_cap_ms=lambda tenant: 1000)
    island = Busy(scheduler, lambda tenant, _: 2.0 if tenant == "abuser" else 1e-3, monkeypatch,
                  frozenset({"abuser"}) if kind == "compile" else frozenset())
    measured(scheduler, {"victim": 2})
    island.queue([admitted(1, "abuser", k, fresh(k)) for k in range(40)])
    island.every(0.1, "victim", 2)
    start = island.clock
    island.run(60.0)
    waits = island.waits("victim")
    assert len(waits) >= 590 and max(waits) <= 2.0 + 0.01, max(waits)  # one of its computations, no more
    share = island.time("abuser", start + 2.0, start + 60.0) / 58.0
    assert 0.45 <= share <= 0.5 + 0.01, share  # weight 1 against the victim's 1: half, whether or not it uses it
    assert scheduler.stats()["tenants"]["abuser"]["throttled"]


def test_a_throttled_tenants_hold_follows_the_weights_of_the_others():
    """After a place of t seconds a throttled tenant of weight 1 waits 3 t when a tenant of weight 3 used the island
    lately: a quarter of the island at most; alone on the island it waits for no one."""
    clock = [100.0]
    scheduler = Scheduler(0, 1, op_cap_ms=lambda tenant: 100)
    scheduler.set_weight("victim", 3.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", lambda: clock[0])
        first = scheduler.queue([admitted(1, "abuser", 0, fresh(0)), admitted(1, "abuser", 1, fresh(1))])
        clock[0] += 0.5
        assert seqs(scheduler.completed([[first[0][0], 0.5]])) == [1]  # alone: no one to wait for
        measured(scheduler, {"victim": 2})
        clock[0] += 0.5
        assert scheduler.completed([[1, 0.5]]) == []  # the victim used the island lately: 3 x 0.5 s
        scheduler.queue([admitted(1, "abuser", 2, fresh(2))])
        assert scheduler.due() == pytest.approx(clock[0] + 1.5)
        assert scheduler.stats()["tenants"]["abuser"]["held_s"] == pytest.approx(1.5)
        clock[0] += 1.49
        assert scheduler.wait_due(0.0) == []
        clock[0] += 0.02
        assert [item.request.base & 0xFFFF for _, item in scheduler.wait_due(0.0)] == [2]


def test_a_throttled_tenant_has_one_place_in_flight_and_is_never_grouped():
    """A program measured cheap may run long on other inputs (a loop bound in its data): once throttled, its tenant
    cannot fill the window with it, so what the others wait for stays one place of its."""
    clock = [100.0]
    scheduler = Scheduler(0, 1, eager=100, op_cap_ms=lambda tenant: 100, group=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", lambda: clock[0])
        measured(scheduler, {"abuser": 1})
        calls = scheduler.queue([admitted(1, "abuser", k) for k in range(40)])
        assert len(calls_of(calls)) == 40  # cheap: they go at once, grouped
        clock[0] += 1.0
        scheduler.completed([[seq, 1.0 / len(calls)] for seq, _ in calls[:-1]])
        scheduler.completed([[calls[-1][0], 0.5]])  # one group ran 0.5 s: over the budget
        released = scheduler.queue([admitted(1, "abuser", 100 + k) for k in range(40)])
        assert seqs(released) == [seqs(calls)[-1] + 1] and not isinstance(released[0][1], Group)
        assert scheduler.stats()["inflight"] == 1


def test_a_throttled_tenant_is_forgiven_when_it_stops_overrunning_or_the_admin_raises_op_ms():
    clock = [100.0]
    caps = {"a": 100, "b": 100, "other": 60_000}
    scheduler = Scheduler(0, 1, eager=100, op_cap_ms=caps.__getitem__, group=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", lambda: clock[0])
        measured(scheduler, {"a": 1, "b": 2, "other": 3})
        for tenant, client in (("a", 1), ("b", 2)):
            [(seq, _)] = scheduler.queue([admitted(client, tenant, 0, fresh(0))])
            scheduler.completed([[seq, 0.3]])
        assert {t for t, v in scheduler.stats()["tenants"].items() if v["throttled"]} == {"a", "b"}
        caps["b"] = 500  # the admin raised b's budget over what its place took: forgiven at once
        released = scheduler.queue([admitted(2, "b", k) for k in range(1, 11)])
        assert len(calls_of(released)) == 10 and not scheduler.stats()["tenants"]["b"]["throttled"]
        for k in range(1, 40):  # a behaves: short places only, each held its share, for FORGIVE_S
            clock[0] += 0.3
            released = scheduler.wait_due(0.0) + scheduler.queue([admitted(1, "a", k)])
            scheduler.completed([[seq, 1e-3] for seq, _ in released])
        assert not scheduler.stats()["tenants"]["a"]["throttled"]
        assert len(calls_of(scheduler.queue([admitted(1, "a", 100 + k) for k in range(10)]))) == 10


def test_wait_due_releases_held_work_when_its_hold_ends():
    """Nothing else may happen on the island when a hold ends: the host's thread waits in ``wait_due`` and forwards
    what it releases then, not a maintenance period later."""
    scheduler = Scheduler(0, 1, op_cap_ms=lambda tenant: 10)
    measured(scheduler, {"victim": 2})
    [(seq, _)] = scheduler.queue([admitted(1, "abuser", 0, fresh(0))])
    scheduler.completed([[seq, 0.08]])  # 80 ms over a 10 ms budget: held 80 ms (the victim weighs as much)
    scheduler.queue([admitted(1, "abuser", 1, fresh(1))])
    start = time.monotonic()
    released = scheduler.wait_due(5.0)
    took = time.monotonic() - start
    assert [item.request.base & 0xFFFF for _, item in released] == [1]
    assert 0.05 <= took < 2.0, took
    assert scheduler.wait_due(0.05) == []  # its place is in flight: nothing more is due


def test_wait_due_sleeps_while_nothing_is_held():
    """The host's thread waits in ``wait_due`` all the time: with nothing held it must sleep, not spin."""
    scheduler = Scheduler(0, 1)
    start, cpu = time.monotonic(), time.thread_time()
    assert scheduler.wait_due(0.2) == []
    assert time.monotonic() - start >= 0.2 and time.thread_time() - cpu < 0.05


def test_while_others_wait_a_place_is_cut_to_its_tenants_share_so_every_share_holds_in_every_stretch():
    """A place is what a tenant can be ahead or behind of its share by. Cut to its weight's share of a part while
    others wait, every tenant of 1:2:4:8 (and of equals) is within 5% of its share in every second; with every place
    a whole part (32 calls here), the weight-1 tenant was 20% off."""
    for weights in ({"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}, dict.fromkeys(("w1", "w2", "w4", "w8"), 1.0)):
        scheduler, clients = weighted(weights, 5e-4)
        island = Island(scheduler, lambda tenant, _: 5e-4)
        for tenant, client in clients.items():
            island.queue([admitted(client, tenant, k) for k in range(1, 20000)])
        island.run(4.0)
        total = sum(weights.values())
        for start in [0.05 * k for k in range(10, 60)]:  # after the returning tenants' credits
            used = {t: island.time(t, start, start + 1.0) for t in weights}
            for tenant, weight in weights.items():
                share = used[tenant] / sum(used.values())
                assert share == pytest.approx(weight / total, rel=0.05), (weights, start, used)


def test_work_in_flight_when_others_come_back_is_no_debt_to_them():
    """A tenant alone on the island has a window's worth in flight (two groups here) when the others come back. That
    work is not what they were kept waiting for: they start where it ends (less their credit, which they spend in
    the first 0.1 s). Counted against it, the weight-1 tenant among 1:2:4:8 got nothing for 14 times as long."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    scheduler, clients = weighted(weights, 8e-4)
    island = Island(scheduler, lambda tenant, _: 8e-4)
    island.queue([admitted(1, "w1", k) for k in range(1, 20000)])  # alone: two whole groups go at once
    assert len(calls_of(island.pending)) >= 32
    for tenant in ("w2", "w4", "w8"):  # the others come while they are in flight
        island.queue([admitted(clients[tenant], tenant, k) for k in range(1, 20000)])
    island.run(1.0)
    solo = island.log[1][1]  # the end of its two groups
    assert island.time("w1", solo + 0.1, solo + 0.6) == pytest.approx(0.5 / 15, rel=0.15)  # its share, at once


def test_work_in_flight_that_ran_over_its_estimate_when_others_came_is_no_debt_either():
    """As above, on a busy machine: the window the lone tenant had in flight when the others came runs three times
    its estimate (the first calls after a pause do). The others start where it really ended, not where its estimate
    said, so the weight-1 tenant is not kept waiting for 14 times the excess."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    scheduler, clients = weighted(weights, 8e-4)

    def cost(tenant: str, _: Template) -> float:  # slow until another tenant ran
        return 8e-4 if any(t != "w1" for *_, t, _ in island.log) else 2.4e-3

    island = Island(scheduler, cost)
    island.queue([admitted(1, "w1", k) for k in range(1, 20000)])
    assert len(calls_of(island.pending)) >= 32
    for tenant in ("w2", "w4", "w8"):
        island.queue([admitted(clients[tenant], tenant, k) for k in range(1, 20000)])
    island.run(1.0)
    solo = island.log[1][1]  # the end of its two groups
    assert island.log[1][1] - island.log[0][0] > 3 * 32 * 8e-4  # its two groups did run slow
    assert island.time("w1", solo + 0.1, solo + 0.6) == pytest.approx(0.5 / 15, rel=0.15)


def test_a_window_filled_while_another_tenant_had_only_places_in_flight_is_no_debt_either():
    """On a busy machine the clients of a phase's tenants send their first calls at different moments: here w8's first
    two calls are in flight, and nothing of it queued, when w1 fills the window alone. The tenants that come next
    (and w8, when its next calls come) start where the window ends, not where w8's two calls do: counted from there,
    the window was a debt of w1 to each of them, and w1 got nothing for 14 times as long."""
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    scheduler, clients = weighted(weights, 8e-4)
    island = Island(scheduler, lambda tenant, _: 8e-4)
    island.queue([admitted(clients["w8"], "w8", k) for k in range(1, 3)])  # w8's first two: in flight, none queued
    island.queue([admitted(1, "w1", k) for k in range(1, 20000)])  # w1 alone in the queue: two whole groups go
    assert len(calls_of(island.pending)) >= 34
    for tenant in ("w2", "w4", "w8"):  # the others' work comes while those are in flight (w8's calls included)
        island.queue([admitted(clients[tenant], tenant, k) for k in range(3, 20000)])
    island.run(1.0)
    assert [t for *_, t, _ in island.log[:3]] == ["w8", "w1", "w1"]  # w8's two calls went as one group
    solo = island.log[2][1]  # the end of w1's two groups
    assert island.time("w1", solo + 0.1, solo + 0.6) == pytest.approx(0.5 / 15, rel=0.15)  # its share, at once


def test_a_tenant_whose_queue_ran_empty_starts_again_where_its_places_in_flight_end():
    """A tenant whose queue ran empty while its window flew, and that then gets more work, is held to at most its
    credit behind the others from where its places in flight end, not from its pass: those places are charged when
    they complete, and counted twice it would be put behind by its own window."""
    scheduler = Scheduler(0, 1, group=32, credit_s=0.01)
    measured(scheduler, {"a": 1, "b": 2}, busy=8e-4)
    island = Island(scheduler, lambda tenant, _: 8e-4)
    island.queue([admitted(1, "a", k) for k in range(1, 41)])  # alone: all 40 go at once, nothing left queued
    assert len(calls_of(island.pending)) == 40
    island.queue([admitted(2, "b", k) for k in range(1, 20000)])
    island.queue([admitted(1, "a", k) for k in range(41, 20000)])  # a's queue had run empty; its window still flies
    island.run(0.5)
    solo = max(end for _, end, tenant, _ in island.log[:4] if tenant == "a")  # the end of a's first window
    assert island.time("a", solo, solo + 0.2) == pytest.approx(0.1, rel=0.1)  # half, at once
