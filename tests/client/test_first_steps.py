"""First steps as a Ray user takes them: a script that knows a Ray cluster only from ``RAY_ADDRESS`` (as inside
``ray job submit``) gets a runtime of its own on that cluster, spread over its nodes and gone when the script
ends; a ``RAY_ADDRESS`` that names no running cluster, or a Ray address given as the runtime's, fails at once
saying what to do. (A bare ``pw.init()`` after ``pathways up``, and ``down`` with nothing to stop: test_cli.py and
test_cli_local.py.)

The unit tests here start nothing; the two-node test runs tests/support/ray_job_scenario.py in its own process, on a
``ray.cluster_utils.Cluster`` of its own (one cluster start).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from suite_paths import script

import pathways as pw
from client import runtime

PROMPT_S = runtime.CONNECT_TIMEOUT_S + 2.0  # "at once": the connect timeout, and a busy machine's slack


def serving(opening: bytes):
    """A TCP port where something accepts connections and sends ``opening``; yields its address."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(opening)
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)  # what the client sends, before the connection closes
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    server.close()


@pytest.fixture
def listening():
    """Something that accepts connections and is neither a runtime nor Ray: it says hello."""
    yield from serving(b"hello, this is neither pathways nor Ray")


@pytest.fixture
def grpc_server():
    """What a gRPC server (Ray's GCS) opens with: an empty HTTP/2 SETTINGS frame."""
    yield from serving(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))


@pytest.fixture
def no_session(monkeypatch):
    """pw.init as in a fresh process: the session a cluster test of this run may hold is set aside meanwhile (each
    pw.init here fails before it opens one)."""
    import client.session

    monkeypatch.setattr(client.session, "_session", None)


@pytest.fixture
def refused():
    """A port bound but not listening: a connection there is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_ray_address_names_the_cluster_or_fails_at_once(monkeypatch, tmp_path, grpc_server, listening, refused):
    """(A real GCS is recognized in the two-node test below: its clients would fail otherwise.)"""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert runtime.ray_cluster() is None
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's word for a new local cluster
    assert runtime.ray_cluster() is None
    monkeypatch.setenv("RAY_ADDRESS", grpc_server)
    assert runtime.ray_cluster() == grpc_server
    for value, words in [("ray://10.0.0.1:10001", "not through Ray Client"), ("http://127.0.0.1:8265", "dashboard"),
                         ("head-node", "is not a Ray address")]:
        monkeypatch.setenv("RAY_ADDRESS", value)
        with pytest.raises(pw.PathwaysError, match=words):
            runtime.ray_cluster()
    for dead in (refused, listening):  # nothing listens; something that is not Ray
        monkeypatch.setenv("RAY_ADDRESS", dead)
        t0 = time.monotonic()
        with pytest.raises(pw.ResourceError, match=f"RAY_ADDRESS={dead} names no running Ray cluster"):
            runtime.ray_cluster()
        assert time.monotonic() - t0 < PROMPT_S
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # Ray's: the cluster `ray start` last started on this machine
    with pytest.raises(pw.ResourceError, match="names no Ray cluster started on this machine"):
        runtime.ray_cluster()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(grpc_server + "\n")
    assert runtime.ray_cluster() == grpc_server
    (tmp_path / "ray" / "ray_current_cluster").write_text(refused + "\n")  # a cluster that died without `ray stop`
    with pytest.raises(pw.ResourceError, match=f"says {refused}\\) names no running Ray cluster"):
        runtime.ray_cluster()


def test_the_launcher_gives_up_on_a_ray_cluster_that_does_not_take_it_in_bounded_time(grpc_server):
    """Something that answers as a gRPC server but never as Ray's GCS (as a proxy in the way may): Ray would retry
    for minutes; the launcher answers why within its start timeout. Attaching starts no Ray of its own."""
    options = {"ray_address": grpc_server, "start_timeout": 5.0}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "resource_manager.launch", "private"], capture_output=True,
                          input=json.dumps(options) + "\n", text=True, timeout=120)
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and answer["kind"] == "ResourceError", (proc.stdout, proc.stderr[-2000:])
    assert answer["error"].startswith(f"could not attach to the Ray cluster at {grpc_server} within 5s"), answer
    assert time.monotonic() - t0 < 60


def test_pw_init_with_a_dead_ray_address_fails_at_once_and_starts_nothing(monkeypatch, refused, no_session):
    """Here a runtime that started anyway would fail the test: the unit tier refuses to start one."""
    monkeypatch.setenv("RAY_ADDRESS", refused)
    for topology in (pw.Topology(1, 1, 1), None):
        t0 = time.monotonic()
        with pytest.raises(pw.ResourceError, match="names no running Ray cluster"):
            pw.init(topology=topology)
        assert time.monotonic() - t0 < PROMPT_S


def test_a_ray_address_given_as_the_runtimes_says_what_to_do(listening, no_session):
    for address, kw in [("ray://127.0.0.1:10001", {}), ("auto", {}), (listening, {}),
                        (listening, {"credential": "s3cret"})]:
        t0 = time.monotonic()
        with pytest.raises(pw.PathwaysError) as info:
            pw.init(address=address, **kw)
        text = str(info.value)
        assert not isinstance(info.value, pw.TenantAccessError) and "not a Ray cluster's" in text, text
        assert "set RAY_ADDRESS to its HOST:PORT" in text and "pw.init(topology=...) without an address" in text
        assert time.monotonic() - t0 < PROMPT_S


@pytest.fixture(scope="module")
def ray_job():
    """What tests/support/ray_job_scenario.py saw on its two-node cluster."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, script("ray_job_scenario.py")], capture_output=True, text=True,
                          timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the scenario failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_inside_a_ray_job_pw_init_starts_a_runtime_of_its_own_over_the_clusters_nodes(ray_job):
    r = ray_job
    a, b, nodes = r["a"], r["b"], r["cluster"]["nodes"]
    assert len(nodes) == 2, r["cluster"]
    assert sorted(h for hosts in a["nodes"] for h in hosts) == nodes, a  # one island on each node, as `up` spreads
    assert a["z"] == [1.0, 3.0, 5.0, 7.0] and b["z"] == [1.0, 3.0, 5.0, 7.0]  # island 0 -> island 1 across nodes
    assert a["tenant"] == b["tenant"] == "default"
    assert a["ray_imported"] == [] and b["ray_imported"] == [], (a, b)  # the launcher is the Ray driver
    shared = r["shared"]["actor"]
    assert shared == "resource_manager" and len({a["actor"], b["actor"], shared}) == 3
    assert r["names_while_running"] == sorted([shared, a["actor"], b["actor"]])
    assert r["while_running"] == {"actors": {"ManagerActor": 3, "HostActor": 4}, "groups": 4}, r["while_running"]


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_ray_jobs_runtime_is_gone_when_its_client_ends_or_dies(ray_job):
    """Client A was killed (SIGKILL), client B ended as a script does: their resource managers, hosts and
    placement groups are gone, their launchers have exited, and `pathways up`'s runtime on the cluster stays."""
    r = ray_job
    assert r["b_exit"] == 0
    assert r["after"] == r["shared"]["before"] == {"actors": {"ManagerActor": 1, "HostActor": 1}, "groups": 1}, r
    assert r["names_after"] == ["resource_manager"] and r["launchers_left"] == [], r
    print(f"runtimes started in {r['started_s']}s; gone {r['gone_s']}s after their clients ended")


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_ray_clusters_own_address_given_as_the_runtimes_says_what_to_do(ray_job):
    for key in ("ray_address_given", "ray_address_given_with_credential"):
        seen = ray_job[key]
        assert seen["error"] and "not a Ray cluster's" in seen["error"], seen
        assert "TenantAccessError" not in seen["error"] and seen["seconds"] < 15, seen
