"""Tenants are who the cluster's admin says: every attack on another tenant is refused and changes nothing.

Each test plays "mallory", a second tenant with a session of her own, against this session ("default",
the victim): through the public API, and through the runtime's protocol directly with forged, replayed and
misdirected messages, as any process that can reach the runtime's endpoints could.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import answer_to, on_island, raw_connection, tenant_env

import pathways as pw
from client.session import Session
from pathways import wire
from pathways.messages import Free
from pathways.protocol import frames
from pathways.requests import Fetch, HostStats, Ping, Release, ScheduleStats, Stalled, TraceStart, TraceStop

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
def mallory_env(cluster):
    """Mallory's environment, made once (making it again rotates her credential, which ends her sessions)."""
    return tenant_env("mallory")


@pytest.fixture(scope="module")
def mallory(cluster, mallory_env):
    session = Session(cluster.address, "mallory", cluster.timeouts, mallory_env["PATHWAYS_CREDENTIAL"])
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
            pw.init(tenant="default", credential="guessed")
        except pw.TenantAccessError as exc:
            print("refused:", exc)
    """)
    env = {k: v for k, v in tenant_env("mallory").items() if k != "PATHWAYS_CREDENTIAL"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: unknown tenant or wrong credential" in out.stdout, out.stderr[-2000:]
    env["PATHWAYS_WEIGHT"] = "1e12"  # a weight a client claims is never read
    script = "import pathways as pw\ns = pw.init()\nprint(s.tenant, s.weight)\n"
    out = subprocess.run([sys.executable, "-c", script], env={**env, **tenant_env("mallory", weight=0.5)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["mallory", "0.5"], out.stderr[-2000:]


def test_another_sessions_id_cannot_be_claimed_on_any_endpoint(cluster, mallory, victim):
    for where in (None, 0, 1):  # the resource manager, and a host of each island
        with pytest.raises(pw.TenantAccessError, match="unknown or expired session"):
            raw_connection(cluster, where, key=mallory._key, client=cluster.client_id)  # her key, his id
    with pytest.raises(pw.ResourceError, match="you hold no slice"):  # her own session: not her slice
        mallory.request(lambda rid: Release(rid, victim[0].key), "release")
    unchanged(cluster, victim)


def test_admin_operations_need_the_admin_credential(cluster, mallory, mallory_env, victim):
    from client.admin import Admin

    fake = Admin(mallory.rm, mallory_env["PATHWAYS_CREDENTIAL"])
    for op in (lambda: fake.set_tenant(cluster.tenant, quota=0), lambda: fake.set_tenant("mallory", weight=1e6),
               lambda: fake.remove_tenant(cluster.tenant), lambda: fake.mark_island(0, healthy=False),
               lambda: fake.reclaim(tenant=cluster.tenant), lambda: fake.tenants(), lambda: fake.state(),
               lambda: fake.set_tenant("mallory", budgets={"host_bytes": 1 << 40})):
        with pytest.raises(pw.TenantAccessError, match="admin credential"):
            op()
    mallory.island_failed(0, "mallory says so")  # a client's word marks nothing
    time.sleep(1.0)
    assert pw.status().islands[0].healthy and pw.status().islands[0].reason == ""
    mallory.islands.dead.clear()
    unchanged(cluster, victim)


def test_a_fetch_or_free_of_a_guessed_id_is_refused(cluster, mallory, victim):
    s, secret = victim
    conn = raw_connection(mallory, 0)
    answer = answer_to(conn, Fetch(1, secret.id, 5.0, False).encode())
    assert not answer.ok and answer.value[0] == "TenantAccessError" and "not one of your client's" in answer.value[1]
    conn.close()
    mallory.outboxes.put(0, Free((secret.id,)).encode())  # her stream: ids outside her space are dropped
    mallory.flush()
    unchanged(cluster, victim)


def test_a_replayed_or_misdirected_frame_is_refused(cluster, mallory, victim):
    """A frame recorded on one connection is worth nothing on another connection, island or endpoint, and
    nothing twice on its own."""
    s = pw.slice((1,), ("x",), island=0)
    conn = raw_connection(cluster, 0)
    payload = Ping(1).encode()  # any frame of the victim's own, as an eavesdropper records it off the wire
    frame = frames.head(conn._key, frames.TO_SERVER, 1, payload, 0) + payload
    assert answer_to(conn, payload).ok
    for where in (1, None):  # another island's host, the resource manager: fresh connections of mallory's
        other = raw_connection(mallory, where)
        other.sock.sendall(frame)
        with pytest.raises((ConnectionError, OSError)):
            other.recv()  # the endpoint closed it: the MAC is under another connection's key
    conn.sock.sendall(frame)  # the same frame again, on its own connection: an old sequence number
    with pytest.raises((ConnectionError, OSError)):
        conn.recv()
    assert frames.HEAD_BYTES < len(frame)
    s.release()
    unchanged(cluster, victim)


def test_a_program_cannot_name_another_tenants_receive_or_buffer(cluster, mallory_env, victim):
    s, secret = victim
    script = textwrap.dedent(f"""
        import json, numpy as np, pathways as pw
        from client.array import Array
        from jax.sharding import PartitionSpec as P
        session = pw.init(timeouts=pw.Timeouts(fetch=20.0))
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
    proc = subprocess.run([sys.executable, "-c", script], env=mallory_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["read"].startswith("TenantAccessError") and out["compute"].startswith("TenantAccessError"), out
    assert "1.0, 2.0" not in json.dumps(out) and cluster.tenant not in json.dumps(out)
    unchanged(cluster, victim)


def test_traces_and_stalls_show_another_tenants_work_only_as_anonymous_spans(cluster, mallory, victim):
    s, secret = victim

    def ask(request):
        return mallory.ask(0, 0, request).result(timeout=30)

    ask(lambda rid: TraceStart(rid))
    double = pw.jit(lambda v: v * 2.0, slice=s, name="victims_secret_program")
    np.asarray(double(secret))
    events = ask(lambda rid: TraceStop(rid))
    assert events and all(name == "another tenant" and args == {} for name, _, _, _, args in events)
    assert "victims_secret_program" not in json.dumps(events)
    assert ask(lambda rid: Stalled(rid))["runs"] == []
    assert cluster.tenant not in json.dumps(ask(lambda rid: HostStats(rid)))  # counts, not names
    share = ask(lambda rid: ScheduleStats(rid))
    assert set(share["tenant_time_s"]) == {"mallory"} and share["others_time_s"] > 0


def test_a_client_process_needs_no_ray(cluster, mallory_env):
    """The quickstart's calls, in a process where `import ray` fails, against the running cluster."""
    script = textwrap.dedent("""
        import sys
        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is not installed in this client")
        sys.meta_path.insert(0, NoRay())
        import runpy
        runpy.run_path(sys.argv[1], run_name="__main__")
        print("RAY LOADED" if any(m.split(".")[0] == "ray" for m in sys.modules) else "NO RAY")
    """)
    proc = subprocess.run([sys.executable, "-c", script, "examples/quickstart.py"], env=mallory_env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "y = [3. 5.] on island 1" in proc.stdout and proc.stdout.strip().endswith("NO RAY"), proc.stdout[-2000:]


def test_a_ray_driver_reaches_only_methods_that_check_the_runtime_key(cluster):
    """What a process that can reach Ray (an operator's, not a tenant's) finds on the runtime's actors: every
    method it can name refuses a call without the runtime key."""
    script = textwrap.dedent("""
        import json, ray
        from pathways.names import NAMESPACE, RESOURCE_MANAGER
        ray.init(address="auto", namespace=NAMESPACE, logging_level="ERROR")
        rm = ray.get_actor(RESOURCE_MANAGER)
        out = {}
        for name in ("_order", "_forget", "_state", "_watch_islands", "open_session", "admin", "request"):
            out["rm." + name] = hasattr(rm, name)
        try:
            ray.get(rm.ready.remote(b"x" * 32), timeout=30)
            out["rm.ready"] = "answered"
        except Exception as exc:
            out["rm.ready"] = type(exc).__name__
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "RAY_ADDRESS": cluster.embedded.ray_address, "RAY_AUTH_MODE": "token"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(v for k, v in out.items() if k != "rm.ready"), out
    assert "TenantAccessError" in out["rm.ready"], out


def test_the_actors_define_only_the_runtimes_own_calls_and_each_checks_the_runtime_key():
    """Ray exposes every method a class defines: these are the whole surface, and a call without the runtime
    key's MAC for this very host is refused before it touches anything."""
    from resource_manager.actor import ManagerActor
    from resource_manager.host.actor import HostActor
    from resource_manager.host.rows import Landed
    from resource_manager.host.scheduler import Resume

    def methods(cls):
        return {n for n, v in vars(cls).items() if callable(v) and n != "__init__"}

    assert methods(ManagerActor) == {"_check", "ready", "stop"}
    assert methods(HostActor) == {"_check", "coordinator", "start", "control", "health", "stats",
                                  "census", "tenant_schedule", "probe_network", "landed", "enqueue_batch",
                                  "deliver", "probe_direct", "release_lent", "ping", "quiesce", "quiet", "save",
                                  "restore"}
    key = b"k" * 32
    host = HostActor(0, 0, 1, 0, 1.0, 1.0, key, "runtime")
    from pathways import auth

    other_host = auth.sign(key, "health", 1, 0)  # a valid MAC, for island 1's host: misdirected
    calls = [lambda: host.coordinator(b"x" * 32), lambda: host.start(b"x" * 32, None, 2, "cpu"),
             lambda: host.control(wire.encode("release_tenant", {"tenant": "default"}), 1, b"x" * 32),
             lambda: host.health(other_host), lambda: host.stats(b""), lambda: host.census(None),
             lambda: host.tenant_schedule(b"x" * 32), lambda: host.probe_network(b"x" * 32, 1, 0, 10),
             lambda: host.landed(Landed(0, ((1, 2),)), b"x" * 32),
             lambda: host.enqueue_batch([(0, "resume", 1, 0)], b"x"), lambda: host.landed((0, [[1, 2]]), b"x"),
             lambda: host.enqueue_batch([Resume(1, 0)], b"x"),
             lambda: host.deliver(b"meta", b"x" * 32, np.full(4, 666.0)),
             lambda: host.probe_direct(b"x" * 32, "node", 1, 0, b""),
             lambda: host.release_lent(wire.encode("returned", {"leases": [1]}), b"x" * 32),
             lambda: host.ping(b"x" * 32), lambda: host._check("anything", "x")]
    for call in calls:
        with pytest.raises(pw.TenantAccessError, match="runtime's own actors"):
            call()
    assert host._host.parts is None  # nothing was started by any of the refused calls
