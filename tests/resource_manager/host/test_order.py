"""An island's order (``order.IslandOrder``), wired as every host wires it: host 0 admits and orders a client's batch,
feeds its own inbox and sends the other hosts rows; executors' reports come back to it; hosts past 0 run host 0's
rows and send their landings up. The other hosts are reached through an ``Uplink`` that records what it is given
(the runtime reaches them through Ray, ``transport.ray.RayUplink``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.messages import CLIENT_ID_BITS, Free
from pathways.ops import Limits
from resource_manager.host import wiring
from resource_manager.host.devices import LocalDevices
from resource_manager.host.reports import Report
from resource_manager.host.rows import Landed, Message, decode_row
from resource_manager.host.transport.peers import Peers

LIMITS = Limits(0, 1, 2, 4, 1 << 30, 1 << 30)
CLIENT, TENANT = 1, "t"
BASE = CLIENT << CLIENT_ID_BITS


class Uplink:
    """What the order hands the island's other hosts."""

    def __init__(self) -> None:
        self.sent: list[list[tuple]] = []
        self.landings: list[Landed] = []

    def rows(self, rows: list[tuple]) -> None:
        self.sent.append(rows)

    def landed(self, landed: Landed) -> None:
        self.landings.append(landed)


@pytest.fixture
def hosts():
    """Hosts 0 and 1 of a two-host island, each with a value of the client's."""
    uplinks = [Uplink(), Uplink()]
    parts = [wiring.core(0, i, 2, LIMITS, LocalDevices(0), Peers(0, i, "node"), 5.0, 60.0, uplink=uplinks[i])
             for i in (0, 1)]
    for p in parts:
        p.grants.add_session(CLIENT, TENANT, b"k" * 32)
        p.table.put(BASE + 5, TENANT, jax.device_put(np.zeros(4, np.float32)))
    yield parts, uplinks
    for p in parts:
        p.executor.stop()


def test_a_batch_is_admitted_ordered_and_handed_to_every_host_of_the_island(hosts):
    (zero, one), (up, _) = hosts
    zero.order.submit(zero.grants.session(CLIENT), 0, [Free((BASE + 5,)).encode()])
    assert zero.inbox.next_seq == 1 and BASE + 5 not in zero.table  # this host's share: no actor call
    [rows] = up.sent
    [row] = [decode_row(r) for r in rows]
    assert row.seq == 0 and type(row.item) is Message and row.item.client == CLIENT
    one.order.rows(rows)  # host 1 runs host 0's rows the same
    assert one.inbox.next_seq == 1 and BASE + 5 not in one.table


def test_completions_go_to_host_0s_scheduler_and_landings_of_other_hosts_go_up(hosts):
    (zero, one), (up0, up1) = hosts
    one.order.report(Report(landed=[(3, 1)]))
    assert up1.landings == [Landed(1, ((3, 1),))]
    zero.order.report(Report(blocked=[7]))  # nothing of fragment 7 flies: the scheduler lets it be
    zero.order.landed(Landed(1, ((3, 1),)))
    assert up0.landings == [] and zero.scheduler.stats()["inflight"] == 0


def test_only_host_0_takes_batches_and_none_while_the_cluster_is_suspended(hosts):
    (zero, one), _ = hosts
    with pytest.raises(pw.PathwaysError, match="host 0 does"):
        one.order.submit(one.grants.session(CLIENT), 0, [Free(()).encode()])
    zero.order.quiescing = True
    with pytest.raises(pw.ClusterSuspendedError, match="being suspended"):
        zero.order.submit(zero.grants.session(CLIENT), 0, [Free(()).encode()])
    assert zero.inbox.next_seq == 0


def test_a_session_that_ends_frees_what_its_client_holds_in_the_islands_order(hosts):
    (zero, _), (up, _) = hosts
    zero.order.end_session(CLIENT, TENANT, free=True)
    assert BASE + 5 not in zero.table and len(up.sent) == 1


def test_a_lone_host_sends_no_rows():
    up = Uplink()
    lone = wiring.core(0, 0, 1, Limits(0, 1, 1, 4, 1 << 30, 1 << 30), LocalDevices(0), Peers(0, 0, "node"), 5.0,
                       60.0, uplink=up)
    try:
        lone.grants.add_session(CLIENT, TENANT, b"k" * 32)
        lone.order.submit(lone.grants.session(CLIENT), 0, [Free(()).encode()])
        assert lone.inbox.next_seq == 1 and up.sent == []
    finally:
        lone.executor.stop()
