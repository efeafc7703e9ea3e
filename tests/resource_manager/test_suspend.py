"""Suspend and resume: every tenant's arrays, sessions and executables saved, the islands stopped, and
restored on the same cluster or a new one of the same topology, with attached clients going on.

The shared cluster is suspended and resumed here in place (the other tests' arrays survive that too); the
CLI test runs its own `pathways up` twice, with SIGTERM to the runtime as the preemption notice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import on_island
from jax.sharding import PartitionSpec as P
from pathways_cli import Cli, stop_head_of

import pathways as pw
from pathways.snapshot import MANIFEST, host_part

SUSPEND_S = 30.0


@pytest.fixture
def saved(cluster):
    """Arrays on both islands (one a transfer), their values as the islands hold them, and a program to call."""
    a = pw.slice((4,), ("x",), island=0)
    b = pw.slice((2, 2), ("x", "y"), island=1)
    value = np.random.default_rng(7).standard_normal((256, 512), dtype=np.float32)
    x = pw.put(value, a, P("x"))
    step = pw.jit(lambda v: v * 2 + 1, slice=a, in_specs=P("x"), out_specs=P("x"))
    y = step(x)
    w = pw.transfer(y, b, P("x", "y"))
    ints = pw.put(np.arange(1000, dtype=np.int32), a)  # replicated: one copy per device
    arrays = {"x": x, "y": y, "w": w, "ints": ints}
    held = {name: on_island(arr) for name, arr in arrays.items()}
    yield arrays, held, step
    for s in (a, b):
        s.release()


def test_a_suspended_cluster_resumes_with_every_array_bitwise_and_calls_waiting_go_on(cluster, saved, tmp_path):
    arrays, held, step = saved
    admin = pw.admin()
    directory = tmp_path / "snapshot"
    t0 = time.monotonic()
    done = admin.suspend(str(directory), timeout=SUSPEND_S)
    took = time.monotonic() - t0
    assert done["buffers"] >= 4 and done["bytes"] >= held["x"].nbytes * 3 and done["sessions"] >= 1, done
    assert not done["clients_silent"], done  # this client stopped sending when told to
    assert (directory / MANIFEST).exists() and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in directory.iterdir()), list(directory.iterdir())
    assert pw.status().state == "suspended"

    # A call made now waits for the resume, at most pw.Timeouts.suspend; with a short one it fails clearly.
    impatient = dataclasses.replace(cluster.timeouts, suspend=0.5)
    patient, cluster.timeouts = cluster.timeouts, impatient
    try:
        t1 = time.monotonic()
        with pytest.raises(pw.ClusterSuspendedError, match="suspended by its admin.*pathways resume"):
            step(arrays["x"])
        assert time.monotonic() - t1 < 5
        with pytest.raises(pw.ClusterSuspendedError, match="pathways resume"):
            arrays["w"].fetch()
    finally:
        cluster.timeouts = patient
    waited: dict = {}

    def call_while_suspended() -> None:
        t = time.monotonic()
        try:
            waited["value"] = step(arrays["y"]).fetch(timeout=60)
        except Exception as exc:  # the assertion below shows it
            waited["error"] = exc
        waited["s"] = time.monotonic() - t

    thread = threading.Thread(target=call_while_suspended)
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    back = admin.resume(str(directory), timeout=SUSPEND_S)
    resumed = time.monotonic() - t0
    thread.join(60)
    assert "error" not in waited, waited
    # Every saved buffer is restored, but those of sessions that ended meanwhile (a tenant of an earlier test whose
    # grace ran out while a busy machine resumed): they are counted apart.
    assert back["buffers"] + back["buffers_dropped"] == done["buffers"], (done, back)
    assert back["bytes"] == done["bytes"] or back["buffers_dropped"], (done, back)
    np.testing.assert_array_equal(waited["value"], held["y"] * 2 + 1)
    for name, arr in arrays.items():  # the handles are valid again and the islands hold the same bits
        np.testing.assert_array_equal(on_island(arr), held[name], err_msg=name)
    np.testing.assert_array_equal(np.asarray(arrays["y"]), held["y"])
    np.testing.assert_array_equal(np.asarray(step(arrays["y"])), held["y"] * 2 + 1)
    status = pw.status()
    assert status.state == "running" and all(i.healthy for i in status.islands)
    print(f"suspend {took:.2f}s, resume {resumed:.2f}s, {done['bytes'] / 2**20:.1f} MiB")


def test_an_interrupted_suspend_saves_nothing_and_the_cluster_runs_on(cluster, saved, tmp_path):
    arrays, held, step = saved
    directory = tmp_path / "snapshot"
    directory.mkdir(mode=0o700)
    (directory / host_part(1, 0)[0]).mkdir()  # island 1's host cannot write its part: island 0's is half done
    with pytest.raises(pw.PathwaysError, match="island 1 host 0.*Nothing was saved.*runs on"):
        pw.admin().suspend(str(directory), timeout=SUSPEND_S)
    assert not (directory / MANIFEST).exists() and [p.name for p in directory.iterdir()] == [host_part(1, 0)[0]]
    assert pw.status().state == "running"
    np.testing.assert_array_equal(np.asarray(step(arrays["y"])), held["y"] * 2 + 1)
    with pytest.raises(pw.PathwaysError, match="no finished suspend"):  # and there is nothing to resume from
        pw.admin().resume(str(directory), timeout=SUSPEND_S)
    assert pw.status().state == "running"


def test_a_damaged_snapshot_is_refused_and_the_cluster_stays_suspended_until_a_good_one(cluster, saved, tmp_path):
    arrays, held, step = saved
    admin = pw.admin()
    directory = tmp_path / "snapshot"
    url = f"file://{directory}"  # through fsspec, as s3:// or gs:// would go
    admin.suspend(url, timeout=SUSPEND_S)
    data = directory / host_part(0, 0)[0]
    good = data.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    data.write_bytes(bytes(bad))
    try:
        with pytest.raises(pw.PathwaysError, match="damaged.*Nothing of it is used.*stays suspended"):
            admin.resume(url, timeout=SUSPEND_S)
        assert pw.status().state == "suspended"
    finally:
        data.write_bytes(good)
        admin.resume(url, timeout=SUSPEND_S)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(on_island(arr), held[name], err_msg=name)


CLIENT = textwrap.dedent("""
    import sys, numpy as np, pathways as pw
    from jax.sharding import PartitionSpec as P
    pw.init(tenant="team", timeouts=pw.Timeouts(suspend=240, reattach=240))
    s = pw.slice((2,), ("x",))
    value = np.arange(4096, dtype=np.float32).reshape(64, 64)
    step = pw.jit(lambda v: v * 3 - 1, slice=s, in_specs=P("x"), out_specs=P("x"))
    y = step(pw.put(value, s, P("x")))
    y.block_until_ready()
    print("READY", flush=True)
    sys.stdin.readline()
    same = np.array_equal(np.asarray(y), value * 3 - 1)
    again = np.array_equal(np.asarray(step(y)), (value * 3 - 1) * 3 - 1)
    print("AFTER", same, again, flush=True)
    pw.shutdown()
""")


def _cluster_state(run: Cli) -> dict:
    return json.loads(run("status", "--json").stdout)["cluster"]


@pytest.mark.cluster  # starts its own clusters (`pathways up`); its tenant's jobs would run as a user named here,
@pytest.mark.own_cluster  # so the runtime makes no OS user and the test may run beside the session cluster's
def test_sigterm_suspends_and_a_new_cluster_resumes_where_the_attached_client_goes_on(tmp_path):
    """The preemption path: SIGTERM to the runtime of `pathways up --suspend-dir`, `pathways down`, a new
    `pathways up` on the same address, `pathways resume`: a client attached all along goes on."""
    run = Cli(tmp_path / "home", tmp_path, tmp_path / "tmp")
    keep = tmp_path / "suspended"
    client = None
    try:
        run.up("--suspend-dir", str(keep))
        run("tenants", "add", "team", "--weight", "1", "--job-user", "nobody")
        client = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=run.env)
        assert client.stdout.readline().strip() == "READY", client.stderr.read()[-3000:]
        os.kill(_cluster_state(run)["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (state := _cluster_state(run))["state"] != "suspended" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state["state"] == "suspended" and Path(state["suspended_to"]).parent == keep, state
        assert (Path(state["suspended_to"]) / MANIFEST).exists()
        run("down", timeout=90)
        run.up("--suspend-dir", str(keep))
        out = run("resume").stdout
        assert f"resumed from {state['suspended_to']}" in out and "of 1 sessions" in out, out
        client.stdin.write("go\n")
        client.stdin.flush()
        after, errors = client.communicate(timeout=120)
        assert "AFTER True True" in after, after + errors[-3000:]
        assert client.returncode == 0, errors[-3000:]
        run("down", timeout=90)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        stop_head_of(run)
