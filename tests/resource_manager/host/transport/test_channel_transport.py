"""The same-node channel as a transport (``transport.channel.ChannelTransport``): small shards inside the frame, large
ones lent until their lease comes back, every frame checked against the runtime host the kernel says sent it."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import pathways as pw
from pathways.messages import Deliver
from resource_manager.host.transport.channel import MIN_LENT, ChannelTransport, pieces_of
from resource_manager.host.transport.direct import Lent, readable
from resource_manager.host.transport.interface import Sent
from resource_manager.host.transport.peers import PeerInfo, Peers

pytestmark = pytest.mark.skipif(not readable(), reason="the channel and lent shards are Linux only")
KEY = b"k" * 32
SHARD = ((0, 4),)


class Inbound:
    def __init__(self) -> None:
        self.got: list[tuple[Deliver, tuple, tuple[int, int]]] = []
        self.cond = threading.Condition()

    def deliver(self, msg: Deliver, pieces: tuple, sender: tuple[int, int]) -> None:
        with self.cond:
            self.got.append((msg, pieces, sender))
            self.cond.notify_all()

    def wait(self, n: int) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, 30), self.got
            return list(self.got)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair():
    """Island 1's host 0 (the sender) and island 0's host 0 (the receiver), both this process (the kernel names its
    pid to each; the receiver's table of hosts says that pid is island 1's host 0)."""
    sender_peers, receiver_peers = Peers(1, 0, "node"), Peers(0, 0, "node")
    inbound = Inbound()
    sender = ChannelTransport(KEY, "node", sender_peers, sender_peers, Inbound())
    receiver = ChannelTransport(KEY, "node", receiver_peers, receiver_peers, inbound)
    receiver_peers.set_hosts([PeerInfo(1, 0, "node", os.getpid(), sender.address, "", None)])
    sender_peers.set_hosts([PeerInfo(0, 0, "node", os.getpid(), receiver.address, "", None)])
    sender._links[(0, 0)] = receiver.address  # what a probe of the receiver found (it needs Ray)
    yield sender, sender_peers, receiver, inbound
    sender.close()
    receiver.close()


def test_small_shards_travel_inside_the_frame(pair):
    sender, _, _, inbound = pair
    value = np.arange(4, dtype=np.float32)
    assert sender.send((0, 0), Deliver(7, 1, 0, (SHARD,)), [value], 5.0) is Sent.SENT
    [(msg, pieces, who)] = inbound.wait(1)
    assert (msg.key, who) == (7, (1, 0))
    np.testing.assert_array_equal(pieces[0], value)


def test_large_shards_are_lent_until_their_lease_comes_back(pair):
    sender, sender_peers, receiver, inbound = pair
    value = np.ones(MIN_LENT // 4, np.float32)
    assert sender.send((0, 0), Deliver(7, 1, 0, (((0, len(value)),),)), [value], 5.0) is Sent.LENT
    [(_, (piece,), _)] = inbound.wait(1)
    assert type(piece) is Lent and piece.pid == os.getpid() and piece.reply == sender.address
    assert sender_peers.lent_bytes == value.nbytes
    assert receiver.give_back((1, 0), piece.reply, [piece.lease])
    wait_for(lambda: sender_peers.lent_bytes == 0)


def test_a_frame_that_claims_another_host_is_refused(pair):
    sender, _, receiver, inbound = pair
    forged = Deliver(7, 2, 3, (SHARD,), None, None, "float32")  # the kernel says island 1's host 0 sent it
    sender.channel.send(receiver.address, forged.encode(), [np.zeros(4, np.float32)])
    wait_for(lambda: receiver.channel.refused == 1)
    assert inbound.got == []


def test_a_peer_without_a_link_is_left_to_the_next_transport(pair):
    sender, _, _, _ = pair
    assert sender.send((5, 0), Deliver(7, 1, 0, (SHARD,)), [np.zeros(4)], 5.0) is Sent.PASSED


def test_a_frame_and_its_message_must_agree():
    frame = memoryview(np.zeros(4, np.float32).tobytes())
    with pytest.raises(pw.WireFormatError, match="more bytes than the frame carries"):
        pieces_of(Deliver(7, 1, 0, (((0, 8),),), None, None, "float32"), frame, 1, (1, 0))
    with pytest.raises(pw.WireFormatError, match="takes? 8 bytes but the frame carries 16"):
        pieces_of(Deliver(7, 1, 0, (((0, 2),),), None, None, "float32"), frame, 1, (1, 0))
    with pytest.raises(pw.WireFormatError, match="1 shard indices but 0 arrays"):
        pieces_of(Deliver(7, 1, 0, (SHARD,)), frame, 1, (1, 0))
