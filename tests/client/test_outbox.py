"""A client's messages to the island schedulers (client/outbox.py): numbered per island, sent at once while few
are unanswered, coalesced into one batch while the host is busy, never reordered. The host is a fake link that
answers when a test says so."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

from client.link import LinkClosed
from client.outbox import Outbox, Outboxes, _encoded
from pathways.messages import MAX_CALLS, Call, Free, decode_request


class Link:
    """Records every batch and answers it only when told to."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.lock = threading.Lock()

    def start(self, make) -> Future:
        future: Future = Future()
        batch = make(len(self.batches) + 1)
        with self.lock:
            self.batches.append({"first": batch.first, "msgs": list(batch.msgs), "rid": batch.rid, "answer": future})
        return future

    def answer(self, k: int, error: BaseException | None = None) -> None:
        future = self.batches[k]["answer"]
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def payloads(self) -> list[list[bytes]]:
        return [b["msgs"] for b in self.batches]

    def firsts(self) -> list[int]:
        return [b["first"] for b in self.batches]


class Session:
    """What an outbox asks of its session: the link to host 0 of an island."""

    def __init__(self, islands: int = 1) -> None:
        self.links = [Link() for _ in range(islands)]

    def link(self, island: int, host: int) -> Link:
        assert host == 0
        return self.links[island]


def outbox(window: int = 2) -> tuple[Outbox, Link, threading.Event]:
    session, wake = Session(), threading.Event()
    return Outbox(session, 0, wake, window), session.links[0], wake


def test_messages_go_at_once_while_fewer_than_the_window_are_unanswered():
    box, link, _ = outbox(window=2)
    box.put(b"m0")
    box.put(b"m1")
    assert link.payloads() == [[b"m0"], [b"m1"]] and link.firsts() == [0, 1]


def test_while_the_host_is_busy_messages_wait_and_go_together_in_order():
    box, link, _ = outbox(window=2)
    for k in range(5):
        box.put(f"m{k}".encode())
    assert link.payloads() == [[b"m0"], [b"m1"]]  # m2..m4 wait for an answer
    link.answer(0)
    box.flush()
    assert link.payloads() == [[b"m0"], [b"m1"], [b"m2", b"m3", b"m4"]]
    assert link.firsts() == [0, 1, 2]  # each batch says the number of its first message
    box.put(b"m5")  # the host still has two unanswered batches: m5 waits
    assert len(link.batches) == 3
    link.answer(1)
    box.put(b"m6")  # a put sends what waited, with itself
    assert link.payloads()[3] == [b"m5", b"m6"] and link.firsts()[3] == 5


def test_an_answer_out_of_order_still_frees_a_place_only_once_the_oldest_is_answered():
    box, link, _ = outbox(window=2)
    for k in range(3):
        box.put(f"m{k}".encode())
    link.answer(1)  # the newer one answered first: the oldest still holds its place
    box.flush()
    assert len(link.batches) == 2
    link.answer(0)
    box.flush()
    assert link.payloads()[2] == [b"m2"] and link.firsts()[2] == 2


def test_no_message_is_ever_reordered_or_lost_under_concurrent_puts_and_answers():
    box, link, _ = outbox(window=2)
    stop = threading.Event()

    def answer_all():
        while not stop.is_set():
            with link.lock:
                pending = [b["answer"] for b in link.batches if not b["answer"].done()]
            for future in pending:
                future.set_result(None)
            box.flush()
            time.sleep(0.0005)

    answerer = threading.Thread(target=answer_all)
    answerer.start()
    putters = [threading.Thread(target=lambda j=j: [box.put((j * 1000 + k).to_bytes(4, "little"))
                                                    for k in range(1000)]) for j in range(2)]
    for t in putters:
        t.start()
    for t in putters:
        t.join()
    assert box.drain(time.monotonic() + 10)
    stop.set()
    answerer.join()
    sent = [int.from_bytes(p, "little") for batch in link.payloads() for p in batch]
    assert sorted(sent) == list(range(1000)) + list(range(1000, 2000))
    for j in range(2):  # each thread's messages keep their order
        mine = [v for v in sent if v // 1000 == j]
        assert mine == sorted(mine)
    sizes = [len(b) for b in link.payloads()]
    assert link.firsts() == [sum(sizes[:k]) for k in range(len(sizes))]


def test_an_answer_wakes_the_sender_only_when_messages_wait():
    box, link, wake = outbox(window=1)
    box.put(b"m0")
    link.answer(0)
    assert not wake.is_set()
    box.put(b"m1")
    box.put(b"m2")  # waits for m1's answer
    link.answer(1)
    assert wake.is_set()


def test_drain_waits_for_answers_and_gives_up_at_its_deadline():
    box, link, _ = outbox(window=1)
    box.put(b"m0")
    box.put(b"m1")
    start = time.monotonic()
    assert not box.drain(time.monotonic() + 0.2)  # nobody answers m0
    assert 0.15 < time.monotonic() - start < 5 and len(link.batches) == 1
    threading.Timer(0.05, link.answer, args=(0,)).start()
    threading.Timer(0.2, lambda: link.answer(1) if len(link.batches) > 1 else None).start()
    assert box.drain(time.monotonic() + 10)
    assert link.payloads() == [[b"m0"], [b"m1"]]


def test_a_refusal_is_logged_and_a_dead_island_is_not(caplog):
    box, link, _ = outbox(window=2)
    box.put(b"m0")
    box.put(b"m1")
    with caplog.at_level(logging.ERROR, logger="client.outbox"):
        link.answer(0, ValueError("a message is sent once"))
        link.answer(1, LinkClosed("the connection ended"))
    assert [r.getMessage() for r in caplog.records] == [
        "island 0 refused a batch of this client's messages: a message is sent once"]


def test_each_island_numbers_its_own_stream_and_a_restarted_island_starts_again_at_zero():
    session = Session(islands=2)
    boxes = Outboxes(session, 2, window=4)
    try:
        for island in (0, 1, 0, 0):
            boxes.put(island, f"i{island}".encode())
        assert session.links[0].firsts() == [0, 1, 2] and session.links[1].firsts() == [0]
        session.links[1] = fresh = Link()
        boxes.restart(1)
        boxes.put(1, b"after restart")
        assert fresh.firsts() == [0]
    finally:
        boxes.close(1.0, skip={0, 1})


def test_the_sender_thread_sends_what_waited_once_the_host_answers():
    session = Session()
    boxes = Outboxes(session, 1, window=1)
    link = session.links[0]
    try:
        boxes.put(0, b"m0")
        boxes.put(0, b"m1")  # waits; no further dispatch will come to send it
        link.answer(0)
        deadline = time.monotonic() + 10
        while len(link.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.payloads() == [[b"m0"], [b"m1"]]
    finally:
        link.answer(1)
        boxes.close(1.0, skip=set())


@pytest.mark.parametrize("window", [1, 3])
def test_the_window_of_unanswered_batches_holds(window):
    box, link, _ = outbox(window=window)
    for k in range(10):
        box.put(bytes([k]))
    assert len(link.batches) == window


# -- a suspended cluster ----------------------------------------------------------------------------------

def test_a_batch_answered_suspended_is_kept_and_sent_again_from_where_the_island_resumes():
    from pathways.errors import ClusterSuspendedError

    box, link, _ = outbox(window=2)
    for k in range(3):
        box.put(f"m{k}".encode())
    link.answer(0)
    link.answer(1, ClusterSuspendedError("suspended"))  # m1 was refused; m2 waits behind it
    box.flush()
    assert box.drain(time.monotonic() + 1)  # a paused outbox does not wait for a resume
    box.put(b"m3")  # while suspended: held, not sent
    assert link.payloads() == [[b"m0"], [b"m1"]]
    box.resume(1)  # the island took m0 only
    box.flush()
    assert link.payloads()[2:] == [[b"m1", b"m2", b"m3"]] and link.firsts()[2:] == [1]


def test_what_the_island_took_before_the_link_closed_is_not_sent_twice():
    box, link, _ = outbox(window=2)
    box.put(b"m0")
    box.put(b"m1")
    box.pause()  # the client stopped sending; then the islands stopped with both batches unanswered
    link.answer(0, LinkClosed("gone"))
    link.answer(1, LinkClosed("gone"))
    box.put(b"m2")
    box.resume(1)  # the saved island had taken m0
    box.flush()
    assert link.payloads()[2:] == [[b"m1", b"m2"]] and link.firsts()[2:] == [1]


def test_a_lost_message_is_reported_when_the_island_resumes_past_what_was_kept(caplog):
    box, link, _ = outbox(window=2)
    box.put(b"m0")
    link.answer(0)
    box.pause()
    with caplog.at_level(logging.ERROR, logger="client.outbox"):
        box.resume(0)  # the island says it never took m0, which this client no longer holds
    assert "1 message(s) are lost" in caplog.text


def test_the_gate_lets_calls_under_way_finish_and_new_ones_wait_for_the_resume():
    from client.suspension import Gate
    from pathways.errors import ClusterSuspendedError

    gate = Gate()
    inside, leave, log = threading.Event(), threading.Event(), []

    def call() -> None:
        with gate.sending(5, "a call"):
            inside.set()
            with gate.sending(5, "its put"):  # nested in the same call: never waits
                leave.wait(5)
            log.append("first done")

    first = threading.Thread(target=call)
    first.start()
    inside.wait(5)
    closer = threading.Thread(target=lambda: log.append(("closed", gate.close("suspending", 5))))
    closer.start()
    time.sleep(0.1)
    assert log == []  # close waits for the call under way
    leave.set()
    first.join(5)
    closer.join(5)
    assert log == ["first done", ("closed", True)] and not gate.open
    with pytest.raises(ClusterSuspendedError, match="a new call: the cluster is suspending.*pathways resume"):
        with gate.sending(0.05, "a new call"):
            pass
    later = threading.Thread(target=lambda: gate.wait_open(5, "waiting") or log.append("went on"))
    later.start()
    time.sleep(0.1)
    assert log[-1] != "went on"
    gate.reopen()
    later.join(5)
    assert log[-1] == "went on"


def test_calls_of_one_program_waiting_together_go_as_one_merged_message_in_order():
    """Held calls of one program back to back become one ``Calls`` message (at most ``MAX_CALLS``); a call of
    another program, one carrying executables, or another kind of message in between keeps its place."""
    a, b = b"program a", b"program b"
    free = Free((7,)).encode()
    held = ([Call(a, k, (1,), {}, (k - 1,)) for k in range(3)] + [free, Call(a, 10, (1,), {}, ())]
            + [Call(b, 11, (), {}, ()), Call(b, 12, (), {"h": b"x"}, ()), Call(b, 13, (), {}, ())]
            + [Call(a, 100 + k, (), {}, ()) for k in range(MAX_CALLS + 1)])
    wire = [decode_request(m) if m != free else "free" for m in _encoded(held)]
    kinds = [type(m).__name__ if m != "free" else m for m in wire]
    assert kinds == ["Calls", "free", "Call", "Call", "Call", "Call", "Calls", "Call"]
    assert wire[0].split() == held[:3] and wire[6].split() == held[8:8 + MAX_CALLS] and wire[7] == held[-1]
    assert wire[3:6] == held[5:8]
