"""The client keeps its untaken puts to each host within the tenant's parked_bytes budget."""

from __future__ import annotations

import pytest

import client.parked as parked
from client.parked import ParkedWindow
from pathways.errors import IslandFailedError, ResourceError


class Put:
    """A put's array as the window sees it: ready once the island took it."""

    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def block_until_ready(self, timeout: float) -> Put:
        self.log.append(self.name)
        if self.fails:
            raise IslandFailedError("island 0 has failed")
        return self


def test_puts_within_the_budget_wait_for_nothing() -> None:
    log: list[str] = []
    window = ParkedWindow(100, timeout=1.0)
    puts = [Put(str(k), log) for k in range(5)]
    for put in puts:
        window.make_room({(0, 0): 20}, "pw.put")
        window.sent(put, {(0, 0): 20})
    window.make_room({(1, 0): 100}, "pw.put")  # another island's host has its own room
    assert log == []


def test_a_put_over_the_room_waits_for_the_fewest_oldest_puts_then_sends() -> None:
    log: list[str] = []
    window = ParkedWindow(100, timeout=1.0)
    puts = [Put(str(k), log) for k in range(4)]
    for put in puts:
        window.sent(put, {(0, 0): 25})
    window.make_room({(0, 0): 60}, "pw.put")  # 60 more need 60 out: the first three; waiting for the third will do
    assert log == ["2"]
    window.make_room({(0, 0): 75}, "pw.put")  # 25 held and 75 more fit
    assert log == ["2"]


def test_a_dropped_put_is_waited_for_through_a_later_one_and_a_failed_one_counts_as_gone() -> None:
    log: list[str] = []
    window = ParkedWindow(100, timeout=1.0)
    dropped = Put("dropped", log)
    window.sent(dropped, {(0, 0): 50})
    failed = Put("failed", log, fails=True)
    window.sent(failed, {(0, 0): 50})
    del dropped
    window.make_room({(0, 0): 40}, "pw.put")
    assert log == ["failed"]
    window.make_room({(0, 0): 100}, "pw.put")
    assert log == ["failed"]


def test_many_small_puts_are_counted_in_halves_not_one_wait_each(monkeypatch) -> None:
    monkeypatch.setattr(parked, "ENTRIES", 8)
    log: list[str] = []
    window = ParkedWindow(1 << 30, timeout=1.0)
    puts = [Put(str(k), log) for k in range(20)]
    for put in puts:
        window.make_room({(0, 0): 1}, "pw.put")
        window.sent(put, {(0, 0): 1})
    assert log == ["3", "7", "11"]  # one wait per four puts, not one per put past the eighth


def test_a_value_whose_pieces_for_one_host_are_over_the_budget_is_refused_before_it_is_sent() -> None:
    window = ParkedWindow(100, timeout=1.0)
    with pytest.raises(ResourceError, match="island 0 host 1 are 101 bytes, over your parked_bytes budget of 100"):
        window.make_room({(0, 0): 10, (0, 1): 101}, "pw.put of ['w']")
