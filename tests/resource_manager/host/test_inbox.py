"""A host's inbox (``resource_manager.host.inbox``) on a host's real parts (``wiring.core``) without Ray: items
are admitted strictly by sequence number, whatever order and however often they arrive; a gap holds the stream
and says for how long; a message that fails at admission, or a row that does not read, never leaves the order
stuck; refusals fail their outputs and still free; puts take their uploaded values."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest

import pathways as pw
from pathways.messages import CLIENT_ID_BITS, Call, Free, Put
from pathways.ops import Aval, Limits, SliceDesc
from resource_manager.host import wiring
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.reports import Report
from resource_manager.host.rows import encode
from resource_manager.host.scheduler import Continue
from resource_manager.host.transport.peers import Peers

TENANT = "t"
LIMITS = Limits(0, 2, 1, 4, 1 << 32, 1 << 32)
DESC = SliceDesc("s1", (2,), ("x",), ((0, 0), (0, 1)))
BASE = 1 << CLIENT_ID_BITS  # client 1's ids
WAIT = 30.0  # generous bound on anything the executor does on its own thread


class Host:
    """One host's parts, wired as every host wires them; the executor's reports are collected here."""

    def __init__(self, op_timeout: float = 5.0) -> None:
        self._reports: list[Report] = []
        self._cond = threading.Condition()
        self.parts = wiring.core(0, 0, 1, LIMITS, LocalDevices(0), Peers(0, 0, "node"), op_timeout, 60.0,
                                 self._report)
        self.parts.grants.add_session(1, TENANT, b"k" * 32)
        self.inbox, self.table = self.parts.inbox, self.parts.table

    def _report(self, report: Report) -> None:
        with self._cond:
            self._reports.append(report)
            self._cond.notify_all()

    def done(self, count: int) -> list[int]:
        """The sequence numbers reported done, once at least ``count`` are (bounded)."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._done()) >= count, timeout=WAIT), self._done()
            return sorted(self._done())

    def _done(self) -> list[int]:
        return [d[0] for r in self._reports for d in r.done]

    def value(self, buffer_id: int) -> None:
        self.table.put(buffer_id, TENANT, np.zeros(4, np.float32))

    def failure(self, buffer_id: int) -> Failure | None:
        entry = self.table.lookup(buffer_id, TENANT)
        return entry.value if entry is not None and isinstance(entry.value, Failure) else None


def free(*ids: int, everything: bool = False) -> Admitted:
    request = Free(ids, everything)
    return Admitted(1, TENANT, request.encode(), request)


@pytest.fixture
def host():
    h = Host()
    yield h
    h.parts.executor.stop()


def test_items_are_admitted_by_sequence_number_and_a_gap_holds_the_later_ones(host):
    for buffer_id in (100, 101, 102):
        host.value(buffer_id)
    assert host.inbox.next_seq == 0 and host.inbox.held() == 0 and host.inbox.stuck_for() == 0.0
    host.inbox.accept([(2, free(102)), (1, free(101))])  # 0 has not come: nothing moves
    assert host.inbox.next_seq == 0 and host.inbox.held() == 2
    assert all(i in host.table for i in (100, 101, 102))
    assert host.inbox.stuck_for() > 0.0
    host.inbox.accept([(0, free(100))])
    assert host.inbox.next_seq == 3 and host.inbox.held() == 0 and host.inbox.stuck_for() == 0.0
    assert not any(i in host.table for i in (100, 101, 102))


def test_a_gap_is_timed_from_when_it_opened_not_from_the_latest_arrival(host):
    host.inbox.accept([(3, free(1))])
    first = host.inbox.stuck_for()
    host.inbox.accept([(2, free(2))])  # later arrivals behind the same gap do not restart its clock
    assert host.inbox.stuck_for() >= first > 0.0
    host.inbox.accept([(0, free(3))])  # 0 admitted, 1 still missing: the stream is still stuck
    assert host.inbox.next_seq == 1 and host.inbox.stuck_for() >= first


def test_a_repeated_or_stale_sequence_number_is_ignored(host):
    for buffer_id in (100, 101, 102):
        host.value(buffer_id)
    host.inbox.accept([(1, free(101)), (1, free(102))])  # the first arrival of a number holds its place
    host.inbox.accept([(0, free()), (0, free(100))])
    assert host.inbox.next_seq == 2
    assert 101 not in host.table and 102 in host.table and 100 in host.table
    host.inbox.accept([(0, free(100)), (1, free(102))])  # already admitted: never again
    assert host.inbox.next_seq == 2 and 100 in host.table and 102 in host.table


def test_items_from_several_threads_are_each_admitted_once_in_order(host):
    """``accept`` is called from several threads: every number is admitted once, whatever the interleaving (the
    interpreter switches threads as often as it can here, so that unguarded state would show)."""
    saved_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _deliver_from_threads(host)
    finally:
        sys.setswitchinterval(saved_interval)


def _deliver_from_threads(host: Host) -> None:
    n = 1000
    ids = [BASE + k for k in range(n)]
    for buffer_id in ids:
        host.value(buffer_id)
    batches = [[(k, free(BASE + k)) for k in range(n)] for _ in range(6)]  # every thread brings every item
    for seed, batch in enumerate(batches):
        random.Random(seed).shuffle(batch)
    start = threading.Barrier(len(batches))
    errors: list[BaseException] = []

    def deliver(batch) -> None:
        start.wait(timeout=WAIT)
        try:
            for k in range(0, n, 4):
                host.inbox.accept(batch[k:k + 4])
        except BaseException as exc:  # accept never raises: report it to the test
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert host.inbox.next_seq == n and host.inbox.held() == 0
    assert not any(i in host.table for i in ids)


def test_a_free_of_everything_drops_every_buffer_of_its_client_and_tenant_only(host):
    mine = [BASE + 1, BASE + 2]
    for buffer_id in mine:
        host.value(buffer_id)
    host.value(2 * BASE + 1)  # client 2's
    host.table.put(BASE + 3, "other", np.zeros(2, np.float32))  # another tenant's id in client 1's space
    host.inbox.accept([(0, free(everything=True))])
    assert not any(i in host.table for i in mine)
    assert 2 * BASE + 1 in host.table and BASE + 3 in host.table


def test_a_refused_message_fails_its_outputs_with_the_reason_and_still_frees_its_clients_arrays(host):
    mine, theirs = BASE + 50, 2 * BASE + 50
    host.value(mine)
    host.value(theirs)
    refusal = Failure("ResourceError", "over your op_ms budget")
    call = Call(b"", BASE, (), {}, (mine, theirs))
    host.inbox.accept([(0, Admitted(1, TENANT, call.encode(), call, None, refusal, BASE, BASE + 3))])
    assert [host.failure(BASE + k) for k in range(4)] == [refusal] * 3 + [None]
    assert mine not in host.table and theirs in host.table  # a call frees only its own client's ids
    entry = host.table.wait(BASE + 1, TENANT, WAIT)  # a reader gets the reason, as its client will
    with pytest.raises(pw.ResourceError, match="op_ms"):
        raise pw.errors.from_wire(entry.value.kind, entry.value.message)
    assert host.inbox.next_seq == 1


def test_a_call_that_fails_at_admission_moves_the_order_on_and_is_reported_done(host):
    """A call whose admission raises (here: it reaches this host without its template) runs nothing, and an
    empty run reports it done, so the scheduler's window does not keep its place for ever; the items behind it
    are admitted as usual."""
    host.value(100)
    call = Call(b"", BASE, (), {}, ())
    host.inbox.accept([(0, Admitted(1, TENANT, call.encode(), call, None)), (1, free(100))])
    assert host.inbox.next_seq == 2 and 100 not in host.table
    assert host.done(1) == [0]


def test_a_later_part_of_a_fragment_that_never_ran_here_reports_done(host):
    host.inbox.accept([(0, Continue(77, 5, 9)), (1, Continue(78, 0, 1))])
    assert host.inbox.next_seq == 2
    assert host.done(2) == [0, 1]


def test_rows_from_host_0_are_read_and_an_unreadable_one_does_not_stop_the_stream(host):
    for buffer_id in (100, 101):
        host.value(buffer_id)
    rows = encode([(1, free(101))])
    host.inbox.accept_rows([(0, "a kind host 0 never sends"), *rows])
    assert host.inbox.next_seq == 2 and 101 not in host.table
    host.inbox.accept_rows([(2, "msg", ("not", "a message"))])
    assert host.inbox.next_seq == 3
    host.inbox.accept_rows(["not even a row"])  # no sequence number to hold: dropped, and the stream waits for 3
    assert host.inbox.next_seq == 3 and host.inbox.held() == 0
    host.inbox.accept_rows(encode([(3, free(100))]))
    assert host.inbox.next_seq == 4 and 100 not in host.table


def test_a_refused_message_in_host_0s_rows_fails_its_outputs_here_too(host):
    refusal = Failure("TenantAccessError", "not your buffer")
    call = Call(b"", BASE, (), {}, ())
    host.inbox.accept_rows(encode([(0, Admitted(1, TENANT, call.encode(), call, None, refusal, BASE, BASE + 2))]))
    assert host.failure(BASE) == refusal and host.failure(BASE + 1) == refusal and host.failure(BASE + 2) is None


def put(buffer_id: int) -> tuple[Put, Admitted]:
    request = Put(buffer_id, DESC, (), Aval((4,), "float32"))
    return request, Admitted(1, TENANT, request.encode(), request)


def test_a_put_takes_the_value_its_client_uploaded_to_this_host(host):
    request, item = put(BASE + 9)
    value = np.arange(4, dtype=np.float32)
    host.parts.uploads.reserve(request.id, TENANT, value.nbytes, 1 << 20)
    host.parts.uploads.fill(request.id, {((0, 4),): value})
    host.inbox.accept([(0, item)])
    entry = host.table.wait(request.id, TENANT, WAIT)
    assert entry is not None and not isinstance(entry.value, Failure)
    np.testing.assert_array_equal(np.asarray(entry.value), value)
    assert host.done(1) == [0]


def test_a_put_whose_upload_was_refused_fails_with_the_reason(host):
    request, item = put(BASE + 9)
    host.parts.uploads.refuse(request.id, TENANT, Failure("ResourceError", "over your parked_bytes budget"))
    host.inbox.accept([(0, item)])
    entry = host.table.wait(request.id, TENANT, WAIT)
    assert entry is not None and entry.value == Failure("ResourceError", "over your parked_bytes budget")


def test_a_put_whose_value_never_arrives_fails_in_bounded_time():
    host = Host(op_timeout=0.5)
    try:
        request, item = put(BASE + 9)
        host.inbox.accept([(0, item)])
        entry = host.table.wait(request.id, TENANT, WAIT)
        assert entry is not None and isinstance(entry.value, Failure), entry and entry.value
        assert "put in program 'put' waited" in entry.value.message
        assert host.inbox.next_seq == 1
    finally:
        host.parts.executor.stop()
