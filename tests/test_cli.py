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


@pytest.fixture(autouse=True)
def _restore_environ():
    """The CLI sets RAY_ADDRESS & co. in its own process; in-process tests must not leak them to others."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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



def test_a_second_up_is_refused(pw_cli, monkeypatch, capsys):
    monkeypatch.setenv("PATHWAYS_HOME", pw_cli.env["PATHWAYS_HOME"])
    assert cli.main(["up", "--port", str(free_port())]) == 1
    assert "already runs a cluster" in capsys.readouterr().err


def test_status_reports_islands_hosts_and_health(pw_cli):
    st = json.loads(pw_cli("status", "--json").stdout)
    want = {"islands": 1, "hosts_per_island": 1, "devices_per_host": 2, "platform": "cpu"}
    assert {k: st["topology"][k] for k in want} == want
    (island,) = st["islands"]
    assert island["healthy"] and [h["alive"] for h in island["hosts"]] == [True]
    assert len(island["hosts"][0]["devices"]) == 2 and "queue_depth" in island and "tenants" in st


def test_submit_runs_a_ray_job_as_its_tenant(pw_cli):
    out = pw_cli("submit", "--tenant", "t1", "--weight", "2", "--wait", "--", "python", "-c", JOB_SCRIPT,
                 timeout=150).stdout
    job = out.split()[1]
    assert out.startswith("submitted ") and job.startswith("t1-")
    assert "RESULT 140.0 TENANT t1 WEIGHT 2.0" in out and f"job {job} SUCCEEDED" in out, out
    assert "RESULT 140.0 TENANT t1 WEIGHT 2.0" in pw_cli("logs", job).stdout
    (row,) = [r for r in json.loads(pw_cli("jobs", "--json").stdout) if r["id"] == job]
    assert row["tenant"] == "t1" and row["status"] == "SUCCEEDED" and row["end"] >= row["start"] > 0
    # the job's client has gone, so the manager no longer lists the tenant (nothing left to show)
    assert "t1" not in json.loads(pw_cli("status", "--json").stdout)["tenants"]


def test_stop_and_jobs_table(pw_cli):
    out = pw_cli("submit", "--tenant", "t2", "--", "python", "-c", "import time; time.sleep(300)").stdout
    job = out.split()[1]
    assert pw_cli("stop", job, timeout=90).stdout.strip() == f"job {job} STOPPED"
    table = pw_cli("jobs").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "TENANT", "WEIGHT", "STATUS"]
    assert any(line.startswith(job) and " t2 " in line and "STOPPED" in line for line in table)
    proc = pw_cli("logs", "no-such-job", ok=False)
    assert proc.returncode == 1 and "no job 'no-such-job'" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["submit", "--tenant", "bad name", "--", "python", "x.py"], "tenant 'bad name'"),
    (["submit", "--tenant", "t3"], "nothing to run"),
    (["submit", "--tenant", "t3", "--weight", "-1", "--", "python", "x.py"], "weight must be positive"),
    (["status", "--address", "http://127.0.0.1:8265"], "looks like a URL"),
    (["up", "--islands", "0"], "Topology.islands must be a positive int"),
    (["up", "--quota", "0"], "--quota must be a positive"),
])
def test_bad_input_is_one_line_error(args, words, capsys, monkeypatch, tmp_path):
    """Refused before anything touches Ray (so run in-process)."""
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("pathways: error: ") and words in err and "Traceback" not in err


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


def test_status_table():
    from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
    from pathways.topology import Topology

    host = HostStatus(island=0, host=0, node="abcdef0123456789", devices=["cpu:0", "cpu:1"], alive=True,
                      buffers=3, buffer_bytes=3 << 20, queue_depth=1, busy_s=2.5, busy_fraction=0.4)
    island = IslandStatus(0, True, "", [host], queue_depth=4, tenant_time_s={"alice": 1.0, "bob": 3.0})
    st = ClusterStatus(Topology(1, 1, 2), [island], [{"key": "s1", "shape": [2], "axes": ["x"], "island": 0,
                                                       "tenant": "bob", "devices": [[0, 0], [0, 1]]}],
                       tenants={"alice": {"weight": 1.0, "quota": None, "clients": 1, "devices": 0},
                                "bob": {"weight": 3.0, "quota": 2, "clients": 1, "devices": 2},
                                cli.CLI_TENANT: {"weight": 1.0, "quota": None, "clients": 1, "devices": 0}})
    lines = cli.render_status(st, "127.0.0.1:6379").splitlines()
    assert lines[3].split() == ["0", "healthy", "1/1", "2", "4", "alice", "25%", "(1.0s),", "bob", "75%", "(3.0s)"]
    assert lines[6].split() == ["0/0", "abcdef012345", "2", "yes", "3", "(3.0", "MiB)", "0", "0", "1", "0", "2.5s",
                                "(40%)"]
    assert lines[9].split() == ["alice", "1.0", "-", "1", "0", "-"]
    assert lines[10].split() == ["bob", "3.0", "2", "1", "2", "s1(2,)@island0"]
    assert not any(cli.CLI_TENANT in line for line in lines)


def test_address_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with pytest.raises(jobs.CliError, match="pathways up"):
        jobs.resolve_address(None)
    jobs.save_state(jobs.ClusterState("127.0.0.1:1", "http://127.0.0.1:2", None, None, {}, 0.0))
    assert jobs.resolve_address(None) == "127.0.0.1:1" and os.environ["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:2"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.2:3")
    assert jobs.resolve_address(None) == "127.0.0.2:3"
    assert jobs.resolve_address("127.0.0.3:4") == "127.0.0.3:4" == os.environ["RAY_ADDRESS"]


def test_format_and_required_arguments():
    assert cli.table(["A", "LONG"], [[1, "x"], ["wide", 2]]).splitlines() == ["A     LONG", "1     x", "wide  2"]
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["submit"])  # --tenant is required
