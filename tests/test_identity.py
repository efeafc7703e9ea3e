"""Tenants are who the cluster's admin says: every attack on another tenant is refused and changes nothing.

Each test plays "mallory", a second tenant with a session of her own, against this session ("default",
the victim): through the public API, and by calling the runtime's actors directly with forged messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import ray
from conftest import on_island, tenant_env

import pathways as pw
from client.session import Session
from pathways import wire
from pathways.messages import Deliver, Fetch, Free

SECRET = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


@pytest.fixture(scope="module")
def victim(cluster):
    """The victim's slice and secret array, and what they must still be after every attack."""
    s = pw.slice((2,), ("x",), island=0)
    secret = pw.put(SECRET, s)
    secret.block_until_ready()
    yield s, secret
    np.testing.assert_array_equal(np.asarray(pw.put(SECRET, s)), SECRET)
    s.release()


@pytest.fixture(scope="module")
def mallory(cluster):
    session = Session(cluster.rm, "mallory", cluster.timeouts, False, tenant_env("mallory")["PATHWAYS_CREDENTIAL"])
    yield session
    session.close()


def unchanged(cluster, victim) -> None:
    s, secret = victim
    np.testing.assert_array_equal(on_island(secret), SECRET)
    assert s.key in {a["key"] for a in pw.status().allocations}
    assert pw.admin().state()["tenants"][cluster.tenant]["weight"] == 1.0


def test_a_client_cannot_claim_a_tenant_without_its_credential(cluster):
    script = textwrap.dedent("""
        import pathways as pw
        try:
            pw.init(address="auto", tenant="default", credential="guessed")
        except pw.TenantAccessError as exc:
            print("refused:", exc)
    """)
    env = {k: v for k, v in tenant_env("mallory").items() if k != "PATHWAYS_CREDENTIAL"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: unknown tenant or wrong credential" in out.stdout, out.stderr[-2000:]
    env["PATHWAYS_WEIGHT"] = "1e12"  # a weight a client claims is never read
    script = "import pathways as pw\ns = pw.init(address='auto')\nprint(s.tenant, s.weight)\n"
    out = subprocess.run([sys.executable, "-c", script], env={**env, **tenant_env("mallory", weight=0.5)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["mallory", "0.5"], out.stderr[-2000:]


def test_requests_signed_with_another_key_are_refused(cluster, mallory, victim):
    s, secret = victim
    rm = cluster.rm
    for kind, body in (("release", {"slice": s.key}), ("close", {}), ("state", {}),
                       ("allocate", {"shape": [1], "axes": ["x"], "island": 0})):
        payload = wire.encode(kind, body)
        forged = mallory.sign("rm", payload)  # signed by mallory, claiming the victim's client id
        reply = wire.decode(ray.get(rm.request.remote(cluster.client_id, payload, forged), timeout=30), "reply")
        assert not reply["ok"] and reply["value"][0] == "TenantAccessError", reply
        assert cluster.tenant not in reply["value"][1]
    with pytest.raises(pw.ResourceError, match="you hold no slice"):  # her own session: not her slice
        mallory.request("release", {"slice": s.key})
    unchanged(cluster, victim)


def test_admin_operations_need_the_admin_credential(cluster, mallory, victim):
    from client.admin import Admin

    fake = Admin(cluster.rm, tenant_env("mallory")["PATHWAYS_CREDENTIAL"])
    for op in (lambda: fake.set_tenant(cluster.tenant, quota=0), lambda: fake.set_tenant("mallory", weight=1e6),
               lambda: fake.remove_tenant(cluster.tenant), lambda: fake.mark_island(0, healthy=False),
               lambda: fake.reclaim(tenant=cluster.tenant), lambda: fake.tenants(), lambda: fake.state()):
        with pytest.raises(pw.TenantAccessError, match="admin credential"):
            op()
    mallory.request("suspect", {"island": 0, "reason": "mallory says so"})  # a client's word marks nothing
    assert pw.status().islands[0].healthy and pw.status().islands[0].reason == ""
    unchanged(cluster, victim)


def test_a_forged_fetch_or_free_of_a_guessed_id_is_refused(cluster, mallory, victim):
    s, secret = victim
    host = cluster.islands[0].hosts[0]
    fetch = Fetch(secret.id, 5.0, False).encode()
    with pytest.raises(pw.TenantAccessError, match="not signed by a session"):  # the victim's id, mallory's key
        ray.get(host.fetch.remote(cluster.client_id, fetch, mallory.sign("fetch", fetch)), timeout=30)
    with pytest.raises(pw.TenantAccessError, match="not one of your client's buffers"):  # her own session
        ray.get(host.fetch.remote(mallory.client_id, fetch, mallory.sign("fetch", fetch)), timeout=30)
    mallory.outboxes.put(0, Free((secret.id,)).encode(), None)  # her stream: ids outside her space are dropped
    mallory.flush()
    free = Free((secret.id,)).encode()
    with pytest.raises(pw.TenantAccessError, match="not signed by a session"):  # her message on the victim's stream
        ray.get(host.submit_batch.remote(cluster.client_id, 10**6, [(free, [])],
                                         mallory.sign("submit", 10**6, free)), timeout=30)
    unchanged(cluster, victim)


def test_the_runtimes_own_methods_refuse_every_client(cluster, mallory, victim):
    """Deliveries into a receive, orders of the resource manager, host 0's order: runtime key only."""
    s, secret = victim
    host = cluster.islands[0].hosts[0]
    deliver = Deliver(secret.id + 1, 1, 0, (((0, 4),),)).encode()  # pre-sending into the victim's next receive
    for call in (lambda: host.deliver.remote(deliver, mallory.sign("deliver", deliver), np.full(4, 666.0)),
                 lambda: host.control.remote(wire.encode("release_tenant", {"tenant": cluster.tenant}), b"x" * 32),
                 lambda: host.control.remote(wire.encode("weight", {"tenant": "mallory", "weight": 1e6}), b"x" * 32),
                 lambda: host.enqueue_batch.remote([(0, "resume", 1, 0)], b"x" * 32),
                 lambda: host.release_lent.remote(wire.encode("returned", {"leases": [1]}), b"x" * 32),
                 lambda: host.probe_direct.remote(b"x" * 32, "node", os.getpid(), 0, b"")):
        with pytest.raises(pw.TenantAccessError, match="runtime's own actors"):
            ray.get(call(), timeout=30)
    unchanged(cluster, victim)


def test_a_program_cannot_name_another_tenants_receive_or_buffer(cluster, victim):
    s, secret = victim
    script = textwrap.dedent(f"""
        import json, numpy as np, pathways as pw
        from client.array import Array
        from jax.sharding import PartitionSpec as P
        session = pw.init(address="auto", timeouts=pw.Timeouts(fetch=20.0))
        mine = pw.slice((2,), ("x",), island=0)
        forged = Array(session, {secret.id}, (4,), np.float32, mine, P(), frozenset({{0}}))
        out = {{}}
        for name, fn in (("read", lambda: forged.fetch()),
                         ("compute", lambda: pw.jit(lambda v: v * 2, slice=mine)(forged).fetch())):
            try:
                out[name] = repr(fn())
            except pw.PathwaysError as exc:
                out[name] = type(exc).__name__ + ": " + str(exc)
        print(json.dumps(out))
        pw.shutdown()
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=tenant_env("mallory"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["read"].startswith("TenantAccessError") and out["compute"].startswith("TenantAccessError"), out
    assert "1.0, 2.0" not in json.dumps(out) and cluster.tenant not in json.dumps(out)
    unchanged(cluster, victim)


def test_traces_and_stalls_show_another_tenants_work_only_as_anonymous_spans(cluster, mallory, victim):
    s, secret = victim
    host = cluster.islands[0].hosts[0]
    ray.get(host.trace_start.remote(mallory.client_id, mallory.sign("trace_start")), timeout=30)
    double = pw.jit(lambda v: v * 2.0, slice=s, name="victims_secret_program")
    np.asarray(double(secret))
    events = ray.get(host.trace_stop.remote(mallory.client_id, mallory.sign("trace_stop")), timeout=30)
    assert events and all(name == "another tenant" and args == {} for name, _, _, _, args in events)
    assert "victims_secret_program" not in json.dumps(events)
    report = ray.get(host.stalled.remote(mallory.client_id, mallory.sign("stalled")), timeout=30)
    assert report["runs"] == []
    stats = ray.get(host.stats.remote(), timeout=30)
    assert cluster.tenant not in json.dumps(stats)  # counts, not names
    share = ray.get(host.schedule_stats.remote(mallory.client_id, mallory.sign("schedule_stats")), timeout=30)
    assert set(share["tenant_time_s"]) == {"mallory"} and share["others_time_s"] > 0
