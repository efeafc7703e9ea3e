"""Issue 6: the `pathways` command and Ray job submission, end to end, no mocks.

This module starts its own cluster instead of using conftest's embedded one, because `pathways up`
is what it tests: a Ray head started by `ray start --head` with the dashboard (Ray's job API needs
it), and the resource manager and islands as detached actors that outlive the command. To never touch
another engineer's cluster it uses free ports, its own PATHWAYS_HOME (state file) and Ray temp dir,
and `pathways down` must stop exactly the head it started. Everything runs in subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from client import cli, jobs

JOB_SCRIPT = textwrap.dedent("""
    import numpy as np, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import pathways as pw
    session = pw.init()  # RAY_ADDRESS comes with the job, the tenant with PATHWAYS_TENANT
    s = pw.slice((2,), ("x",))
    x = pw.put(np.arange(8.0, dtype=np.float32), s, P("x"))
    y = pw.jit(lambda v: jnp.sum(v * v), slice=s, in_specs=(P("x"),), out_specs=P())(x)
    print("RESULT", float(y.fetch()), "TENANT", session.tenant, "WEIGHT", session.weight)
    pw.shutdown()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Ray's workers have their own sessions, but still the raylet as parent)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


class Cli:
    """Runs `pathways ...` in a subprocess with this module's private state dir and no RAY_ADDRESS."""

    def __init__(self, home: Path, workdir: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        self.env["PATHWAYS_HOME"] = str(home)
        self.workdir = workdir
        script = shutil.which("pathways")
        self.command = [script] if script else [sys.executable, "-m", "client.cli"]

    def __call__(self, *args: str, timeout: float = 60.0, ok: bool = True,
                 env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.workdir, env={**self.env, **(env or {})})
        if ok:
            assert proc.returncode == 0, f"pathways {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def state(self) -> dict | None:
        path = Path(self.env["PATHWAYS_HOME"]) / "cluster.json"
        return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def pw_cli(tmp_path_factory):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to check which processes `pathways down` stopped")
    run = Cli(tmp_path_factory.mktemp("pathways-home"), tmp_path_factory.mktemp("job-dir"))
    port, dashboard = free_port(), free_port()
    t0 = time.monotonic()
    up = run("up", "--port", str(port), "--dashboard-port", str(dashboard), "--islands", "1",
             "--hosts-per-island", "1", "--devices-per-host", "2", "--timeout", "120", timeout=180)
    run.up_s = time.monotonic() - t0
    run.up_out, run.port = up.stdout, port
    yield run
    state = run.state()
    if state and state["head_pid"]:  # a test failed before `down`: never leave our head behind
        jobs.stop_head(state["head_pid"], state["temp_dir"])


def test_up_starts_a_head_and_records_it(pw_cli):
    state = pw_cli.state()
    assert state["address"].endswith(f":{pw_cli.port}") and alive(state["head_pid"])
    assert f'pw.init(address="{state["address"]}")' in pw_cli.up_out
    assert f"RAY_ADDRESS={state['address']}" in pw_cli.up_out and "pathways submit" in pw_cli.up_out
    again = pw_cli("up", "--port", str(free_port()), ok=False)
    assert again.returncode == 1 and "pathways down" in again.stderr


def test_status_reports_islands_hosts_and_health(pw_cli):
    st = json.loads(pw_cli("status", "--json").stdout)
    want = {"islands": 1, "hosts_per_island": 1, "devices_per_host": 2, "platform": "cpu"}
    assert {k: st["topology"][k] for k in want} == want
    (island,) = st["islands"]
    assert island["healthy"] and [h["alive"] for h in island["hosts"]] == [True]
    assert len(island["hosts"][0]["devices"]) == 2 and "queue_depth" in island
    text = pw_cli("status").stdout
    assert "ISLAND" in text and "healthy" in text and ("TENANT" in text or "no tenants" in text)


def test_submit_runs_a_ray_job_as_its_tenant(pw_cli):
    out = pw_cli("submit", "--tenant", "t1", "--weight", "2", "--", "python", "-c", JOB_SCRIPT).stdout
    job = out.split()[1]
    assert out.startswith("submitted ") and job.startswith("t1-")
    deadline = time.monotonic() + 120
    while True:
        (row,) = [r for r in json.loads(pw_cli("jobs", "--json").stdout) if r["id"] == job]
        if row["status"] in ("SUCCEEDED", "FAILED", "STOPPED") or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    logs = pw_cli("logs", job).stdout
    assert row["status"] == "SUCCEEDED", logs
    assert "RESULT 140.0 TENANT t1 WEIGHT 2.0" in logs
    assert row["tenant"] == "t1" and row["start"] and row["end"] >= row["start"]
    table = pw_cli("jobs").stdout
    assert job in table and "SUCCEEDED" in table
    tenants = json.loads(pw_cli("status", "--json").stdout)["tenants"]
    assert tenants["t1"]["weight"] == 2.0


def test_stop_and_bad_input(pw_cli):
    out = pw_cli("submit", "--tenant", "t2", "--", "python", "-c", "import time; time.sleep(300)").stdout
    job = out.split()[1]
    assert pw_cli("stop", job, timeout=90).stdout.strip() == f"job {job} STOPPED"
    for args, words in [(("logs", "no-such-job"), "no job 'no-such-job'"),
                        (("submit", "--tenant", "bad name", "--", "python", "x.py"), "tenant 'bad name'"),
                        (("submit", "--tenant", "t3"), "nothing to run"),
                        (("status", "--address", "http://127.0.0.1:8265"), "looks like a URL")]:
        proc = pw_cli(*args, ok=False)
        assert proc.returncode == 1 and words in proc.stderr, (args, proc.stderr)


def test_down_of_a_joined_cluster_leaves_the_head(pw_cli, tmp_path):
    """`up --address` joins; its `down` removes the islands but must not stop a head it did not start."""
    address, head = pw_cli.state()["address"], pw_cli.state()["head_pid"]
    other = {"PATHWAYS_HOME": str(tmp_path)}
    pw_cli("up", "--address", address, "--islands", "1", "--hosts-per-island", "1", "--devices-per-host", "2",
           env=other)
    assert json.loads((tmp_path / "cluster.json").read_text())["head_pid"] is None
    out = pw_cli("down", env=other).stdout
    assert "removed the resource manager" in out and "left the Ray head" in out, out
    assert alive(head) and not (tmp_path / "cluster.json").exists()


def test_down_stops_exactly_our_head(pw_cli):
    state = pw_cli.state()
    ours = descendants(state["head_pid"]) | {state["head_pid"]}
    assert len(ours) > 3  # gcs, raylet, dashboard, workers...
    t0 = time.monotonic()
    out = pw_cli("down", timeout=90).stdout
    took = time.monotonic() - t0
    assert "stopped the Ray head" in out, out
    assert not [p for p in ours if alive(p)]
    assert pw_cli.state() is None and not Path(state["temp_dir"]).exists()
    host, port = state["address"].rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the GCS port any more
        socket.create_connection((host, int(port)), timeout=5).close()
    print(f"up {pw_cli.up_s:.1f}s, down {took:.1f}s")


def test_address_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with pytest.raises(jobs.CliError, match="pathways up"):
        jobs.resolve_address(None)
    jobs.save_state(jobs.ClusterState("10.0.0.1:1", "http://127.0.0.1:2", None, None, {}, 0.0))
    assert jobs.resolve_address(None) == "10.0.0.1:1" and os.environ["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:2"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:3")
    assert jobs.resolve_address(None) == "10.0.0.2:3"
    assert jobs.resolve_address("10.0.0.3:4") == "10.0.0.3:4" == os.environ["RAY_ADDRESS"]


def test_table_and_bad_arguments():
    assert cli.table(["A", "LONG"], [[1, "x"], ["wide", 2]]).splitlines() == ["A     LONG", "1     x", "wide  2"]
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["submit"])  # --tenant is required
    with pytest.raises(jobs.CliError, match="weight must be positive"):
        jobs.check_tenant("a", 0)
