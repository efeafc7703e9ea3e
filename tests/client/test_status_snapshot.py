"""``pw.status()``'s assembly, without a cluster: the resource manager's state, the hosts' counters (None for a
host that did not answer) and each island's scheduler counters become one typed snapshot."""

from __future__ import annotations

from client.profiler import chrome_events
from client.status import HOST_FIELDS, snapshot
from pathways.topology import Topology

TOPOLOGY = Topology(islands=2, hosts_per_island=2, devices_per_host=1)
RESTART = {"island": 1, "reason": "host 1 died", "at": 0.0, "lost": {"alice": [4, 4096]}}


def state() -> dict:
    islands = [{"index": i, "healthy": i == 0, "reason": "" if i == 0 else "host 1 died", "epoch": i,
                "hosts": [{"island": i, "host": h, "node": f"node{h}", "devices": [f"cpu:{h}"], "ip": "10.0.0.1"}
                          for h in range(2)]} for i in range(2)]
    return {"islands": islands, "topology": TOPOLOGY.to_wire(),
            "allocations": [{"tenant": "alice", "key": "s", "shape": [2], "island": 0}],
            "clients": {"c1": {"tenant": "alice"}}, "tenants": {"alice": {"weight": 2.0}},
            "restarts": [RESTART], "others": {"slices": 3, "devices": 6},
            "cluster": {"state": "running"}}


def test_the_snapshot_joins_what_the_manager_hosts_and_schedulers_said():
    stats = [[{"buffers": 3, "queue_depth": 2, "busy_s": 1.5, "not_a_field": 9}, None], [None, None]]
    schedules = [{"queued": 5, "tenant_time_s": {"alice": 3.0}, "others_time_s": 1.0}, None]
    status = snapshot(state(), stats, schedules)
    first, second = status.islands
    assert [h.alive for h in first.hosts] == [True, False] and not any(h.alive for h in second.hosts)
    host = status.host(0, 0)
    assert (host.buffers, host.busy_s, host.node, host.ip) == (3, 1.5, "node0", "10.0.0.1")
    assert not hasattr(host, "not_a_field") and "not_a_field" not in HOST_FIELDS  # only the named counters
    assert first.queue_depth == 5 + 2  # queued at the scheduler, plus the deepest host queue
    assert first.tenant_share == {"alice": 0.75}
    assert not second.healthy and second.reason == "host 1 died" and second.epoch == 1
    assert second.restarts == [RESTART] and first.restarts == []
    assert status.topology == TOPOLOGY and status.state == "running" and status.others == {"slices": 3, "devices": 6}
    text = str(status)
    assert "s(2,)@island0" in text and "lost: alice: 4 buffers" in text and "DEAD" in text
    assert "other tenants: 3 slices, 6 devices" in text


def test_trace_events_become_chrome_events_on_the_clients_clock():
    raw = [("run", "exec", 100.0, 0.5, {"program": "step"}), ("late", "exec", 101.0, -0.001, {})]
    events = chrome_events(raw, pid=3, tid=1, offset=2.0)  # the host's clock runs 2 s ahead
    assert events[0] == {"name": "run", "cat": "exec", "ph": "X", "pid": 3, "tid": 1, "ts": 98.0e6, "dur": 0.5e6,
                         "args": {"program": "step"}}
    assert events[1]["dur"] == 0.0  # a span never has a negative duration in the trace
