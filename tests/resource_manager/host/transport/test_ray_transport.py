"""The Ray transport (``transport.ray``): deliveries, leases and an island's rows as actor calls signed with the runtime
key for the receiving host, which its actor (``HostActor``) accepts and hands straight to the part they are for. The
actor handles here record the calls Ray would carry; the actors are real, wired as a host wires its parts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pathways as pw
from pathways import auth
from pathways.messages import CLIENT_ID_BITS, Deliver, Free, Lending
from pathways.ops import Limits
from resource_manager.host import wiring
from resource_manager.host.actor import HostActor
from resource_manager.host.admission import Admitted
from resource_manager.host.devices import LocalDevices
from resource_manager.host.rows import Landed, encode
from resource_manager.host.transport.peers import Peers
from resource_manager.host.transport.ray import RayTransport, RayUplink

KEY = b"k" * 32


class Method:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any) -> None:
        self.calls.append((self.name, args))


class Handle:
    """An actor handle that records the calls made through it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Method:
        return Method(self.calls, name)


class Handles:
    def __init__(self) -> None:
        self.handles: dict[tuple[int, int], Handle] = {}

    def handle(self, island: int, host: int) -> Handle:
        if (island, host) == (9, 9):
            raise KeyError("never named")
        return self.handles.setdefault((island, host), Handle())


class Inbound:
    def __init__(self) -> None:
        self.got: list[tuple[Deliver, tuple, tuple[int, int]]] = []

    def deliver(self, msg: Deliver, pieces: tuple, sender: tuple[int, int]) -> None:
        self.got.append((msg, pieces, sender))


def actor(island: int, host: int, n_hosts: int) -> HostActor:
    """Host ``host``'s actor with its parts wired (what ``start`` does, without JAX's distributed group)."""
    a = HostActor(island, host, n_hosts, 0, 5.0, 60.0, KEY, "runtime")
    a._host.parts = wiring.core(island, host, n_hosts, Limits(island, 1, n_hosts, 4, 1 << 30, 1 << 30),
                                LocalDevices(0), Peers(island, host, "node"), 5.0, 60.0)
    return a


def test_a_delivery_is_a_signed_call_its_receiver_checks_and_files():
    handles, inbound = Handles(), Inbound()
    sender = RayTransport(KEY, handles, inbound)
    msg, value = Deliver(7, 0, 1, (((0, 4),),)), np.arange(4.0)
    sender.send((1, 0), msg, [value], 1.0)
    [(name, (meta, mac, array))] = handles.handles[(1, 0)].calls
    assert name == "deliver" and auth.verify(KEY, mac, "deliver", 1, 0, meta)
    assert not auth.verify(KEY, mac, "deliver", 1, 1, meta)  # worth nothing at any other host
    receiver = RayTransport(KEY, handles, inbound)
    receiver.receive(meta, (array,))
    [(got, pieces, who)] = inbound.got
    assert got == msg and pieces[0] is value and who == (0, 1)


def test_a_delivery_whose_arrays_do_not_match_its_shards_or_that_claims_a_lease_is_refused():
    inbound = Inbound()
    receiver = RayTransport(KEY, Handles(), inbound)
    with pytest.raises(pw.WireFormatError, match="1 shard indices but 2 arrays"):
        receiver.receive(Deliver(7, 0, 1, (((0, 4),),)).encode(), (np.zeros(4), np.zeros(4)))
    lent = Deliver(7, 0, 1, (((0, 4),),), None, Lending(1, (4096,), ""))
    with pytest.raises(pw.WireFormatError):
        receiver.receive(lent.encode(), (np.zeros(4),))
    assert inbound.got == []


def test_leases_go_back_as_a_signed_call_the_lender_accepts():
    handles = Handles()
    transport = RayTransport(KEY, handles, Inbound())
    lender = actor(0, 1, 2)
    try:
        peers = lender._host.parts.peers
        lease = peers.keep([np.zeros(100)], 1)
        assert transport.give_back((0, 1), "", [lease])
        [(name, (payload, mac))] = handles.handles[(0, 1)].calls
        with pytest.raises(pw.TenantAccessError):
            lender.release_lent(payload, auth.sign(KEY, "returned", 0, 2, payload))  # signed for another host
        assert peers.lent_bytes == 800
        getattr(lender, name)(payload, mac)
        assert peers.lent_bytes == 0
    finally:
        lender._host.parts.executor.stop()
    assert transport.give_back((9, 9), "", [1])  # a sender gone with its island: nothing to return it to


def test_an_islands_rows_and_landings_reach_its_hosts_as_signed_calls_they_accept():
    handles = Handles()
    zero, one = actor(0, 0, 2), actor(0, 1, 2)
    base = 1 << CLIENT_ID_BITS
    try:
        for a in (zero, one):
            a._host.parts.grants.add_session(1, "t", KEY)
        rows = encode([(0, Admitted(1, "t", Free((base + 5,)).encode(), None))])
        RayUplink(KEY, 0, 2, handles).rows(rows)
        [(name, args)] = handles.handles[(0, 1)].calls
        with pytest.raises(pw.TenantAccessError):
            zero.enqueue_batch(*args)  # signed for host 1 only
        getattr(one, name)(*args)
        assert one._host.parts.inbox.next_seq == 1
        RayUplink(KEY, 0, 2, handles).landed(Landed(1, ((0, 2),)))
        [(name, (landed, mac))] = handles.handles[(0, 0)].calls
        with pytest.raises(pw.TenantAccessError):
            zero.landed(Landed(1, ((0, 3),)), mac)  # another report under the same MAC
        getattr(zero, name)(landed, mac)
    finally:
        zero._host.parts.executor.stop()
        one._host.parts.executor.stop()
