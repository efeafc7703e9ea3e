"""A host's executor without Ray: dataflow, deferred frees, timeouts, parked receives, and dying loudly."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from client.jit import CompiledFunction
from client.slices import VirtualSlice
from pathways.messages import CLIENT_ID_BITS, Call, Deliver
from pathways.ops import Aval, Exec, Limits, Recv, Route, SliceDesc, Template
from resource_manager.host import wiring
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.reports import Report
from resource_manager.host.rows import encode
from resource_manager.host.run import Run
from resource_manager.host.scheduler import Continue, Group
from resource_manager.host.transport.peers import Peers

DESC = SliceDesc("s1", (2,), ("x",), ((0, 0), (0, 1)))
LIMITS = Limits(0, 2, 1, 4, 1 << 32, 1 << 32)
TENANT = "t"


class Host:
    """The parts of one host, wired as every host wires them (``resource_manager.host.wiring.core``), on this
    process's CPU devices; ``strict`` makes it one host of a two-host island."""

    def __init__(self, strict: bool = False, op_timeout: float = 5.0) -> None:
        self.reports: list[Report] = []
        self.peers = Peers(0, 0, "node")
        self.parts = wiring.core(0, 0, 2 if strict else 1, LIMITS, LocalDevices(0), self.peers, op_timeout, 60.0,
                                 self.reports.append)
        p = self.parts
        for client in (0, 1):  # the sessions whose ids the tests' buffers and receives use
            p.grants.add_session(client, TENANT, b"k" * 32)
        self.table, self.devices, self.exes = p.table, p.devices, p.exes
        self.receiver, self.handlers, self.executor = p.receiver, p.handlers, p.executor
        self.seq = 0

    def touch(self) -> None:
        self.executor.touch()

    def function(self, fn, n_inputs: int) -> str:
        vs = VirtualSlice(None, {"key": "s1", "shape": [2], "axes": ["x"], "island": 0, "devices": [[0, 0], [0, 1]],
                                 "tenant": TENANT})
        f = CompiledFunction(fn, vs, None, None)
        x = np.zeros(4, np.float32)
        exported = f.export(vs, f.bind((x,) * n_inputs, {}), [((4,), np.dtype("float32"), False)] * n_inputs)
        self.exes.add(TENANT, exported.exe, exported.blob)
        return exported.exe

    def value(self, buffer_id: int, x: np.ndarray) -> None:
        self.table.put(buffer_id, TENANT, jax.device_put(x, self.devices.sharding(DESC, ())))

    def run(self, template: Template, base: int, inputs: tuple[int, ...] = ()) -> Run:
        run = Run(self.seq, TENANT, 1, template.program, template.ops, template, template.n_inputs, base, inputs)
        self.seq += 1
        self.executor.admit(run)
        return run

    def fetch(self, buffer_id: int, timeout: float = 20.0) -> np.ndarray:
        entry = self.table.wait(buffer_id, TENANT, timeout)
        assert entry is not None, f"buffer {buffer_id} never came"
        if isinstance(entry.value, Failure):
            raise pw.errors.from_wire(entry.value.kind, entry.value.message)
        return np.asarray(entry.value)


def one(exe: str, name: str, inputs=(0,), outputs=(1,), n_inputs=1, frees=()) -> Template:
    op = Exec(exe, "s1", inputs, outputs, ((),) * len(inputs), ((),) * len(outputs), name, frees)
    return Template(name, n_inputs, max(outputs) + 1, {"s1": DESC}, (op,))


@pytest.fixture
def host():
    h = Host()
    yield h
    h.executor.stop()


def test_runs_flow_by_data_and_a_waiting_run_does_not_hold_up_the_next(host):
    double = host.function(lambda v: v * 2.0, 1)
    host.value(100, np.arange(4, dtype=np.float32))
    waiting = host.run(one(double, "waits"), base=1000, inputs=(500,))  # its input comes later
    host.run(one(double, "runs"), base=2000, inputs=(100,))
    np.testing.assert_allclose(host.fetch(2001), [0, 2, 4, 6])
    assert waiting.pc == 0
    host.value(500, np.ones(4, np.float32))
    np.testing.assert_allclose(host.fetch(1001), 2.0)


def test_a_free_that_arrives_while_an_op_still_reads_the_buffer_waits_for_it(host):
    slow = host.function(lambda v: jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a) + v, v), 1)
    host.value(100, np.ones(4, np.float32))
    host.run(one(slow, "slow"), base=1000, inputs=(100,))
    host.table.free([100], TENANT)  # the client dropped its array: the run still reads it
    out = host.fetch(1001)
    assert np.isfinite(out).all() and 100 not in host.table


def test_an_input_that_never_comes_fails_the_op_in_bounded_time():
    host = Host(op_timeout=0.5)
    double = host.function(lambda v: v * 2.0, 1)
    host.run(one(double, "orphan"), base=1000, inputs=(404,))
    start = time.monotonic()
    with pytest.raises(pw.PathwaysError, match="a buffer it reads was never produced"):
        host.fetch(1001)
    assert time.monotonic() - start < 10
    host.executor.stop()


def test_a_failed_input_fails_its_consumers_with_the_same_error(host):
    double = host.function(lambda v: v * 2.0, 1)
    host.table.put(100, TENANT, Failure("ProgramError", "the producer failed"))
    host.run(one(double, "consumer"), base=1000, inputs=(100,))
    with pytest.raises(pw.ProgramError, match="the producer failed"):
        host.fetch(1001)


def test_a_dead_executor_fails_every_pending_and_future_wait(host):
    double = host.function(lambda v: v * 2.0, 1)
    handler = host.handlers.by_op[Exec]
    real = handler.run

    def dying(run, op, final):
        if run.label == "poison":
            raise SystemExit("the loop is gone")
        return real(run, op, final)

    handler.run = dying
    host.value(100, np.ones(4, np.float32))
    host.run(one(double, "waiting"), base=3000, inputs=(999,))
    host.run(one(double, "poison"), base=1000, inputs=(100,))
    with pytest.raises(pw.IslandFailedError, match="executor of island 0 host 0 died"):
        host.fetch(3001)
    assert host.executor.dead is not None
    host.run(one(double, "later"), base=2000, inputs=(100,))
    with pytest.raises(pw.IslandFailedError):
        host.fetch(2001, timeout=0)


def test_settle_waits_for_the_pass_that_computed_a_ready_output_so_a_trace_holds_its_fragment(host):
    """An output is ready as its op ends, before the loop's pass reports and records the fragment: a trace stopped
    right after the client saw it must wait for that pass (``settle``), or the fragment is missing from it."""
    double = host.function(lambda v: v * 2.0, 1)
    handler = host.handlers.by_op[Exec]
    real, release = handler.run, threading.Event()

    def then_hold(run, op, final):
        out = real(run, op, final)
        if run.label == "held":
            release.wait(30)
        return out

    handler.run = then_hold
    host.value(100, np.ones(4, np.float32))
    token = host.executor.events.start()
    host.run(one(double, "held"), base=1000, inputs=(100,))
    np.testing.assert_allclose(host.fetch(1001), 2.0)  # ready, while its pass has not ended
    assert host.executor.settle(0.2) is False
    release.set()
    assert host.executor.settle(10.0) is True
    spans = [e for e in host.executor.events.stop(token) if e[1] == "fragment"]
    assert [args["program"] for *_, args in spans] == ["held"]
    assert host.executor.settle(0.0) is True  # asleep: nothing in progress


def test_a_parked_receive_lets_the_order_move_on_and_resumes_with_its_data():
    host = Host(strict=True)
    inc = host.function(lambda v: v + 1.0, 1)
    recv = Recv(1, "s1", (), Aval((4,), "float32"), 1, (Route(0, 0, (((0, 4),),)),))
    use = Exec(inc, "s1", (1,), (2,), ((),), ((),), "inc")
    receiving = host.run(Template("recv", 0, 3, {"s1": DESC}, (recv, use)), base=1000)
    host.value(100, np.zeros(4, np.float32))
    later = host.run(one(inc, "later"), base=2000, inputs=(100,))  # runs although the receive came first
    reader = host.run(one(inc, "reader"), base=3000, inputs=(1002,))  # reads what the parked run will make
    np.testing.assert_allclose(host.fetch(2001), 1.0)
    deadline = time.monotonic() + 10
    while not reader.parked and time.monotonic() < deadline:  # the loop reaches it right after "later"
        time.sleep(0.01)
    assert receiving.parked and reader.parked and later.pc == 1
    host.receiver.deliver(Deliver(1001, 1, 0, (((0, 4),),)), (np.full(4, 5.0, np.float32),), (1, 0))
    deadline = time.monotonic() + 10
    while not any(r.landed for r in host.reports) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for r in host.reports for p in r.landed] == [(receiving.seq, 0)]
    host.executor.resume(receiving.seq, 0)  # what the island's scheduler sends once every host has landed
    np.testing.assert_allclose(host.fetch(1002), 6.0)
    np.testing.assert_allclose(host.fetch(3001), 7.0)
    host.executor.stop()


def test_a_run_reached_only_after_its_producer_resumed_goes_behind_it_as_on_a_host_that_parked_it():
    """A lagging host reaches a run that reads what a parked run will write only after that run's resume came: the
    resumed run is behind it in the list, so waiting in front of it would wait for ever (and a host that parked the
    reader behind it runs the two the other way round). It goes right behind the resumed run, as it would have."""
    host = Host(strict=True)
    inc = host.function(lambda v: v + 1.0, 1)
    handler = host.handlers.by_op[Exec]
    real, entered, release, ran = handler.run, threading.Event(), threading.Event(), []

    def holding(run, op, final):
        ran.append(run.label)
        if run.label == "busy":
            entered.set()
            release.wait(30)
        return real(run, op, final)

    handler.run = holding
    recv = Recv(1, "s1", (), Aval((4,), "float32"), 1, (Route(0, 0, (((0, 4),),)),))
    use = Exec(inc, "s1", (1,), (2,), ((),), ((),), "inc")
    receiving = host.run(Template("recv", 0, 3, {"s1": DESC}, (recv, use)), base=1000)
    deadline = time.monotonic() + 10
    while not receiving.parked and time.monotonic() < deadline:
        time.sleep(0.01)
    host.value(100, np.zeros(4, np.float32))
    host.run(one(inc, "busy"), base=2000, inputs=(100,))  # holds the loop while the rest arrives
    assert entered.wait(10)
    reader = host.run(one(inc, "reader"), base=3000, inputs=(1002,))  # reads what the parked run will make
    host.run(one(inc, "second"), base=4000, inputs=(3001,))  # and what the reader will make
    host.receiver.deliver(Deliver(1001, 1, 0, (((0, 4),),)), (np.full(4, 5.0, np.float32),), (1, 0))
    host.executor.resume(receiving.seq, 0)  # every host landed it: the resume comes before this one reached the reader
    assert [r.label for r in host.executor.runs] == ["busy", "reader", "second", "recv"]
    release.set()
    np.testing.assert_allclose(host.fetch(4001), 8.0)  # within the op timeout (5 s): none waited in front
    np.testing.assert_allclose(host.fetch(3001), 7.0)
    assert ran[-3:] == ["recv", "reader", "second"] and not reader.parked  # the resumed run first, then its readers
    host.executor.stop()


def test_pieces_from_a_host_the_plan_does_not_name_are_refused(host):
    recv = Recv(1, "s1", (), Aval((4,), "float32"), 1, (Route(0, 0, (((0, 4),),)),))
    host.run(Template("recv", 0, 2, {"s1": DESC}, (recv,)), base=1000)
    host.receiver.deliver(Deliver(1001, 0, 0, (((0, 4),),)), (np.full(4, 666.0, np.float32),), (0, 0))
    host.receiver.deliver(Deliver(1001, 1, 0, (((0, 4),),)), (np.zeros(4, np.float32),), (1, 0))
    np.testing.assert_allclose(host.fetch(1001), 0.0)
    assert host.receiver.refused == 1


def test_pieces_for_a_receive_that_already_finished_go_straight_back():
    given_back = []

    class Recording(Peers):
        def give_back(self, pieces):
            given_back.extend(pieces)

    host = Host(op_timeout=0.3)
    host.receiver.peers = Recording(0, 0, "node")
    recv = Recv(1, "s1", (), Aval((4,), "float32"), 1, (Route(0, 0, (((0, 4),),)),))
    host.run(Template("recv", 0, 2, {"s1": DESC}, (recv,)), base=1000)
    with pytest.raises(pw.IslandFailedError, match="waited"):
        host.fetch(1001)
    from resource_manager.host.transport.direct import Lent
    late = Lent(12345, 4096, ((0, 4),), (1, 0), 7, "")
    host.receiver.deliver(Deliver(1001, 1, 0, (((0, 4),),)), (late,), (1, 0))
    assert given_back == [late] and 1001 not in host.receiver.mailbox
    host.executor.stop()


@pytest.mark.parametrize("strict", [False, True])
def test_a_long_fragment_in_parts_lets_another_run_go_between_them(strict):
    """The scheduler gives a long fragment's parts places of their own in the order (``Admitted.end`` and
    ``Continue``); every host runs another client's run between them, the same way in the island's order, and the
    parts share the fragment's ids, so the result is the one the whole fragment gives."""
    host = Host(strict=strict)
    inbox = host.parts.inbox
    inc = host.function(lambda v: v + 1.0, 1)
    chain = Template("chain", 1, 51, {"s1": DESC}, tuple(
        Exec(inc, "s1", (k,), (k + 1,), ((),), ((),), f"inc{k}", (k,) if k else ()) for k in range(50)))
    ran: list[tuple[str, int]] = []
    handler = host.handlers.by_op[Exec]
    real = handler.run

    def recording(run, op, final):
        ran.append((run.label, run.pc))
        return real(run, op, final)

    handler.run = recording
    host.value(100, np.zeros(4, np.float32))
    base = 1 << CLIENT_ID_BITS
    call = Call(chain.encode(), base, (100,), {}, ())
    other = Call(one(inc, "other").encode(), 2 * base, (100,), {}, ())
    inbox.accept([(0, Admitted(1, TENANT, call.encode(), call, chain, end=20)),
                  (1, Admitted(2, TENANT, other.encode(), other, one(inc, "other"))),
                  (2, Continue(0, 20, 35)), (3, Continue(0, 35, 50))])
    np.testing.assert_allclose(host.fetch(base + 50), 50.0)
    np.testing.assert_allclose(host.fetch(2 * base + 1), 1.0)
    assert ran.index(("other", 0)) == ran.index(("chain", 19)) + 1  # between the first part and the second
    assert [pc for label, pc in ran if label == "chain"] == list(range(50))  # every op once, in order
    deadline = time.monotonic() + 10
    while len([d for r in host.reports for d in r.done]) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(d[0] for r in host.reports for d in r.done) == [0, 1, 2, 3]  # each part reports, in its place
    host.executor.stop()


def test_a_group_runs_each_call_as_if_alone_and_reports_done_once(host):
    """A group (calls of one program sharing one place in the order) runs each call with its own ids; a call's frees
    apply only after the calls before it counted what they read, and the group is reported done once, with the
    island time of all its calls."""
    inbox = host.parts.inbox
    inc = host.function(lambda v: v + 1.0, 1)
    template = one(inc, "inc")
    host.value(100, np.zeros(4, np.float32))
    base = 1 << CLIENT_ID_BITS
    entries, reads = [], [100]
    for k in range(4):  # each call frees what the call before it reads, as a client's loop ``v = f(v)`` does
        call = Call(template.encode(), base + 2 * k, (reads[-1],), {}, (reads[-2],) if k else ())
        entries.append(Admitted(1, TENANT, call.encode(), call, template))
        reads.append(base + 2 * k + 1)
    inbox.accept([(0, Group(tuple(entries)))])
    np.testing.assert_allclose(host.fetch(reads[-1]), 4.0)
    deadline = time.monotonic() + 10
    while not any(r.done for r in host.reports) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    done = [d for r in host.reports for d in r.done]
    assert len(done) == 1 and done[0][0] == 0 and done[0][1] > 0
    assert all(i not in host.table for i in reads[:3])  # freed once read
    other = Host()  # another host of the island gets the group as host 0's rows, and runs it the same
    try:
        other.exes.add(TENANT, inc, host.exes._bytes[inc])
        other.value(100, np.zeros(4, np.float32))
        other.parts.inbox.accept_rows(encode([(0, Group(tuple(entries)))]))
        np.testing.assert_allclose(other.fetch(reads[-1]), 4.0)
    finally:
        other.executor.stop()


def test_a_group_call_that_waits_does_not_hold_back_the_calls_behind_it(host):
    """A group runs as one run, but a call whose input has not arrived splits it there: the later calls run at
    once (dataflow, as if each came alone), a call that fails fails only its own outputs, and the group is still
    reported done once, after its last call."""
    inbox = host.parts.inbox
    inc = host.function(lambda v: v + 1.0, 1)
    template = one(inc, "inc")
    base = 1 << CLIENT_ID_BITS
    host.value(100, np.zeros(4, np.float32))
    late = base + 999  # produced only later, by a put
    reads = [100, late, 100, base + 5, 100]  # call 1 waits for a put; call 3 reads call 2's output
    entries = []
    for k, read in enumerate(reads):
        call = Call(template.encode(), base + 2 * k, (read,), {}, ())
        entries.append(Admitted(1, TENANT, call.encode(), call, template))
    inbox.accept([(0, Group(tuple(entries)))])
    for k in (0, 2, 3, 4):  # all but the waiting call ran, without it
        np.testing.assert_allclose(host.fetch(base + 2 * k + 1, timeout=5), 2.0 if k == 3 else 1.0)
    assert base + 3 not in host.table and not any(r.done for r in host.reports)  # it still waits, and so does the group
    host.value(late, np.full(4, 7.0, np.float32))
    host.touch()
    np.testing.assert_allclose(host.fetch(base + 3), 8.0)
    deadline = time.monotonic() + 10
    while not any(r.done for r in host.reports) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    done = [d for r in host.reports for d in r.done]
    assert len(done) == 1 and done[0][0] == 0
    assert host.executor.completed == 5


def test_a_failing_call_of_a_group_fails_its_own_outputs_only(host):
    """Every call of a group runs as if alone: one whose input is a failure fails its outputs with that failure,
    and the calls after it run."""
    inbox = host.parts.inbox
    inc = host.function(lambda v: v + 1.0, 1)
    template = one(inc, "inc")
    base = 1 << CLIENT_ID_BITS
    host.value(100, np.zeros(4, np.float32))
    host.table.put(101, TENANT, Failure("ProgramError", "the input failed"))
    entries = []
    for k, read in enumerate([100, 101, 100]):
        call = Call(template.encode(), base + 2 * k, (read,), {}, ())
        entries.append(Admitted(1, TENANT, call.encode(), call, template))
    inbox.accept([(0, Group(tuple(entries)))])
    np.testing.assert_allclose(host.fetch(base + 1), 1.0)
    with pytest.raises(pw.ProgramError, match="the input failed"):
        host.fetch(base + 3)
    np.testing.assert_allclose(host.fetch(base + 5), 1.0)


def test_a_call_or_part_that_cannot_run_here_is_still_reported_done(host):
    """The scheduler keeps a call's place in its window until the call is reported done: a call whose admission
    failed on this host, and the later parts of a fragment whose first part never ran, report done at once."""
    inbox = host.parts.inbox
    inc = host.function(lambda v: v + 1.0, 1)
    template = one(inc, "bad")
    base = 1 << CLIENT_ID_BITS
    call = Call(template.encode(), base, (100,), {"ab" * 32: b"not the executable"}, ())
    inbox.accept([(0, Admitted(1, TENANT, call.encode(), call, template)), (1, Continue(0, 1, 2)),
                  (2, Continue(77, 5, 9))])
    with pytest.raises(pw.WireFormatError, match="do not match their hash"):
        host.fetch(base + 1)
    deadline = time.monotonic() + 10
    while len([d for r in host.reports for d in r.done]) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(d[0] for r in host.reports for d in r.done) == [0, 1, 2]


def test_the_report_says_how_long_the_longest_computation_ran_compiling_aside(host):
    """What the scheduler holds against a tenant's op_ms budget: one computation's run, its compile not counted."""
    inc = host.function(lambda v: v + 1.0, 1)
    host.value(100, np.zeros(4, np.float32))
    base = 1 << CLIENT_ID_BITS
    host.run(one(inc, "inc"), base, (100,))
    np.testing.assert_array_equal(host.fetch(base + 1), np.ones(4, np.float32))
    deadline = time.monotonic() + 10
    while not [d for r in host.reports for d in r.done] and time.monotonic() < deadline:
        time.sleep(0.02)
    [(_, busy, compile_s, longest)] = [d for r in host.reports for d in r.done]
    assert compile_s > 0 and 0 < longest <= busy - compile_s + 1e-6


def test_a_refused_call_still_frees_the_arrays_its_client_dropped(host):
    """A call carries the ids of arrays its client dropped since its last message; refused (over a budget, or by
    admission), it runs nothing, but those arrays go all the same, on host 0 and on the hosts that get host 0's
    rows, and never another client's."""
    inbox = host.parts.inbox
    mine, also_mine, other = (1 << CLIENT_ID_BITS) + 50, (1 << CLIENT_ID_BITS) + 51, 52  # 52: client 0's
    for buffer_id in (mine, also_mine, other):
        host.value(buffer_id, np.zeros(4, np.float32))
    refusal = Failure("ResourceError", "over your op_ms budget")
    base = 1 << CLIENT_ID_BITS
    first = Call(b"", base, (), {}, (mine, other))
    inbox.accept([(0, Admitted(1, TENANT, first.encode(), first, None, refusal, base, base + 2))])
    second = Call(b"", base + 2, (), {}, (also_mine,))
    inbox.accept_rows(encode([(1, Admitted(1, TENANT, second.encode(), second, None, refusal, base + 2, base + 4))]))
    assert mine not in host.table and also_mine not in host.table and other in host.table
    with pytest.raises(pw.ResourceError, match="op_ms"):
        host.fetch(base + 3)
