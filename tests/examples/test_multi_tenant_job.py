"""The multi-tenant example's training job: ``--seconds`` bounds the whole run, from connecting to the last
result, compilation and the final wait included, and the job still keeps the island busy with its work."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from conftest import tenant_env
from suite_paths import ROOT

OVER_S = 1.0  # how far past its budget a run may end (measured: see docs/performance.md)


def run_job(budget: float, *args: str) -> tuple[float, float, int, str]:
    """(seconds the job reports for its run, the process's wall time, steps done, stdout)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "examples/multi_tenant/train.py", "--seconds", str(budget),
                           "--steps", "1000000", *args], env=tenant_env("timed"), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"done: (\d+) steps in ([\d.]+) s \(budget", done.stdout)
    assert found, done.stdout
    return float(found.group(2)), wall, int(found.group(1)), done.stdout


def test_seconds_bounds_the_whole_run(cluster):
    for budget, args in ((6.0, ["--batch", "2048", "--features", "256", "--print-every", "200"]),
                         (6.0, ["--batch", "16384", "--features", "1024", "--print-every", "20"])):
        took, wall, steps, out = run_job(budget, *args)
        print(f"budget {budget} s: run {took:.2f} s, process {wall:.2f} s, {steps} steps")
        assert budget - 1.5 <= took <= budget + OVER_S, out  # it used its time, and stopped in time
        assert steps > 10
