"""A client's messages to the island schedulers (client/outbox.py): numbered per island, sent at once while
few are unanswered, coalesced into one batch while the scheduler is busy, never reordered, and signed over
their number, payloads and object refs. The scheduler is a fake that answers when a test says so."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

from client.outbox import Outbox, Outboxes
from pathways import auth

KEY = b"k" * 32
CLIENT = 7


def sign(purpose: str, *parts) -> bytes:
    return auth.sign(KEY, purpose, *parts)


class Ref:
    """What ``submit_batch.remote`` returns: an object ref whose ``future()`` the outbox waits on."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def future(self) -> Future:
        return self._future


class ObjectRef:
    """An object ref riding along with a put (the outbox signs its binary form)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def binary(self) -> bytes:
        return self.name.encode()


class Scheduler:
    """Records every ``submit_batch`` and answers it only when told to."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.lock = threading.Lock()
        self.submit_batch = self  # called as scheduler.submit_batch.remote(...)

    def remote(self, client: int, first: int, items: list, mac: bytes) -> Ref:
        future: Future = Future()
        with self.lock:
            self.batches.append({"client": client, "first": first, "items": items, "mac": mac, "answer": future})
        return Ref(future)

    def answer(self, k: int, error: BaseException | None = None) -> None:
        future = self.batches[k]["answer"]
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def payloads(self) -> list[list[bytes]]:
        return [[payload for payload, _ in b["items"]] for b in self.batches]

    def firsts(self) -> list[int]:
        return [b["first"] for b in self.batches]


def outbox(unanswered: int = 2) -> tuple[Outbox, Scheduler, threading.Event]:
    scheduler, wake = Scheduler(), threading.Event()
    return Outbox(scheduler, CLIENT, sign, wake, unanswered), scheduler, wake


def test_messages_go_at_once_while_fewer_than_the_limit_are_unanswered():
    box, scheduler, _ = outbox(unanswered=2)
    box.put(b"m0", None)
    box.put(b"m1", None)
    assert scheduler.payloads() == [[b"m0"], [b"m1"]] and scheduler.firsts() == [0, 1]
    assert all(b["client"] == CLIENT for b in scheduler.batches)


def test_while_the_scheduler_is_busy_messages_wait_and_go_together_in_order():
    box, scheduler, _ = outbox(unanswered=2)
    for k in range(5):
        box.put(f"m{k}".encode(), None)
    assert scheduler.payloads() == [[b"m0"], [b"m1"]]  # m2..m4 wait for an answer
    scheduler.answer(0)
    box.flush()
    assert scheduler.payloads() == [[b"m0"], [b"m1"], [b"m2", b"m3", b"m4"]]
    assert scheduler.firsts() == [0, 1, 2]  # each batch says the number of its first message
    box.put(b"m5", None)  # the scheduler still has two unanswered batches: m5 waits
    assert len(scheduler.batches) == 3
    scheduler.answer(1)
    box.put(b"m6", None)  # a put sends what waited, with itself
    assert scheduler.payloads()[3] == [b"m5", b"m6"] and scheduler.firsts()[3] == 5


def test_an_answer_out_of_order_still_frees_a_place_only_once_the_oldest_is_answered():
    box, scheduler, _ = outbox(unanswered=2)
    for k in range(3):
        box.put(f"m{k}".encode(), None)
    scheduler.answer(1)  # the newer one answered first: the oldest still holds its place
    box.flush()
    assert len(scheduler.batches) == 2
    scheduler.answer(0)
    box.flush()
    assert scheduler.payloads()[2] == [b"m2"] and scheduler.firsts()[2] == 2


def test_no_message_is_ever_reordered_or_lost_under_concurrent_puts_and_answers():
    box, scheduler, _ = outbox(unanswered=2)
    stop = threading.Event()

    def answer_all():
        while not stop.is_set():
            with scheduler.lock:
                pending = [b["answer"] for b in scheduler.batches if not b["answer"].done()]
            for future in pending:
                future.set_result(None)
            box.flush()
            time.sleep(0.0005)

    answerer = threading.Thread(target=answer_all)
    answerer.start()
    for k in range(2000):
        box.put(k.to_bytes(4, "little"), None)
    assert box.drain(time.monotonic() + 10)
    stop.set()
    answerer.join()
    sent = [int.from_bytes(p, "little") for batch in scheduler.payloads() for p in batch]
    assert sent == list(range(2000))
    sizes = [len(b) for b in scheduler.payloads()]
    assert scheduler.firsts() == [sum(sizes[:k]) for k in range(len(sizes))]


def test_a_batch_is_signed_over_its_first_number_payloads_and_refs():
    box, scheduler, _ = outbox(unanswered=1)
    box.put(b"a", None)
    box.put(b"b", [ObjectRef("r1"), ObjectRef("r2")])
    box.put(b"c", None)
    scheduler.answer(0)
    box.flush()
    batch = scheduler.batches[1]
    assert [(p, [r.name for r in refs]) for p, refs in batch["items"]] == [(b"b", ["r1", "r2"]), (b"c", [])]
    assert auth.verify(KEY, batch["mac"], "submit", 1, b"b", b"r1", b"r2", b"c")
    assert not auth.verify(KEY, batch["mac"], "submit", 0, b"b", b"r1", b"r2", b"c")  # the number counts
    assert not auth.verify(KEY, batch["mac"], "submit", 1, b"c", b"b", b"r1", b"r2")  # so does the order


def test_an_answer_wakes_the_sender_only_when_messages_wait():
    box, scheduler, wake = outbox(unanswered=1)
    box.put(b"m0", None)
    scheduler.answer(0)
    assert not wake.is_set()
    box.put(b"m1", None)
    box.put(b"m2", None)  # waits for m1's answer
    scheduler.answer(1)
    assert wake.is_set()


def test_drain_waits_for_answers_and_gives_up_at_its_deadline():
    box, scheduler, _ = outbox(unanswered=1)
    box.put(b"m0", None)
    box.put(b"m1", None)
    start = time.monotonic()
    assert not box.drain(time.monotonic() + 0.2)  # nobody answers m0
    assert 0.15 < time.monotonic() - start < 5 and len(scheduler.batches) == 1
    threading.Timer(0.05, scheduler.answer, args=(0,)).start()
    assert box.drain(time.monotonic() + 10)
    assert scheduler.payloads() == [[b"m0"], [b"m1"]]


def test_a_refusal_is_logged_and_a_dead_island_is_not(caplog):
    from ray.exceptions import RayActorError

    box, scheduler, _ = outbox(unanswered=2)
    box.put(b"m0", None)
    box.put(b"m1", None)
    with caplog.at_level(logging.ERROR, logger="client.outbox"):
        scheduler.answer(0, ValueError("bad mac"))
        scheduler.answer(1, RayActorError())
    assert [r.getMessage() for r in caplog.records] == ["an island scheduler refused a message: bad mac"]


def test_each_island_numbers_its_own_stream_and_a_replaced_scheduler_starts_again_at_zero():
    schedulers = [Scheduler(), Scheduler()]
    boxes = Outboxes(schedulers, CLIENT, sign, unanswered=4)
    try:
        for island in (0, 1, 0, 0):
            boxes.put(island, f"i{island}".encode(), None)
        assert schedulers[0].firsts() == [0, 1, 2] and schedulers[1].firsts() == [0]
        fresh = Scheduler()
        boxes.replace(1, fresh)
        boxes.put(1, b"after restart", None)
        assert fresh.firsts() == [0] and schedulers[1].firsts() == [0]
    finally:
        boxes.close(1.0, skip={0, 1})


def test_the_sender_thread_sends_what_waited_once_the_scheduler_answers():
    scheduler = Scheduler()
    boxes = Outboxes([scheduler], CLIENT, sign, unanswered=1)
    try:
        boxes.put(0, b"m0", None)
        boxes.put(0, b"m1", None)  # waits; no further dispatch will come to send it
        scheduler.answer(0)
        deadline = time.monotonic() + 10
        while len(scheduler.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.payloads() == [[b"m0"], [b"m1"]]
    finally:
        scheduler.answer(1)
        boxes.close(1.0, skip=set())


def test_close_sends_what_is_held_except_to_skipped_islands():
    schedulers = [Scheduler(), Scheduler()]
    boxes = Outboxes(schedulers, CLIENT, sign, unanswered=1)
    for island in (0, 0, 1, 1):
        boxes.put(island, f"i{island}".encode(), None)
    threading.Timer(0.05, schedulers[0].answer, args=(0,)).start()
    boxes.close(5.0, skip={1})
    assert schedulers[0].payloads() == [[b"i0"], [b"i0"]] and schedulers[1].payloads() == [[b"i1"]]


@pytest.mark.parametrize("unanswered", [1, 3])
def test_the_limit_of_unanswered_batches_holds(unanswered):
    box, scheduler, _ = outbox(unanswered=unanswered)
    for k in range(10):
        box.put(bytes([k]), None)
    assert len(scheduler.batches) == unanswered
