"""A dead island fails its dependents fast, leaves the other islands working, and is restarted (own cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from suite_paths import script

pytestmark = [pytest.mark.cluster, pytest.mark.own_cluster]  # starts its own cluster



class Scenario:
    """island_failure_scenario.py for islands of ``hosts`` hosts, started at once in its own process and cluster;
    its output goes to files, so that it never waits on a pipe nobody reads yet."""

    def __init__(self, hosts: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_")}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, script("island_failure_scenario.py"), str(hosts)],
                                     env=env, stdout=self.out, stderr=self.err, text=True)

    def result(self) -> dict:
        try:
            self.proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        assert self.proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def scenarios():
    """Both scenarios (islands of 1 and of 2 hosts) run at once, in two clusters: each mostly waits (for its host's
    death to be noticed, its island to restart), and its bounds (15 s to fail, 180 s to restart) are far above what
    it takes beside the other (0.1 s, 2 s)."""
    runs = {hosts: Scenario(hosts) for hosts in (1, 2)}
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.parametrize("hosts", [1, 2])
def test_a_killed_host_fails_pending_outputs_fast_and_its_island_restarts(scenarios, hosts):
    r = scenarios[hosts].result()
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
