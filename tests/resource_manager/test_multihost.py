"""Islands of several hosts (a jax.distributed group each), placement, gang scheduling under
concurrency. The multi-host cluster runs in a daemon process so the shared session cluster is untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_spmd_checks, await_line
from suite_paths import script

pytestmark = [pytest.mark.cluster, pytest.mark.own_cluster]  # starts its own cluster



@pytest.fixture(scope="module")
def multihost():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_")}
    daemon = subprocess.Popen([sys.executable, script("cluster_daemon.py"), "2", "2", "2", *TENANTS],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = daemon.stdout.readline()
    if not line:
        daemon.kill()
        pytest.fail(f"the multi-host cluster did not start: {daemon.stderr.read()[-3000:]}")
    yield json.loads(line)
    daemon.stdin.close()
    daemon.wait(timeout=60)


TENANTS = ("checker", "a", "b", "tracer", "forward", "backward", "long")


def client(cluster: dict, tenant: str, *args: str) -> subprocess.Popen:
    """A client process of ``tenant`` on the multi-host cluster (running ``multihost_client.py args``)."""
    env = dict(os.environ, PATHWAYS_ADDRESS=cluster["address"], PATHWAYS_TENANT=tenant,
               PATHWAYS_CREDENTIAL=cluster["credentials"][tenant])
    return subprocess.Popen([sys.executable, script("multihost_client.py"), *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_spmd_across_hosts_placement_and_transfers(multihost):
    assert_spmd_checks(result(client(multihost, "checker", "spmd")))


def test_two_clients_interleave_collectives_on_one_island(multihost):
    procs = [client(multihost, tenant, "gang", "220") for tenant in ("a", "b")]
    for r in [result(p) for p in procs]:
        assert r["programs"] == 220
        np.testing.assert_allclose(r["final"]["got"], r["final"]["want"], rtol=1e-4, atol=1e-5, err_msg=r["tenant"])


def test_a_long_program_runs_in_parts_between_another_clients_collectives(multihost, tmp_path):
    """A program of 700 computations with cross-host collectives runs in parts (a first part of 256 ops, then parts
    sized by its measured cost), each part a place of its own in the island's order, the same on both hosts, while
    another tenant's programs of collectives take places between the parts: no deadlock, and both compute what
    numpy does."""
    procs = [client(multihost, "long", "long", "700", str(tmp_path / "trace.json")),
             client(multihost, "b", "gang", "150")]
    long, gang = [result(p) for p in procs]
    assert long["programs"] == 3 and gang["programs"] == 150
    host0, host1 = long["parts"]
    assert len(host0) >= 3 * 3 and host0 == host1, long["parts"]  # three calls, each in three parts or more
    for got in long["got"]:
        np.testing.assert_allclose(got, long["want"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gang["final"]["got"], gang["final"]["want"], rtol=1e-4, atol=1e-5)


def test_trace_shows_the_same_order_on_every_host(multihost, tmp_path):
    r = result(client(multihost, "tracer", "trace", str(tmp_path / "trace.json")))
    host0, host1 = r["orders"]
    assert len(host0) == 20 and host0 == host1, r


def test_two_clients_exchanging_data_in_opposite_directions_never_deadlock(multihost):
    """Each client's programs move data island 0 -> 1 -> 0 (or 1 -> 0 -> 1) with cross-host collectives on both
    sides, many at once: each island's order puts one client's receive before the other's send, and only
    receives that park off the order keep the two islands from waiting on each other for ever."""
    procs = [client(multihost, direction, "exchange", direction, "30", "300") for direction in ("forward", "backward")]
    for p in procs:  # both compiled everywhere: they race from the same instant on
        await_line(p, "READY", timeout=300)
    start_at = f"{time.time() + 0.2}\n"
    for p in procs:
        p.stdin.write(start_at)
        p.stdin.flush()
    for r in [result(p, timeout=400) for p in procs]:
        assert r["programs"] == 30 and len(r["got"]) == 30
        np.testing.assert_allclose(r["got"], r["want"], rtol=1e-4, atol=1e-5, err_msg=r["direction"])
