"""An island's scheduler: one total order over every client's admitted messages, the same for every host.

It lives in the island's host 0 (``resource_manager.host``), after admission
(``resource_manager.host.admission``), which has put each client's messages back in
order and checked them. Messages wait in one queue per tenant. Up to
``window`` fragments, and about ``window_s`` seconds of estimated island time
(half that, ``shared_window_s``, while several tenants have work queued: what
a tenant has in flight is charged at once when it completes, so it is how far
its charged time can be from its share at any moment), are in flight on the
island; the next one comes from the tenant with the
lowest *pass* (stride scheduling: a tenant's pass grows by the island time it
used divided by its weight), so busy tenants share the island in proportion
to their weights. Each released message gets the next sequence number; every
host admits strictly by that number, so collectives launched by two clients on
the same hosts can never interleave differently on two hosts.

What a tenant is charged is measured, never claimed: the island time each
fragment took, compiling included (reported when it completes: a fragment that
ran far beyond its estimate puts its tenant behind by what it really used, a
debt its following fragments wait for in proportion), and the admission work
its messages caused (``charge``). Estimates only decide how much goes in flight
at once; they are learned per tenant and template (``resource_manager.host.costs``).
A template never measured yet has at most one fragment of its tenant in flight.

Virtual time. The island's virtual time is the lowest pass, counting measured
time only, among tenants with work queued or in flight. A new tenant starts
there, or where the others' places in flight then end if that is later: those
of the first (lowest pass plus estimate) among tenants with work queued, or,
with none queued, the last to end (work released before it came is no debt
owed to it; once those places complete, where they really ended), so its first
fragment goes at the next release. Not where the first place in flight ends:
on a busy machine a phase's clients send their first calls at different
moments, and a tenant with a call or two in flight and nothing queued would
make a window another filled alone meanwhile a debt to every tenant after it.
One that comes back after it was idle, or that had places in flight but
nothing queued (only work queued competes), starts (where its own places end)
at most its weight's share of ``credit_s`` seconds of island time (one
quantum, the window's worth) behind that: like a sleeper in a
stride or fair-queuing scheduler it goes first for a moment, which keeps the
latency of a tenant that sends now and then low, but it cannot come back to a
burst as long as it was away while everyone else waits. When the island has
nothing queued and nothing in flight its busy period ends and every tenant
starts the next one level: no one was waiting, so no one is owed, and a tenant
charged for a long compile before the others even arrived does not start the
next busy period behind them (fair queuing restarts its virtual clock the
same way).

Long fragments run in parts. A call fragment whose ops would take longer
than ``part_s`` (by the measured cost of its template, or more than
``first_part_ops`` ops when unmeasured) is released one part at a time: each
part takes its own place in the order, chosen by fair share like any
fragment, so no tenant's huge program holds another's small one up for
longer than a part, on every host of the island alike. While other tenants
wait too, a part (and a group, below) is cut to the tenant's weight's share of
half of ``part_s`` (``shared_part_s``): a place is the unit a tenant can be
ahead or behind of its share by, so each tenant's is in proportion to its
share, and a weight-1 tenant among 1:2:4:8 is as close to its share in any
stretch of time as the weight-8 one. Half, because on a busy machine an island
charges a tenant little time (a weight-1 tenant among 1:2:4:8 about 0.13 s in
6 s), and a place of its share of a whole part moved that by over 2%.

A computation cannot be stopped once it runs, so a tenant's ``op_ms`` budget caps
what follows instead, two ways: a program one of whose computations ran longer
is refused from then on (``resource_manager.host.costs``), and a tenant one of
whose places (compiling included) held the island longer is throttled to its
weight's share of the island's time for a while (``resource_manager.host.throttle``).
Each tenant's island time and idle time, as status shows them, are kept by
``resource_manager.host.usage``.

Calls of one program queued back to back are cheap to run and dear to order
one by one: up to ``group`` calls of a tenant's measured template that waits
behind the first (a client calling one function in a loop) share its place in
the order as one ``Group``, within one part's estimate (``part_s``), so a
group holds other tenants up no longer than a part of a long fragment would.
A template that receives from another island is never grouped (its fragments
may park one by one).

Small computations are cheap to run and dear to send: once ``eager``
fragments are in flight, new messages wait for the next completion report and
go with everything released then, as one message per host.

On a multi-host island a fragment parks at each receive; when every host has
reported that receive's data landed, the rest of the fragment is released as
a ``Resume`` ahead of new work (it already had its share).

Every method returns what it releases, in order, for the host to forward; the
scheduler calls no one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pathways.ops import Template
from resource_manager.host.admission import Admitted
from resource_manager.host.costs import Costs
from resource_manager.host.fair_clock import FairClock
from resource_manager.host.throttle import Throttles
from resource_manager.host.usage import Usage

FIRST_ESTIMATE_S = 1e-3  # what a fragment of a template never measured counts against the window
SHARED_PART = 0.5  # while tenants wait: the fraction of ``part_s`` they share by weight, and of ``window_s`` in flight
GROUP = 32  # the calls a running island's scheduler releases as one group, at most
NAMED = ("tenant_time_s", "tenant_time_recent_s", "fragments", "weights", "tenants")  # stats that name tenants


@dataclass(frozen=True)
class Resume:
    """The rest of fragment ``seq`` from op ``pc`` on, once its receive's data landed on every host."""

    seq: int
    pc: int


@dataclass(frozen=True)
class Continue:
    """Ops ``lo`` to ``hi - 1`` of the call fragment first released as ``seq``: the next part of a long fragment,
    with a place of its own in the order."""

    seq: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Group:
    """Calls of one template by one tenant, queued back to back, released as one place in the order: each runs
    as its own fragment, and their completion is reported once, as the group's."""

    entries: tuple[Admitted, ...]


Item = Admitted | Resume | Continue | Group
Released = list[tuple[int, Item]]


@dataclass(frozen=True)
class _Rest:
    """The parts of a long fragment not released yet: ``entry`` released as ``seq``, ops from ``lo`` on."""

    entry: Admitted
    seq: int
    lo: int


@dataclass(slots=True)
class _Flight:
    """A fragment (or part) in flight: its tenant, its estimate, the (tenant, template) its cost teaches and its
    ops, and whether it holds its tenant's one place for a template never measured."""

    tenant: str
    estimate: float
    owed: float  # the estimate in pass (estimate / weight at release)
    key: tuple[str, Template | None]
    ops: int
    unmeasured: bool
    calls: int = 1  # a group's calls, each a fragment of the window
    came: list[str] | None = None  # tenants that started where it would end (by estimate), or from one that did


class Scheduler:
    """Thread-safe: admitted messages and the executors' reports arrive on different threads."""

    def __init__(self, island: int, n_hosts: int, window: int = 64, window_s: float = 0.05, eager: int = 8,
                 credit_s: float | None = None, part_s: float | None = None, first_part_ops: int = 256,
                 op_cap_ms: Callable[[str], int] | None = None, group: int = 1) -> None:
        self.island, self.n_hosts = island, n_hosts
        self._op_cap_ms = op_cap_ms or (lambda tenant: 1 << 62)  # the tenant's op_ms budget, from the registry
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)  # ``wait_due`` waits on it for a throttled tenant's hold to end
        self.window, self.window_s, self.eager = window, window_s, eager
        self.part_s = window_s / 2 if part_s is None else part_s
        self.shared_part_s = self.part_s * SHARED_PART
        self.shared_window_s = window_s * SHARED_PART
        self.first_part_ops = first_part_ops
        self.group = max(1, group)
        self._inflight_s = 0.0  # the estimates of the fragments in flight
        self._inflight_calls = 0  # fragments in flight, each call of a group counted (what ``window`` bounds)
        self._received = [0, 0]  # queue calls, messages in them: how well clients coalesce
        self._seq = 0
        self._queues: dict[str, deque[Admitted | _Rest]] = {}  # only tenants with something queued
        self._costs = Costs()
        self._throttles = Throttles(self._op_cap_ms)
        self._throttled = self._throttles.tenants  # read here (one dict test per place), changed by the throttle only
        self._usage = Usage()
        self._clock = FairClock(window_s if credit_s is None else credit_s, self._usage)
        self._inflight: dict[int, _Flight] = {}
        self._blocked: dict[int, _Flight] = {}
        self._flying: dict[str, int] = {}  # tenant -> its fragments in the window
        self._unmeasured: dict[str, int] = {}  # tenant -> its fragments in the window of templates never measured
        self._landed: dict[tuple[int, int], set[int]] = {}
        self._resumes: deque[Resume] = deque()
        self._fragments: dict[str, int] = {}

    def set_weight(self, tenant: str, weight: float) -> None:
        """The tenant's weight, as the resource manager's registry holds it (finite and positive)."""
        with self._lock:
            self._clock.weights[tenant] = weight

    # -- the order ------------------------------------------------------------------------------------------
    def queue(self, entries: list[Admitted], tenant: str | None = None, admission_s: float = 0.0,
              messages: int = 0) -> Released:
        """Queue admitted messages; release what the window allows while few fragments are in flight.
        ``admission_s``: the island's work admitting ``messages`` messages of ``tenant`` (those held for a gap in
        its stream included: they come later), charged a like part with each as it takes its place. A client's
        batch of a hundred calls is admitted at once; charged in one lump it would put a tenant of a small share
        behind for a while, then ahead. Pooled in the same lock as the entries are queued, so the tenant is never
        seen idle in between (what is pooled for a tenant that goes idle is charged then)."""
        with self._lock:
            count = max(messages, len(entries))
            if tenant is not None and admission_s > 0:
                if count:
                    self._clock.pool(tenant, admission_s, count)
                else:
                    self._charge(tenant, admission_s)
            self._received[0] += 1
            self._received[1] += len(entries)
            queues = self._queues
            for entry in entries:
                queue = queues.get(entry.tenant)
                if queue is None:  # only work queued competes: a tenant that had none banks no more than a credit
                    self._start(entry.tenant)
                    queue = queues[entry.tenant] = deque()
                queue.append(entry)
            if self._throttled:  # a throttled tenant's new work may be due later: ``wait_due`` must look again
                self._due.notify_all()
            return self._release() if len(self._inflight) < self.eager else []

    def charge(self, tenant: str, seconds: float) -> None:
        """Charge ``tenant`` for ``seconds`` of the island's work done outside its fragments (admitting its
        messages, when none was let through): it counts against its share like the time its fragments ran."""
        with self._lock:
            self._charge(tenant, seconds)

    def _charge(self, tenant: str, seconds: float) -> None:
        self._wake(tenant)
        self._clock.charge(tenant, seconds)

    def _active(self, tenant: str) -> bool:
        return bool(self._queues.get(tenant)) or self._flying.get(tenant, 0) > 0

    def _actives(self) -> set[str]:
        """Tenants with work queued or in flight."""
        return set(self._queues).union(t for t, n in self._flying.items() if n)

    def _wake(self, tenant: str) -> None:
        """A tenant with nothing queued or in flight starts where the others are (``FairClock.wake``)."""
        if not self._active(tenant):
            self._start(tenant)

    def _start(self, tenant: str) -> None:
        """The tenant had nothing queued (nothing at all, or only places in flight) and now has: it starts where the
        others are, at most its share of the credit behind them (``FairClock.wake``)."""
        queued = set(self._queues)
        if self._throttled:
            queued -= self._throttles.held(time.monotonic())
        self._clock.wake(tenant, self._virtual_time(), queued, self._actives(), self._inflight.values())

    def _virtual_time(self) -> float:
        """The island's virtual time (``FairClock.virtual_time``), a throttled tenant's pass aside while it is
        held."""
        active = self._actives()
        if self._throttled:
            active -= self._throttles.held(time.monotonic())
        return self._clock.virtual_time(active)

    def _end_busy_period(self) -> None:
        if not self._inflight and not self._queues:
            self._clock.level()

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _ready(self, tenant: str) -> bool:
        """Whether the head of the tenant's queue may go now: not while the tenant is throttled and held, nor while
        a fragment of a template it never had measured is in flight and the head is one too (unmeasured work must
        not fill the window)."""
        throttled = self._throttled
        if throttled and tenant in throttled and not self._throttles.may_go(tenant, self._flying.get(tenant, 0)):
            return False
        if not self._unmeasured.get(tenant):
            return True
        head = self._queues[tenant][0]
        return self._costs.of(head.entry if isinstance(head, _Rest) else head) is not None

    def _throttle(self, tenant: str, busy: float, over: bool, now: float) -> None:
        """``tenant``'s place just took ``busy`` seconds of the island (``over`` its op_ms budget): hold its next
        one until its weight's share of the island time since allows it, against the others that used the island
        in the last ``RECENT_S`` seconds."""
        recent = self._usage.recent_tenants() | {t for t in self._clock.passes if self._active(t)}
        recent.discard(tenant)
        clock = self._clock
        others = sum(clock.weight(t) for t in recent)
        if self._throttles.hold(tenant, busy * others / clock.weight(tenant), busy, over, now):
            clock.passes[tenant] = max(clock.passes[tenant], self._virtual_time())  # throttled: no credit to spend
        self._due.notify_all()

    def due(self) -> float | None:
        """When (``time.monotonic``) the first throttled tenant with work queued and nothing in flight may go again;
        None if there is none."""
        with self._lock:
            return self._throttles.next_due(self._queues, self._flying)

    def wait_due(self, timeout: float) -> Released:
        """Wait up to ``timeout`` seconds for a throttled tenant's hold to end while it has work queued; what that
        releases. The host calls it in a loop: when a hold ends on an island that has nothing else to do, nothing
        else would release the held work."""
        with self._due:
            deadline = time.monotonic() + timeout
            tried = False  # released nothing though a hold ended (the window is full): wait for a change
            while True:
                now = time.monotonic()
                due = self._throttles.next_due(self._queues, self._flying)
                if due is not None and due <= now and not tried:
                    released = self._release()
                    if released:
                        return released
                    tried = True
                wake = deadline if due is None or tried else min(deadline, due)
                if wake <= now:
                    return []
                notified = self._due.wait(wake - now)
                tried = tried and not notified

    def _release(self) -> Released:
        """Resumes first, then what the window allows in pass order, as one batch for every host."""
        released: Released = [(self._next(), resume) for resume in self._resumes]
        self._resumes.clear()
        queues, inflight, costs, over_cap = self._queues, self._inflight, self._costs.per_op, self._costs.over
        clock = self._clock
        passes, owes, weights = clock.passes, clock.owed, clock.weights
        window, window_s, shared_s = self.window, self.window_s, self.shared_window_s
        while self._inflight_calls < window and (not inflight or
                                                 self._inflight_s < (window_s if len(queues) < 2 else shared_s)):
            span = self.part_s  # the island time one place of the tenant's may take, by its estimate
            if len(queues) == 1:  # one tenant with work: no one to choose between (the common case, kept cheap)
                tenant = next(iter(queues))
                if not self._ready(tenant):
                    break
            else:
                ready = [t for t in queues if self._ready(t)]
                if not ready:
                    break
                if len(ready) == 1:
                    tenant = ready[0]
                else:
                    tenant = min(ready, key=lambda t: (passes[t] + owes.get(t, 0.0), t))
                    # while others wait, a place takes at most its tenant's share of a shared part
                    span = self.shared_part_s * weights.get(tenant, 1.0) / sum(weights.get(t, 1.0) for t in ready)
            queue = queues[tenant]
            item = queue.popleft()
            if not queue:
                del queues[tenant]
            rest = type(item) is _Rest
            entry = item.entry if rest else item
            seq = self._seq
            self._seq = seq + 1
            if over_cap and not rest and item.counts and (tenant, item.template) in over_cap:
                entry = self._costs.refuse(item, self._op_cap_ms(item.tenant), self.island)
            if not entry.counts:
                released.append((seq, entry))
                if clock.admitting:
                    clock.admitted(tenant, 1)
                self._maybe_idle(tenant)
                continue
            key = (tenant, entry.template)
            cost = costs.get(key)
            if cost is not None:
                costs.move_to_end(key)
            lo = item.lo if rest else 0
            n_ops = len(entry.template.ops) if entry.template is not None else 1
            part = self.first_part_ops if cost is None else max(1, int(span / max(cost, 1e-9)))
            hi = min(n_ops, lo + part)
            ops, calls = hi - lo, 1
            if rest:
                released.append((seq, Continue(item.seq, lo, hi)))
            elif hi < n_ops:
                released.append((seq, replace(entry, end=hi)))
                self._fragments[tenant] = self._fragments.get(tenant, 0) + 1
            else:
                alone = self._throttled and tenant in self._throttled  # a throttled tenant's places are never grouped
                more = self._follow(tenant, entry, cost * n_ops, span) \
                    if cost is not None and self.group > 1 and not alone else []
                released.append((seq, Group((entry, *more)) if more else entry))
                calls += len(more)
                self._fragments[tenant] = self._fragments.get(tenant, 0) + calls
                ops = n_ops * calls
            if clock.admitting and not rest:
                clock.admitted(tenant, calls)
            if hi < n_ops:  # the rest goes before the tenant's later messages
                queues.setdefault(tenant, deque()).appendleft(_Rest(entry, item.seq if rest else seq, hi))
            estimate = FIRST_ESTIMATE_S if cost is None else max(cost * ops, 1e-6)
            owed = estimate / weights.get(tenant, 1.0)
            inflight[seq] = _Flight(tenant, estimate, owed, key, ops, cost is None, calls)
            self._inflight_s += estimate
            self._inflight_calls += calls
            owes[tenant] = owes.get(tenant, 0.0) + owed
            self._flying[tenant] = self._flying.get(tenant, 0) + 1
            if cost is None:
                self._unmeasured[tenant] = self._unmeasured.get(tenant, 0) + 1
        return released

    def _follow(self, tenant: str, first: Admitted, call_s: float, span: float) -> list[Admitted]:
        """The tenant's calls of ``first``'s template queued right behind it that may share its place in the order:
        at most ``group`` in all, estimated within ``span`` seconds (``call_s`` seconds each)."""
        template = first.template
        queue = self._queues.get(tenant)
        if not queue or template.receives:
            return []
        more: list[Admitted] = []
        room, limit = span - call_s, min(self.group, self.window - self._inflight_calls) - 1
        while queue and len(more) < limit and room >= call_s:
            head = queue[0]
            if type(head) is not Admitted or head.template is not template or head.refusal is not None:
                break
            more.append(queue.popleft())
            room -= call_s
        if not queue:
            del self._queues[tenant]
        return more

    # -- reports ------------------------------------------------------------------------------------------
    def completed(self, reports: list[list]) -> Released:
        """Host 0 reports (seq, island seconds[, seconds of them compiling[, its longest computation]]) for
        finished places: charge each to its tenant, all of it, learn its template's cost per op from the time it
        ran, compiling aside, mark the template over its tenant's op_ms budget if one computation ran longer, and
        throttle the tenant if the place held the island longer (or hold it again if it is throttled)."""
        with self._lock:
            now = time.monotonic()
            second = int(now)
            caps: dict[str, int] = {}  # each tenant's op_ms budget, looked up once per report
            for seq, busy, *rest in reports:
                flight = self._leave_window(seq) or self._blocked.pop(seq, None)
                if flight is None:
                    continue
                tenant = flight.tenant
                self._usage.account(tenant, busy, second)
                used = busy / self._clock.weight(tenant)
                self._clock.passes[tenant] += used
                if flight.came:
                    self._clock.started_after(flight.came, used - flight.owed, self._actives())
                ran = busy - (rest[0] if rest else 0.0)
                if ran > 0:  # a run that only compiled says nothing of what the next will take
                    self._costs.learn(flight.key, ran / max(flight.ops, 1))
                longest = rest[1] if len(rest) > 1 else 0.0
                cap = caps.get(tenant)
                if cap is None:
                    cap = caps[tenant] = self._op_cap_ms(tenant)
                if longest * 1e3 > cap:
                    self._costs.ran_over(flight.key, longest)
                over = busy * 1e3 > cap
                if over or self._throttled and tenant in self._throttled:
                    self._throttle(tenant, busy, over, now)
            self._end_busy_period()
            return self._release()

    def blocked(self, seqs: list[int]) -> Released:
        """Fragments waiting on another island's transfer leave the window, so islands never wait on
        each other's windows."""
        with self._lock:
            for seq in seqs:
                flight = self._leave_window(seq)
                if flight is not None:
                    self._blocked[seq] = replace(flight, unmeasured=False)
            self._end_busy_period()
            return self._release()

    def landed(self, host: int, pairs: list[tuple[int, int]]) -> Released:
        """Host ``host`` has the data of parked receive (seq, pc); once every host has, resume it."""
        with self._lock:
            for seq, pc in pairs:
                hosts = self._landed.setdefault((seq, pc), set())
                hosts.add(host)
                if len(hosts) == self.n_hosts:
                    del self._landed[(seq, pc)]
                    self._resumes.append(Resume(seq, pc))
            return self._release() if self._resumes else []

    def _leave_window(self, seq: int) -> _Flight | None:
        flight = self._inflight.pop(seq, None)
        if flight is not None:
            self._inflight_s = self._inflight_s - flight.estimate if self._inflight else 0.0
            self._inflight_calls -= flight.calls
            tenant = flight.tenant
            owes = self._clock.owed
            owes[tenant] = owes[tenant] - flight.owed if self._flying[tenant] > 1 else 0.0
            self._flying[tenant] -= 1
            if flight.unmeasured:
                self._unmeasured[tenant] -= 1
            self._maybe_idle(tenant)
        return flight

    def _maybe_idle(self, tenant: str) -> None:
        if not self._active(tenant):
            self._usage.idle(tenant)
            self._clock.settle(tenant)

    def stats(self) -> dict:
        """The scheduler's counters: sequence numbers issued, window, queued/in-flight/blocked fragments, and each
        tenant's island time (since start and over the last ``RECENT_S`` seconds), fragments, weight, and where it
        stands (``lag_s``: island seconds it is ahead of its share, negative when behind; queued; in flight;
        ``idle_s``: seconds it had nothing queued or in flight, so that "backlogged" can be checked; ``throttled``
        for its op_ms budget, and ``held_s``: seconds until its next place may go)."""
        with self._lock:
            recent = self._usage.recent()
            vtime = self._virtual_time()
            now = time.monotonic()
            tenants = {t: {"lag_s": (p - vtime) * self._clock.weight(t), "queued": len(self._queues.get(t, ())),
                           "inflight": self._flying.get(t, 0),
                           "idle_s": self._usage.idle_s(t, now), "throttled": t in self._throttled,
                           "held_s": self._throttles.held_s(t, now)}
                       for t, p in self._clock.passes.items()}
            return {"tenant_time_recent_s": recent, "island": self.island, "sequenced": self._seq,
                    "window": self.window, "window_s": self.window_s, "inflight_s": self._inflight_s,
                    "queued": sum(len(q) for q in self._queues.values()), "inflight": self._inflight_calls,
                    "blocked": len(self._blocked), "parked": len(self._landed), "tenant_time_s": self._usage.time_s(),
                    "fragments": dict(self._fragments), "weights": dict(self._clock.weights), "tenants": tenants,
                    "submit_calls": self._received[0], "messages": self._received[1]}
