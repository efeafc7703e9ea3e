"""A dead island fails its dependents fast, leaves the other islands working, and is restarted (own cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # starts its own cluster

HERE = os.path.dirname(os.path.abspath(__file__))


def run_scenario(hosts: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "island_failure_scenario.py"), str(hosts)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hosts", [1, 2])
def test_a_killed_host_fails_pending_outputs_fast_and_its_island_restarts(hosts):
    r = run_scenario(hosts)
    assert r["z_on_island0"].startswith("IslandFailedError"), r
    assert r["y_on_island1"].startswith("IslandFailedError"), r
    assert r["z_on_island0_s"] < 15 and r["y_on_island1_s"] < 15, r
    assert r["island0_still_works"] == 4.0
    assert r["healthy"] == [True, True] and r["epoch"] == 1, r  # the resource manager restarted it
    (restart,) = r["restarts"]
    assert "host" in restart["reason"] and restart["epoch"] == 1, restart
    assert restart["lost"].get("default", [0])[0] >= 1, restart  # what of ours was lost, counted
    assert r["kept_after_restart"].startswith("IslandFailedError") and "was lost" in r["kept_after_restart"]
    assert r["island1_works_again"] == [2.0] * (2 * hosts)
