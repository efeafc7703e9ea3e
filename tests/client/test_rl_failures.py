"""``pw.rl`` through failures, in a cluster of its own (tests/support/rl_failure_scenario.py): a sampler island whose
host is killed with steps in flight costs only their rollouts, which are generated again after its restart (the
run ends bitwise as without the kill); a trainer island that dies fails the loop in bounded time, naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import compile_cache_env
from suite_paths import ROOT, SUPPORT, script


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_killed_sampler_costs_its_rollouts_and_a_killed_trainer_fails_clearly():
    path = os.pathsep.join(p for p in (str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, **compile_cache_env())
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, script("rl_failure_scenario.py")], capture_output=True, text=True,
                          timeout=400, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    r = json.loads(lines[-1])
    assert r["events"] == ["sampler_lost", "redone"], r
    assert r["same_metrics"] and r["same_params"], r
    assert r["recovered_s"] < 180, r
    assert "trainer's island 0 failed" in r["trainer_error"] and "restart from a checkpoint" in r["trainer_error"], r
    assert r["trainer_error_s"] < 60, r
