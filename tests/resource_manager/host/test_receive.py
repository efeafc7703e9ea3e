"""The receive side of a host (resource_manager/receive.py), without Ray: pieces filed by receive id and
sender, a recv op landing only what its plan names, leases returned for everything refused, dropped or late,
unclaimed mailboxes expiring, and parked receives reported once their data landed."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pathways as pw
from pathways.messages import Deliver
from pathways.ops import Aval, Recv, Route, SliceDesc
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.devices import LocalDevices
from resource_manager.host.receive import Receiver
from resource_manager.host.transfer import Landing
from resource_manager.host.transport.direct import Lent
from resource_manager.host.transport.peers import Peers

TENANT = "t"
DESC = SliceDesc("s", (2,), ("x",), ((0, 0), (0, 1)))
LEFT, RIGHT = ((0, 4),), ((4, 8),)
# island 1's host 0 sends the left half, its host 1 the right half, both to this host (island 0, host 0)
RECV = Recv(5, "s", ("x",), Aval((8,), "float32"), 1, (Route(0, 0, (LEFT,)), Route(1, 0, (RIGHT,))))
KEY = 1000


class RecordingPeers(Peers):
    """Peers that record the lent pieces handed back instead of sending their leases home."""

    def __init__(self) -> None:
        super().__init__(0, 0, "node")
        self.given_back: list[Lent] = []

    def give_back(self, pieces):
        self.given_back.extend(pieces)


class Side:
    """One host's receive side, wired as the host wires it, on this process's CPU devices."""

    def __init__(self, op_timeout: float = 5.0) -> None:
        self.table = BufferTable()
        self.peers = RecordingPeers()
        self.touched = 0
        self.receiver = Receiver(0, 0, self.table, BufferPool(), self.peers, op_timeout, self.touch)
        devices = LocalDevices(0)
        self.landing = Landing((8,), np.dtype("float32"), devices.sharding(DESC, ("x",)),
                               devices.wanted(DESC, (8,), ("x",)))

    def touch(self) -> None:
        self.touched += 1

    def deliver(self, sender: tuple[int, int], *pieces: tuple, key: int = KEY, failure=None) -> None:
        """``pieces``: (region, data) pairs from ``sender`` = (island, host)."""
        msg = Deliver(key, sender[0], sender[1], tuple(r for r, _ in pieces), failure)
        self.receiver.deliver(msg, [d for _, d in pieces], sender)

    def recv(self, final: bool = False, key: int = KEY) -> bool:
        return self.receiver.recv(key, RECV, RECV.expected(0), self.landing, TENANT, "prog", final)

    def value(self, key: int = KEY) -> np.ndarray:
        entry = self.table.lookup(key, TENANT)
        assert entry is not None, f"receive {key} did not land"
        return entry.value if isinstance(entry.value, Failure) else np.asarray(entry.value)


def lent(region, lease: int, src=(1, 0)) -> Lent:
    return Lent(pid=12345, addr=4096, index=region, src=src, lease=lease, reply="")


def halves() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)


@pytest.fixture
def side():
    return Side()


def test_the_plan_says_what_each_host_expects():
    expect = RECV.expected(0)
    assert (expect.count, expect.senders) == (2, (0, 1)) and expect.shards == {0: frozenset({LEFT}),
                                                                                1: frozenset({RIGHT})}
    assert RECV.expected(1) is None  # nothing of this receive lands on host 1


def test_pieces_from_the_planned_senders_land_as_one_array(side):
    left, right = halves()
    side.deliver((1, 1), (RIGHT, right))
    assert not side.recv()  # half is still on its way
    side.deliver((1, 0), (LEFT, left))
    assert side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))
    assert side.receiver.stats()["mailbox"] == 0 and side.receiver.stats()["bytes_in"] == 32


def test_pieces_arriving_after_the_receive_was_admitted_land_the_same(side):
    assert not side.recv()
    left, right = halves()
    side.deliver((1, 0), (LEFT, left))
    side.deliver((1, 1), (RIGHT, right))
    assert side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("stranger", [(1, 2), (0, 0), (2, 1)], ids=["other host", "own island", "other island"])
def test_pieces_from_a_sender_the_plan_does_not_name_are_refused_and_their_leases_returned(side, stranger):
    left, right = halves()
    forged = lent(LEFT, lease=66, src=stranger)
    side.deliver(stranger, (LEFT, forged))
    side.deliver((1, 1), (RIGHT, right))
    assert not side.recv()  # the forged half does not count
    assert side.peers.given_back == [forged] and side.receiver.stats()["refused_pieces"] == 1
    side.deliver((1, 0), (LEFT, left))
    assert side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))


def test_a_piece_from_one_sender_never_displaces_anothers(side):
    left, right = halves()
    side.deliver((1, 0), (LEFT, left))
    side.deliver((1, 2), (LEFT, np.full(4, 666.0, np.float32)))  # same region, a sender the plan does not name
    side.deliver((1, 1), (RIGHT, right))
    assert side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))


def test_a_piece_sent_again_replaces_the_first_and_returns_its_lease(side):
    first, again = lent(LEFT, lease=1), lent(LEFT, lease=2)
    side.deliver((1, 0), (LEFT, first))
    side.deliver((1, 0), (LEFT, again))
    assert side.peers.given_back == [first]


def test_a_failure_delivered_instead_of_data_lands_as_that_failure(side):
    side.deliver((1, 0), failure=("ProgramError", "the producer failed"))
    assert side.recv()
    assert side.value() == Failure("ProgramError", "the producer failed")


def test_a_receive_still_waiting_at_its_deadline_fails_with_a_clear_error(side):
    with pytest.raises(pw.IslandFailedError, match="waited 5s for a transfer from island 1"):
        side.recv(final=True)


def test_a_receive_from_a_failed_island_fails_at_once(side):
    side.receiver.island_failed(1)
    with pytest.raises(pw.IslandFailedError, match="island 1 failed before its transfer"):
        side.recv()
    side.receiver.island_restored(1)
    assert not side.recv()  # waits again for the restarted island


def test_pieces_for_a_finished_receive_go_straight_back(side):
    left, right = halves()
    side.deliver((1, 0), (LEFT, left))
    side.deliver((1, 1), (RIGHT, right))
    assert side.recv()
    late = lent(LEFT, lease=9)
    side.deliver((1, 0), (LEFT, late))
    assert side.peers.given_back == [late] and side.receiver.stats()["mailbox"] == 0


def test_a_dropped_receive_returns_what_was_lent_and_refuses_what_comes_later(side):
    early, late = lent(LEFT, lease=1), lent(RIGHT, lease=2, src=(1, 1))
    side.deliver((1, 0), (LEFT, early))
    side.receiver.drop(KEY)
    side.deliver((1, 1), (RIGHT, late))
    assert side.peers.given_back == [early, late] and side.receiver.stats()["mailbox"] == 0


def test_an_unclaimed_mailbox_expires_and_returns_its_leases():
    side = Side(op_timeout=0.05)
    kept = lent(LEFT, lease=3)
    side.deliver((1, 0), (LEFT, kept))
    side.receiver.expire()
    assert side.receiver.stats()["mailbox"] == 1  # not yet: a mailbox waits twice the op timeout
    time.sleep(0.15)
    side.receiver.expire()
    assert side.receiver.stats()["mailbox"] == 0 and side.peers.given_back == [kept]
    later = lent(RIGHT, lease=4, src=(1, 1))
    side.deliver((1, 1), (RIGHT, later))  # the receive counts as finished: straight back
    assert side.peers.given_back == [kept, later]


def test_a_parked_receive_is_reported_once_its_pieces_landed(side):
    left, right = halves()
    side.receiver.watch(7, 3, KEY, RECV, RECV.expected(0))
    side.deliver((1, 0), (LEFT, left))
    assert side.receiver.take_landed() == []
    side.deliver((1, 2), (RIGHT, right))  # from a host the plan does not name: does not count
    assert side.receiver.take_landed() == []
    side.deliver((1, 1), (RIGHT, right))
    assert side.receiver.take_landed() == [(7, 3)]
    assert side.receiver.take_landed() == []  # reported once
    assert side.recv()  # and the recv op lands it when it resumes


def test_a_parked_receive_whose_pieces_are_already_here_is_reported_at_once(side):
    left, right = halves()
    side.deliver((1, 0), (LEFT, left))
    side.deliver((1, 1), (RIGHT, right))
    side.receiver.watch(7, 3, KEY, RECV, RECV.expected(0))
    assert side.receiver.take_landed() == [(7, 3)]


def test_a_parked_receive_with_nothing_for_this_host_is_reported_at_once(side):
    side.receiver.watch(8, 1, KEY, RECV, None)
    assert side.receiver.take_landed() == [(8, 1)]


def test_a_parked_receive_is_reported_when_its_source_island_fails_or_it_times_out():
    side = Side(op_timeout=0.05)
    side.receiver.watch(1, 0, KEY, RECV, RECV.expected(0))
    side.receiver.watch(2, 0, KEY + 1, RECV, RECV.expected(0))
    side.receiver.island_failed(1)
    assert sorted(side.receiver.take_landed()) == [(1, 0), (2, 0)]
    other = Side(op_timeout=0.05)
    other.receiver.watch(3, 0, KEY, RECV, RECV.expected(0))
    assert other.receiver.expire() <= 0.05 and other.receiver.take_landed() == []
    time.sleep(0.08)
    other.receiver.expire()
    assert other.receiver.take_landed() == [(3, 0)]


def test_every_delivery_for_a_receive_not_admitted_yet_wakes_the_executor(side):
    left, _ = halves()
    side.deliver((1, 0), (LEFT, left))
    side.deliver((1, 0), (LEFT, left))
    assert side.touched == 2


def test_an_admitted_receive_wakes_the_executor_once_its_last_piece_is_here(side):
    """Its op waits for every piece: the ones before the last change nothing it could do, and waking the executor
    for each cost the receiving thread a hand-over per piece."""
    left, right = halves()
    side.receiver.expect(KEY, RECV, RECV.expected(0), side.landing)
    side.deliver((1, 1), (RIGHT, right))
    assert side.touched == 0 and not side.recv()
    side.deliver((1, 0), (LEFT, left))
    assert side.touched == 1 and side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))


def test_a_failure_or_a_parked_receive_wakes_the_executor_at_once(side):
    left, _ = halves()
    side.receiver.expect(KEY, RECV, RECV.expected(0), side.landing)
    side.deliver((1, 1), failure=("IslandFailedError", "the sender's computation failed"))
    assert side.touched == 1
    side.receiver.expect(KEY + 1, RECV, RECV.expected(0), side.landing)
    side.receiver.watch(7, 0, KEY + 1, RECV, RECV.expected(0))
    side.deliver((1, 0), (LEFT, left), key=KEY + 1)
    assert side.touched == 2


def test_a_tenant_over_its_mailbox_or_parked_bytes_budget_fails_its_own_receive_at_once():
    """Receives are owned by the tenant whose session minted their id (here: ids below 2000 are greedy's, the
    rest careful's). Greedy's pieces over its budgets are refused, its receives fail at once naming the budget,
    and careful's receive lands as usual."""
    from pathways.budgets import Budgets

    small = Budgets(mailboxes=2, parked_bytes=48)
    side = Side()
    side.receiver._owner = lambda key: ("greedy", small) if key < 2000 else ("careful", Budgets())
    left, right = halves()
    for key in (1000, 1001, 1002):  # a third mailbox is over greedy's budget of 2
        side.deliver((1, 0), (LEFT, left), key=key)
    assert side.receiver.held("greedy") == (2, 32)
    side.deliver((1, 1), (RIGHT, right), key=1001)  # 16 more bytes: 48 in all, within the budget
    side.deliver((1, 1), (RIGHT, right), key=1000)  # 16 more: over the budget of 48 parked bytes
    for key, budget in ((1002, "mailboxes"), (1000, "parked_bytes")):
        assert side.recv(key=key)  # fails at once: no waiting for pieces that will never be kept
        assert side.value(key).kind == "ResourceError" and f"over your {budget} budget" in side.value(key).message
    assert side.recv(key=1001)
    np.testing.assert_array_equal(side.value(1001), np.arange(8, dtype=np.float32))
    side.deliver((1, 0), (LEFT, left), key=5000)
    side.deliver((1, 1), (RIGHT, right), key=5000)
    assert side.recv(key=5000)
    np.testing.assert_array_equal(side.value(5000), np.arange(8, dtype=np.float32))
    assert side.receiver.held("greedy") == (0, 0) and side.receiver.held("careful") == (0, 0)


def test_overlapping_pieces_never_land_uninitialized_bytes(side):
    """Two pieces that cover the same half twice and the other half never: the buffer (reused memory) would
    hand back what it held before, so the receive fails instead."""
    from resource_manager.host.transfer import region

    with pytest.raises(ValueError, match="overlap within"):
        region({((0, 4),): np.ones(4, np.float32), ((2, 6),): np.ones(4, np.float32)}, ((0, 6),), np.float32)
    with pytest.raises(ValueError, match="cover only part of"):
        region({((0, 4),): np.ones(4, np.float32)}, ((0, 6),), np.float32)
    # 69 pieces writing 70 elements of a 70-element region, twice at its start and never at its end
    many = {((k, k + 1),): np.ones(1, np.float32) for k in range(68)} | {((0, 2),): np.ones(2, np.float32)}
    with pytest.raises(ValueError, match="overlap within"):  # counted element by element
        region(many, ((0, 70),), np.float32)
    np.testing.assert_array_equal(region({((0, 3),): np.zeros(3, np.float32), ((3, 6),): np.ones(3, np.float32)},
                                         ((0, 6),), np.float32), [0, 0, 0, 1, 1, 1])


def test_lent_pieces_of_an_admitted_receive_are_copied_before_its_op_runs_and_charged_meanwhile():
    """Once the op is admitted (expect with its landing) and every lent piece is here, the copy starts on the
    landing thread; the op then takes the landed array. Until it does, the array counts as parked bytes; a piece
    sent again meanwhile goes straight back (the copy already read the first), and a tenant whose parked_bytes
    cannot hold the array has it landed by the op as before."""
    import os

    from pathways.budgets import Budgets

    left, right = halves()
    side = Side()
    first = [Lent(os.getpid(), a.ctypes.data, r, s, k, "") for a, r, s, k in ((left, LEFT, (1, 0), 1),
                                                                            (right, RIGHT, (1, 1), 2))]
    side.receiver.expect(KEY, RECV, RECV.expected(0), side.landing)
    side.deliver((1, 0), (LEFT, first[0]))
    assert KEY not in side.receiver._landing  # half of it: nothing to copy yet
    side.deliver((1, 1), (RIGHT, first[1]))
    early = side.receiver._landing[KEY]
    early.result(timeout=30)
    assert side.receiver.held("") == (1, 32)  # the landed array, until the op takes it
    again = Lent(os.getpid(), right.ctypes.data, RIGHT, (1, 1), 3, "")
    side.deliver((1, 1), (RIGHT, again))
    assert side.peers.given_back == [again]
    assert side.recv()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))
    assert side.receiver.stats()["landed_early"] == 1 and side.receiver.held("") == (0, 0)
    assert sorted(p.lease for p in side.peers.given_back) == [1, 2, 3]

    tight = Side()
    tight.receiver._owner = lambda key: ("t", Budgets(parked_bytes=16))
    tight.receiver.expect(KEY, RECV, RECV.expected(0), tight.landing)
    tight.deliver((1, 0), (LEFT, first[0]))
    tight.deliver((1, 1), (RIGHT, first[1]))
    assert KEY not in tight.receiver._landing and tight.recv()  # landed by the op instead
    np.testing.assert_array_equal(tight.value(), np.arange(8, dtype=np.float32))
    assert tight.receiver.stats()["landed_early"] == 0


def test_receives_ready_together_land_as_one_batch_and_a_failed_sender_fails_only_its_own():
    """Receives that are all ready when a landing thread comes free land as one unit (here the landing threads wait
    for the receiver's lock while five become ready). One whose sender's memory cannot be read fails that batch;
    its receives are then landed one by one, so only it fails, when its op runs."""
    import os

    from pathways.errors import IslandFailedError

    side = Side()
    values = {KEY + k: np.arange(8 * k, 8 * k + 8, dtype=np.float32) for k in range(5)}
    lease = iter(range(100))
    with side.receiver._lock:
        for key, value in values.items():
            side.receiver.expect(key, RECV, RECV.expected(0), side.landing)
            side.deliver((1, 0), (LEFT, Lent(os.getpid(), value.ctypes.data, LEFT, (1, 0), next(lease), "")), key=key)
            side.deliver((1, 1), (RIGHT, Lent(os.getpid(), value.ctypes.data + 16, RIGHT, (1, 1), next(lease), "")),
                         key=key)
    for key in values:
        side.receiver._landing[key].result(timeout=30)
    assert side.receiver.stats()["landing_batches"] == 1
    for key, value in values.items():
        assert side.recv(key=key)
        np.testing.assert_array_equal(side.value(key), value)
    assert side.receiver.stats()["landed_early"] == 5 and side.receiver.held("") == (0, 0)

    broken = Side()
    bad = KEY + 2
    with broken.receiver._lock:
        for key, value in values.items():
            left = Lent(os.getpid(), 4096 if key == bad else value.ctypes.data, LEFT, (1, 0), next(lease), "")
            broken.receiver.expect(key, RECV, RECV.expected(0), broken.landing)
            broken.deliver((1, 0), (LEFT, left), key=key)
            broken.deliver((1, 1), (RIGHT, Lent(os.getpid(), value.ctypes.data + 16, RIGHT, (1, 1), next(lease), "")),
                           key=key)
    for key in values:
        broken.receiver._landing[key].exception(timeout=30)
    for key, value in values.items():
        if key == bad:
            with pytest.raises(IslandFailedError, match="the sending host died"):
                broken.recv(key=key)
            continue
        assert broken.recv(key=key)
        np.testing.assert_array_equal(broken.value(key), value)
    assert broken.receiver.held("") == (0, 0)


def test_a_ready_receive_no_landing_thread_took_yet_is_landed_by_its_op():
    import os

    left, right = halves()
    side = Side()
    with side.receiver._lock:  # the landing threads wait for it
        side.receiver.expect(KEY, RECV, RECV.expected(0), side.landing)
        side.deliver((1, 0), (LEFT, Lent(os.getpid(), left.ctypes.data, LEFT, (1, 0), 1, "")))
        side.deliver((1, 1), (RIGHT, Lent(os.getpid(), right.ctypes.data, RIGHT, (1, 1), 2, "")))
        early = side.receiver._landing[KEY]
        assert side.recv()  # its op came first: it lands the receive itself
    assert early.cancelled()
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))
    assert side.receiver.stats()["landed_early"] == 0 and side.receiver.held("") == (0, 0)
    assert sorted(p.lease for p in side.peers.given_back) == [1, 2]


def test_pieces_that_arrived_whole_are_regathered_before_the_op_runs_and_counted_once(monkeypatch):
    """Pieces in this host's memory (over the network) of an admitted receive of at least ``GATHER_BYTES`` are
    gathered into the devices' regions on a landing thread as soon as they are all here (smaller ones by their op).
    Their bytes count toward the array they become: a tenant with room for one receive's pieces still takes the
    next receive's pieces while the first, landed, waits for its op; and the pieces are let go once landed."""
    import weakref

    from pathways.budgets import Budgets
    from resource_manager.host import receive

    small = Side()
    small.receiver.expect(KEY, RECV, RECV.expected(0), small.landing)
    small.deliver((1, 0), (LEFT, halves()[0]))
    small.deliver((1, 1), (RIGHT, halves()[1]))
    assert KEY not in small.receiver._landing and small.recv()  # 32 bytes: landed by the op
    np.testing.assert_array_equal(small.value(), np.arange(8, dtype=np.float32))

    monkeypatch.setattr(receive, "GATHER_BYTES", 0)
    side = Side()
    side.receiver._owner = lambda key: ("t", Budgets(parked_bytes=64))
    left, right = halves()
    side.receiver.expect(KEY, RECV, RECV.expected(0), side.landing)
    side.deliver((1, 0), (LEFT, left))
    assert KEY not in side.receiver._landing and side.receiver.held("t") == (1, 16)
    kept = weakref.ref(right := right.copy())
    side.deliver((1, 1), (RIGHT, right))
    del right
    side.receiver._landing[KEY].result(timeout=30)
    assert side.receiver.held("t") == (1, 32)  # the pieces' bytes count toward the landed array
    assert kept() is None  # and the pieces themselves were let go
    right = np.arange(4, 8, dtype=np.float32)
    side.deliver((1, 0), (LEFT, left * 2), key=KEY + 1)
    side.deliver((1, 1), (RIGHT, right * 2), key=KEY + 1)
    assert side.receiver.held("t") == (2, 64) and side.receiver.stats()["refused_pieces"] == 0
    assert side.recv() and side.recv(key=KEY + 1)
    np.testing.assert_array_equal(side.value(), np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(side.value(KEY + 1), 2 * np.arange(8, dtype=np.float32))
    assert side.receiver.stats()["landed_early"] == 1 and side.receiver.held("t") == (0, 0)
