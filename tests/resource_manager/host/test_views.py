"""What a host says about itself (``views.HostViews``): a tenant sees its own and others only as sums; the admin's
aggregates name no tenant."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from pathways.events import OTHER
from pathways.messages import CLIENT_ID_BITS
from pathways.ops import Limits
from resource_manager.host import wiring
from resource_manager.host.devices import LocalDevices
from resource_manager.host.transport.peers import Peers


@pytest.fixture
def parts():
    p = wiring.core(0, 0, 1, Limits(0, 1, 1, 4, 1 << 30, 1 << 30), LocalDevices(0), Peers(0, 0, "node"), 5.0, 60.0,
                    epoch=3)
    for client, tenant in ((1, "alice"), (2, "bob")):
        p.grants.add_session(client, tenant, b"k" * 32)
        p.table.put((client << CLIENT_ID_BITS) + 1, tenant, jax.device_put(np.zeros(client * 4, np.float32)))
    p.scheduler.charge("alice", 0.5)
    p.scheduler.charge("bob", 0.25)
    yield p
    p.executor.stop()


def test_a_tenant_sees_its_own_usage_and_the_others_island_time_only_as_a_sum(parts):
    views = parts.views
    assert views.usage("alice", reset_peak=False)["buffer_bytes"] == 16
    assert views.usage("bob", reset_peak=False)["buffer_bytes"] == 32
    mine = views.schedule_stats("alice")
    assert mine["tenant_time_s"] == {"alice": 0.5} and mine["others_time_s"] == 0.25
    assert "bob" not in repr(mine)
    assert views.schedule_stats(None)["tenant_time_s"] == {"alice": 0.5, "bob": 0.25}  # the admin's view
    assert views.stalled("alice") == {"island": 0, "host": 0, "held": 0, "runs": []}


def test_the_hosts_aggregates_name_no_tenant(parts):
    stats = parts.views.stats()
    assert (stats["epoch"], stats["buffers"], stats["buffer_bytes"], stats["dead"]) == (3, 2, 48, "")
    assert "alice" not in repr(stats) and "bob" not in repr(stats)
    assert parts.views.census() == {"alice": (1, 16), "bob": (1, 32)}
    quiet = parts.views.quiet()
    assert quiet["idle"] and quiet["sequenced"] == 0 and quiet["bytes"] == 48


def test_a_trace_is_the_clients_own_and_ends_once(parts):
    views = parts.views
    views.trace_start(1)
    now = time.time()
    parts.events.span("mine", "x", now, now + 1.0, tenant="alice")
    parts.events.span("theirs", "x", now, now + 1.0, tenant="bob")
    events = views.trace_stop(1, "alice")
    assert [e[0] for e in events] == ["mine", OTHER] and "bob" not in repr(events)
    assert views.trace_stop(1, "alice") == []  # its recording ended with the first stop
