"""The `pathways` command, tenants and Ray job submission, end to end, no mocks.

This module starts its own cluster instead of using conftest's embedded one, because `pathways up`
is what it tests: a Ray head started by `ray start --head` with the dashboard (Ray's job API needs
it), and the resource manager and islands as detached actors that outlive the command. To never touch
another engineer's cluster it uses free ports, its own PATHWAYS_HOME (state, admin credential,
tenants' credentials, registry) and Ray temp dir, and `pathways down` must stop exactly the head it
started. Every command runs in a subprocess, through this venv's python by absolute path with a PATH
that lacks the venv (as if it were not activated).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from client import jobs

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("restored_environ")]  # the CLI sets RAY_ADDRESS & co.

JOB_SCRIPT = textwrap.dedent("""
    import shutil, sys
    import numpy as np, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import pathways as pw
    session = pw.init()  # RAY_ADDRESS comes with the job, the ticket with PATHWAYS_TICKET
    s = pw.slice((2,), ("x",))
    x = pw.put(np.arange(8.0, dtype=np.float32), s, P("x"))
    y = pw.jit(lambda v: jnp.sum(v * v), slice=s, in_specs=(P("x"),), out_specs=P())(x)
    print("RESULT", float(y.fetch()), "TENANT", session.tenant, "WEIGHT", session.weight)
    print("EXE", sys.executable, "WHICH", shutil.which("python"))
    pw.shutdown()
    try:  # the same ticket again
        pw.init()
        print("SECOND accepted")
    except pw.PathwaysError as exc:
        print("SECOND", type(exc).__name__, exc)
""")

# Everything Ray's job API shows about every job: the listing, each job's details, and its logs.
JOB_API_DUMP = textwrap.dedent("""
    import json
    from client import jobs
    jobs.enable_token_auth()
    from ray.job_submission import JobSubmissionClient
    client = JobSubmissionClient()
    out = []
    for job in client.list_jobs():
        out.append(job.model_dump())
        if job.submission_id:
            out.append(client.get_job_info(job.submission_id).model_dump())
            out.append(client.get_job_logs(job.submission_id))
    print(json.dumps(out, default=str))
""")



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Ray's workers have their own sessions, but still the raylet as parent)."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
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


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("pathways: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


class Cli:
    """Runs `pathways ...` in a subprocess with this module's private home, no RAY_ADDRESS, and a PATH without
    this venv: the venv's python is called by its absolute path."""

    def __init__(self, home: Path, workdir: Path) -> None:
        venv_bin = os.path.dirname(sys.executable)
        self.env = {k: v for k, v in os.environ.items() if k not in jobs.PRIVATE_ENV}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if p and os.path.abspath(p) != venv_bin) or "/usr/bin:/bin"
        self.env["PATHWAYS_HOME"] = str(home)
        self.home, self.workdir = home, workdir
        self.command = [sys.executable, "-m", "client.cli"]

    def __call__(self, *args: str, timeout: float = 90.0, ok: bool = True,
                 env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.workdir, env={**self.env, **(env or {})})
        if ok:
            assert proc.returncode == 0, f"pathways {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def state(self, home: Path | None = None) -> dict | None:
        path = (home or self.home) / "cluster.json"
        return json.loads(path.read_text()) if path.exists() else None

    def credential(self, tenant: str) -> str:
        return (self.home / "credentials" / tenant).read_text().strip()

    def elsewhere(self, home: Path, **credentials: str) -> dict:
        """The environment of someone else on the same cluster: their own home, holding only ``credentials``."""
        for tenant, secret in credentials.items():
            jobs.write_secret(home / "credentials" / tenant, secret)
        return {"PATHWAYS_HOME": str(home), "RAY_ADDRESS": self.state()["address"]}

    def job_api(self) -> str:
        """Everything Ray's job API shows, as text."""
        proc = subprocess.run([sys.executable, "-c", JOB_API_DUMP], capture_output=True, text=True, timeout=60,
                              env={**self.env, "RAY_ADDRESS": self.state()["address"]})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout


def start_cli(home: Path, workdir: Path) -> Cli:
    """`pathways up` of a one-island cluster on free ports, with its own home."""
    run = Cli(home, workdir)
    port, dashboard = free_port(), free_port()
    run.topology = ["--islands", "1", "--hosts-per-island", "1", "--devices-per-host", "2"]
    t0 = time.monotonic()
    up = run("up", "--port", str(port), "--dashboard-port", str(dashboard), *run.topology, "--timeout", "120",
             timeout=180)
    run.up_s = time.monotonic() - t0
    run.up_out, run.port = up.stdout, port
    return run


def stop_head_of(run: Cli) -> None:
    """Never leave a head behind, whatever a test did to it."""
    state = run.state()
    if state and state["head_pid"]:
        jobs.stop_head(state["head_pid"], state["temp_dir"])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to check which processes `pathways down` stopped")
    workdir = tmp_path_factory.mktemp("job-dir")
    (workdir / "job.py").write_text(JOB_SCRIPT)
    return workdir


@pytest.fixture(scope="module")
def pw_cli(tmp_path_factory, workdir):
    """The cluster the tests of this module share; each test leaves it as it found it: up, with a runtime."""
    run = start_cli(tmp_path_factory.mktemp("pathways-home"), workdir)
    yield run
    stop_head_of(run)


@pytest.fixture(scope="module")
def tenants(pw_cli):
    """alice (weight 2, quota 2 devices) and bob (weight 1), registered by the admin."""
    pw_cli("tenants", "add", "alice", "--weight", "2", "--quota", "2")
    pw_cli("tenants", "add", "bob", "--weight", "1")
    return pw_cli


@pytest.fixture(scope="module")
def alice_job(tenants) -> dict:
    """A job of alice's that runs to its end: what `submit --wait` printed, and right after it, the admin's
    status and everything Ray's job API shows."""
    out = tenants("submit", "--tenant", "alice", "--wait", "--", "python", "job.py", timeout=240).stdout
    return {"out": out, "job": out.split()[1], "status": json.loads(tenants("status", "--json").stdout),
            "shown": tenants.job_api()}


def test_up_creates_the_admin_credential_and_records_the_head(pw_cli):
    state = pw_cli.state()
    assert state["address"].endswith(f":{pw_cli.port}") and alive(state["head_pid"])
    token = pw_cli.home / "admin.token"
    assert mode(token) == 0o600 and mode(pw_cli.home) == 0o700 and len(token.read_text().strip()) >= 40
    assert mode(pw_cli.home / "registry.json") == 0o600  # the head is this machine
    out = pw_cli.up_out
    assert f"admin credential:    {token}" in out and "pathways tenants add NAME --weight W" in out, out
    assert f'pw.init(address="{state["address"]}"' in out and f"RAY_ADDRESS={state['address']}" in out
    assert token.read_text().strip() not in out


def test_a_second_up_is_refused(pw_cli):
    one_line_error(pw_cli("up", "--port", str(free_port()), ok=False), "already runs a cluster")


def test_tenants_commands_need_the_admin_credential(tenants, tmp_path):
    other = tenants.elsewhere(tmp_path, alice=tenants.credential("alice"))
    one_line_error(tenants("tenants", "add", "mallory", "--weight", "9", ok=False, env=other),
                   "needs the cluster's admin credential")
    # a tenant's credential is not the admin's: the resource manager refuses it
    one_line_error(tenants("tenants", "add", "mallory", "--weight", "9", "--admin-credential-file",
                           str(tmp_path / "credentials" / "alice"), ok=False, env=other),
                   "this operation needs the cluster's admin credential")
    assert "mallory" not in tenants("tenants", "list").stdout


def test_tenants_add_list_set_remove(tenants):
    out = tenants("tenants", "add", "carol", "--weight", "3", "--quota", "1").stdout
    path = tenants.home / "credentials" / "carol"
    first = path.read_text().strip()
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert "added tenant carol: weight 3, quota 1" in out and first in out and str(path) in out
    lines = tenants("tenants", "list").stdout.splitlines()
    assert lines[0].split() == ["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES"]
    assert [line.split() for line in lines[1:]] == [["alice", "2", "2", "0", "0"], ["bob", "1", "-", "0", "0"],
                                                    ["carol", "3", "1", "0", "0"]]
    out = tenants("tenants", "set", "carol", "--weight", "5", "--no-quota", "--new-credential").stdout
    second = path.read_text().strip()
    assert "changed tenant carol: weight 5, quota none" in out and second in out and second != first
    out = tenants("tenants", "remove", "carol").stdout
    assert "removed tenant carol" in out and not path.exists()


def test_a_job_runs_as_its_tenant_with_a_ticket(tenants, alice_job):
    """The job gets a ticket (never the credential), runs as alice with the registry's weight, in this venv's
    python although the venv is not on PATH; its second use of the ticket is refused and logged."""
    out, job = alice_job["out"], alice_job["job"]
    assert out.startswith("submitted ") and job.startswith("alice-")
    assert "RESULT 140.0 TENANT alice WEIGHT 2.0" in out and f"job {job} SUCCEEDED" in out, out
    venv_bin = os.path.dirname(sys.executable)
    assert f"EXE {sys.executable} WHICH {venv_bin}{os.sep}python" in out, out
    assert f"SECOND TenantAccessError the ticket of job {job} was already used" in out, out
    st = alice_job["status"]
    assert st["view"] == "admin" and {"alice", "bob"} <= set(st["tenants"])
    assert {"job": job, "by_job": job} in [{k: r[k] for k in ("job", "by_job")} for r in st["refusals"]], st
    shown = alice_job["shown"]
    assert job in shown and "PATHWAYS_TICKET" in shown  # what the job got, in plain view
    for secret in (tenants.credential("alice"), tenants.credential("bob"), (tenants.home / "admin.token").read_text()
                   .strip()):
        assert secret not in shown


def test_stop_and_logs_only_on_your_own_jobs(tenants, alice_job, tmp_path):
    out = tenants("submit", "--tenant", "bob", "--", "python", "-c", "import time; time.sleep(300)").stdout
    job = out.split()[1]
    alice = tenants.elsewhere(tmp_path, alice=tenants.credential("alice"))  # no admin credential, no bob's
    for command in ("stop", "logs"):
        one_line_error(tenants(command, job, ok=False, env=alice), f"job {job} is not yours")
    assert "RESULT 140.0 TENANT alice" in tenants("logs", alice_job["job"], env=alice).stdout
    bob_file = str(tenants.home / "credentials" / "bob")
    out = tenants("stop", job, "--credential-file", bob_file, env=alice, timeout=90).stdout
    assert out.strip() == f"job {job} STOPPED"
    table = tenants("jobs").stdout.splitlines()
    assert table[0].split() == ["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"]
    assert any(line.startswith(job) and " bob " in line and "STOPPED" in line for line in table)


def test_up_joins_only_its_own_admins_runtime_and_a_new_runtime_keeps_the_registry(tenants, tmp_path):
    """`up --address` joins a running runtime only with the admin credential it runs with; `down` of a joined
    cluster removes the runtime but never stops a head it did not start. Then `up` on the head it started,
    whose runtime is gone, starts a new runtime with the same registry: alice still authenticates, with her
    weight (and the cluster is as this test found it)."""
    address, head = tenants.state()["address"], tenants.state()["head_pid"]
    stranger = {"PATHWAYS_HOME": str(tmp_path / "stranger")}
    one_line_error(tenants("up", "--address", address, *tenants.topology, ok=False, env=stranger),
                   "does not take the admin credential")
    admin = tmp_path / "admin"  # the same admin, from another home
    jobs.write_secret(admin / "admin.token", (tenants.home / "admin.token").read_text().strip())
    out = tenants("up", "--address", address, *tenants.topology, env={"PATHWAYS_HOME": str(admin)}).stdout
    assert "(the runtime already ran there)" in out and tenants.state(admin)["head_pid"] is None
    out = tenants("down", env={"PATHWAYS_HOME": str(admin)}).stdout
    assert "removed the resource manager" in out and "left the Ray head" in out, out
    assert alive(head) and tenants.state(admin) is None

    out = tenants("up", *tenants.topology, "--timeout", "120", timeout=180).stdout
    assert "still runs; starting the runtime on it" in out, out
    st = json.loads(tenants("status", "--tenant", "alice", "--json").stdout)
    assert st["view"] == "tenant alice" and "refusals" not in st
    assert list(st["tenants"]) == ["alice"] and st["tenants"]["alice"]["weight"] == 2.0


def test_down_stops_exactly_our_head(tmp_path, workdir):
    """On a head of its own, so that no other test loses its cluster."""
    run = start_cli(tmp_path / "home", workdir)
    try:
        state = run.state()
        ours = descendants(state["head_pid"]) | {state["head_pid"]}
        assert len(ours) > 3  # gcs, raylet, dashboard, workers...
        t0 = time.monotonic()
        out = run("down", timeout=90).stdout
        took = time.monotonic() - t0
        assert "stopped the Ray head" in out and "the tenant registry stays in" in out, out
        assert not [p for p in ours if alive(p)]
        assert run.state() is None and not Path(state["temp_dir"]).exists()
        host, port = state["address"].rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):  # nothing listens on the GCS port any more
            socket.create_connection((host, int(port)), timeout=5).close()
        print(f"up {run.up_s:.1f}s, down {took:.1f}s")
    finally:
        stop_head_of(run)
