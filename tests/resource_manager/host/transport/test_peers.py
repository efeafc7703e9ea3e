"""How a delivery reaches a peer (``transport.peers``): the first transport of the route table that carries it, and
leases back the same way; what a host lends stays alive until its lease comes back."""

from __future__ import annotations

import numpy as np
import pytest

from pathways.messages import Deliver
from resource_manager.host.transport.direct import Lent
from resource_manager.host.transport.interface import Peer, Sent, Transport
from resource_manager.host.transport.peers import ROUTE, Peers

MSG = Deliver(7, 0, 0, (((0, 4),),))


class Recording(Transport):
    """A transport that answers ``answer`` and records what it was asked to carry."""

    def __init__(self, name: str, answer: Sent, takes_leases: bool = False) -> None:
        self.name, self.answer, self.takes_leases = name, answer, takes_leases
        self.sent: list[tuple[Peer, Deliver]] = []
        self.leases: list[tuple[Peer, str, list[int]]] = []

    def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
        self.sent.append((peer, msg))
        return self.answer

    def give_back(self, peer: Peer, reply: str, leases: list[int]) -> bool:
        self.leases.append((peer, reply, leases))
        return self.takes_leases

    def close(self) -> None:
        pass


def test_a_delivery_goes_by_the_first_transport_of_the_route_that_carries_it():
    assert ROUTE == ("channel", "network", "ray")
    peers = Peers(0, 0, "node")
    channel, network, ray = (Recording("channel", Sent.PASSED), Recording("network", Sent.SENT),
                             Recording("ray", Sent.SENT))
    peers.use(ray, None, network, channel)  # the table orders them, not the caller
    assert peers.send(1, 2, MSG, [np.zeros(4)], 1.0) is False
    assert channel.sent == [((1, 2), MSG)] and network.sent == [((1, 2), MSG)] and ray.sent == []
    channel.answer = Sent.LENT
    assert peers.send(1, 2, MSG, [np.zeros(4)], 1.0) is True and len(network.sent) == 1


def test_a_delivery_no_transport_carries_is_an_error_and_an_unknown_transport_has_no_place():
    peers = Peers(0, 0, "node")
    peers.use(Recording("channel", Sent.PASSED))
    with pytest.raises(ConnectionError, match="no transport reaches host 2 of island 1"):
        peers.send(1, 2, MSG, [], 1.0)
    with pytest.raises(ValueError, match="no place in the route"):
        peers.use(Recording("pigeon", Sent.SENT))


def test_leases_go_back_to_their_senders_by_the_first_transport_that_takes_them():
    peers = Peers(0, 0, "node")
    channel, ray = Recording("channel", Sent.SENT), Recording("ray", Sent.SENT, takes_leases=True)
    peers.use(channel, ray)
    pieces = [Lent(99, 0, ((0, 4),), (1, 0), 5, "sock-a"), Lent(99, 0, ((4, 8),), (1, 0), 6, "sock-a"),
              Lent(98, 0, ((0, 4),), (2, 1), 9, "")]
    peers.give_back(pieces)
    assert peers.returns.wait_sent(30)  # they go back on a thread of their own
    assert channel.leases == [((1, 0), "sock-a", [5, 6]), ((2, 1), "", [9])]
    assert ray.leases == channel.leases  # the channel took none of them
    channel.takes_leases = True
    peers.give_back(pieces[:1])
    assert peers.returns.wait_sent(30)
    assert len(ray.leases) == 2
    peers.close()  # later leases go back on the caller's thread
    peers.give_back(pieces[:1])
    assert len(channel.leases) == 4 and peers.returns.sent == 4


def test_lent_arrays_stay_alive_until_their_lease_comes_back_or_their_island_fails():
    peers = Peers(0, 0, "node")
    a, b = np.zeros(1000), np.zeros(10)
    first, second = peers.keep([a], 1), peers.keep([b], 2)
    assert first != second and peers.lent_bytes == a.nbytes + b.nbytes
    peers.release([first])
    assert peers.lent_bytes == b.nbytes
    peers.drop_island(2)
    assert peers.lent_bytes == 0
    assert not peers.linked(1, [0])  # no channel: no peer takes frames on it


def test_a_transport_must_say_how_it_sends_and_closes_and_returns_no_lease_unless_it_can():
    class Half(Transport):
        name = "ray"

        def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
            return Sent.SENT

    with pytest.raises(TypeError, match="close"):
        Half()
    assert Recording("ray", Sent.SENT).stats() == {}
    assert Transport.give_back(Recording("ray", Sent.SENT), (0, 0), "", [1]) is False
