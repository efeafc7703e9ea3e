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

from client import cli, jobs, tables

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

PRIVATE = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "PATHWAYS_TENANT", "PATHWAYS_CREDENTIAL", "PATHWAYS_TICKET")


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
        self.env = {k: v for k, v in os.environ.items() if k not in PRIVATE}
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


@pytest.fixture(scope="module")
def pw_cli(tmp_path_factory):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to check which processes `pathways down` stopped")
    workdir = tmp_path_factory.mktemp("job-dir")
    (workdir / "job.py").write_text(JOB_SCRIPT)
    run = Cli(tmp_path_factory.mktemp("pathways-home"), workdir)
    port, dashboard = free_port(), free_port()
    run.topology = ["--islands", "1", "--hosts-per-island", "1", "--devices-per-host", "2"]
    t0 = time.monotonic()
    up = run("up", "--port", str(port), "--dashboard-port", str(dashboard), *run.topology, "--timeout", "120",
             timeout=180)
    run.up_s = time.monotonic() - t0
    run.up_out, run.port = up.stdout, port
    yield run
    state = run.state()
    if state and state["head_pid"]:  # a test failed before `down`: never leave our head behind
        jobs.stop_head(state["head_pid"], state["temp_dir"])


@pytest.fixture(scope="module")
def tenants(pw_cli):
    """alice (weight 2, quota 2 devices) and bob (weight 1), registered by the admin."""
    pw_cli("tenants", "add", "alice", "--weight", "2", "--quota", "2")
    pw_cli("tenants", "add", "bob", "--weight", "1")
    return pw_cli


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


def test_tenants_add_list_set_remove(tenants):
    out = tenants("tenants", "add", "carol", "--weight", "3", "--quota", "1").stdout
    path = tenants.home / "credentials" / "carol"
    first = path.read_text().strip()
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert "added tenant carol: weight 3, quota 1" in out and first in out and str(path) in out
    lines = tenants("tenants", "list").stdout.splitlines()
    assert lines[0].split() == ["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES"]
    # no "mallory": the non-admin's add was refused
    assert [line.split() for line in lines[1:]] == [["alice", "2", "2", "0", "0"], ["bob", "1", "-", "0", "0"],
                                                    ["carol", "3", "1", "0", "0"]]
    out = tenants("tenants", "set", "carol", "--weight", "5", "--no-quota", "--new-credential").stdout
    second = path.read_text().strip()
    assert "changed tenant carol: weight 5, quota none" in out and second in out and second != first
    out = tenants("tenants", "remove", "carol").stdout
    assert "removed tenant carol" in out and not path.exists()


def test_a_job_runs_as_its_tenant_with_a_ticket(tenants):
    """The job gets a ticket (never the credential), runs as alice with the registry's weight, in this venv's
    python although the venv is not on PATH; its second use of the ticket is refused and logged."""
    out = tenants("submit", "--tenant", "alice", "--wait", "--", "python", "job.py", timeout=240).stdout
    job = out.split()[1]
    assert out.startswith("submitted ") and job.startswith("alice-")
    assert "RESULT 140.0 TENANT alice WEIGHT 2.0" in out and f"job {job} SUCCEEDED" in out, out
    venv_bin = os.path.dirname(sys.executable)
    assert f"EXE {sys.executable} WHICH {venv_bin}{os.sep}python" in out, out
    assert f"SECOND TenantAccessError the ticket of job {job} was already used" in out, out
    tenants.alice_job = job
    st = json.loads(tenants("status", "--json").stdout)
    assert st["view"] == "admin" and {"alice", "bob"} <= set(st["tenants"])
    assert {"job": job, "by_job": job} in [{k: r[k] for k in ("job", "by_job")} for r in st["refusals"]], st
    shown = tenants.job_api()
    assert job in shown and "PATHWAYS_TICKET" in shown  # what the job got, in plain view
    for secret in (tenants.credential("alice"), tenants.credential("bob"), (tenants.home / "admin.token").read_text()
                   .strip()):
        assert secret not in shown


def test_stop_and_logs_only_on_your_own_jobs(tenants, tmp_path):
    out = tenants("submit", "--tenant", "bob", "--", "python", "-c", "import time; time.sleep(300)").stdout
    job = out.split()[1]
    alice = tenants.elsewhere(tmp_path, alice=tenants.credential("alice"))  # no admin credential, no bob's
    for command in ("stop", "logs"):
        one_line_error(tenants(command, job, ok=False, env=alice), f"job {job} is not yours")
    assert "RESULT 140.0 TENANT alice" in tenants("logs", tenants.alice_job, env=alice).stdout
    bob_file = str(tenants.home / "credentials" / "bob")
    out = tenants("stop", job, "--credential-file", bob_file, env=alice, timeout=90).stdout
    assert out.strip() == f"job {job} STOPPED"
    table = tenants("jobs").stdout.splitlines()
    assert table[0].split() == ["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"]
    assert any(line.startswith(job) and " bob " in line and "STOPPED" in line for line in table)


@pytest.mark.parametrize("args, words", [
    (["submit", "--tenant", "bad name", "--", "python", "x.py"], "tenant 'bad name'"),
    (["submit", "--tenant", "t3"], "nothing to run"),
    (["submit", "--tenant", "t3", "--weight", "2", "--", "python", "x.py"], "submit takes no --weight"),
    (["submit", "--tenant", "t3", "--", "python", "x.py"], "no credential for tenant 't3'"),
    (["tenants", "add", "t3", "--weight", "1"], "needs the cluster's admin credential"),
    (["tenants", "add", "t3", "--weight", "0"], "--weight must be a positive number"),
    (["tenants", "set", "t3"], "nothing to change"),
    (["status"], "`pathways status` shows the whole cluster with the admin credential"),
    (["status", "--address", "http://127.0.0.1:8265", "--tenant", "t3"], "looks like a URL"),
    (["up", "--islands", "0"], "Topology.islands must be a positive int"),
    (["up", "--quota", "0"], "--quota must be a positive"),
])
def test_bad_input_is_one_line_error(args, words, capsys, monkeypatch, tmp_path):
    """Refused before anything touches Ray (so run in-process)."""
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", *PRIVATE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("pathways: error: ") and err.count("\n") == 1 and words in err, err


def test_up_joins_only_a_runtime_of_its_own_admin(pw_cli, tmp_path):
    """`up --address` joins a running runtime only with the admin credential it runs with; `down` of a joined
    cluster removes the runtime but never stops a head it did not start."""
    address, head = pw_cli.state()["address"], pw_cli.state()["head_pid"]
    stranger = {"PATHWAYS_HOME": str(tmp_path / "stranger")}
    one_line_error(pw_cli("up", "--address", address, *pw_cli.topology, ok=False, env=stranger),
                   "does not take the admin credential")
    admin = tmp_path / "admin"  # the same admin, from another home
    jobs.write_secret(admin / "admin.token", (pw_cli.home / "admin.token").read_text().strip())
    out = pw_cli("up", "--address", address, *pw_cli.topology, env={"PATHWAYS_HOME": str(admin)}).stdout
    assert "(the runtime already ran there)" in out and pw_cli.state(admin)["head_pid"] is None
    out = pw_cli("down", env={"PATHWAYS_HOME": str(admin)}).stdout
    assert "removed the resource manager" in out and "left the Ray head" in out, out
    assert alive(head) and pw_cli.state(admin) is None


def test_the_registry_outlives_the_runtime(tenants):
    """`up` on the head it started, whose runtime is gone (the test above removed it), starts a new runtime
    with the same registry: alice still authenticates, with her weight."""
    out = tenants("up", *tenants.topology, "--timeout", "120", timeout=180).stdout
    assert "still runs; starting the runtime on it" in out, out
    st = json.loads(tenants("status", "--tenant", "alice", "--json").stdout)
    assert st["view"] == "tenant alice" and "refusals" not in st
    assert list(st["tenants"]) == ["alice"] and st["tenants"]["alice"]["weight"] == 2.0


def test_down_stops_exactly_our_head(pw_cli):
    state = pw_cli.state()
    ours = descendants(state["head_pid"]) | {state["head_pid"]}
    assert len(ours) > 3  # gcs, raylet, dashboard, workers...
    t0 = time.monotonic()
    out = pw_cli("down", timeout=90).stdout
    took = time.monotonic() - t0
    assert "stopped the Ray head" in out and "the tenant registry stays in" in out, out
    assert not [p for p in ours if alive(p)]
    assert pw_cli.state() is None and not Path(state["temp_dir"]).exists()
    host, port = state["address"].rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the GCS port any more
        socket.create_connection((host, int(port)), timeout=5).close()
    print(f"up {pw_cli.up_s:.1f}s, down {took:.1f}s")


# -- no cluster needed -----------------------------------------------------------------------------

def test_status_table():
    from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
    from pathways.topology import Topology

    host = HostStatus(island=0, host=0, node="abcdef0123456789", devices=["cpu:0", "cpu:1"], alive=True,
                      buffers=3, buffer_bytes=3 << 20, queue_depth=1, busy_s=2.5, busy_fraction=0.4)
    island = IslandStatus(0, True, "", [host], queue_depth=4, tenant_time_s={"alice": 1.0, "bob": 3.0})
    st = ClusterStatus(Topology(1, 1, 2), [island], [{"key": "s1", "shape": [2], "axes": ["x"], "island": 0,
                                                       "tenant": "bob", "devices": [[0, 0], [0, 1]]}],
                       tenants={"alice": {"weight": 1.0, "quota": None, "clients": 1, "devices": 0},
                                "bob": {"weight": 3.0, "quota": 2, "clients": 1, "devices": 2}})
    lines = tables.render_status(st, "127.0.0.1:6379", [{"at": 0.0, "job": "a-1", "by_job": "b-2"}]).splitlines()
    assert lines[0].endswith("whole cluster (admin)")
    assert lines[3].split() == ["0", "healthy", "1/1", "2", "4", "alice", "25%", "(1.0s),", "bob", "75%", "(3.0s)"]
    assert lines[6].split() == ["0/0", "abcdef012345", "2", "yes", "3", "(3.0", "MiB)", "0", "0", "1", "0", "2.5s",
                                "(40%)"]
    assert lines[9].split() == ["alice", "1", "-", "1", "0", "-"]
    assert lines[10].split() == ["bob", "3", "2", "1", "2", "s1(2,)@island0"]
    assert "a second use of the ticket of job a-1 (presented by job b-2)" in lines[11]

    mine = IslandStatus(0, True, "", [host], tenant_time_s={"alice": 1.0}, others_time_s=3.0)
    st = ClusterStatus(Topology(1, 1, 2), [mine], [], tenants={"alice": st.tenants["alice"]},
                       others={"slices": 1, "devices": 2, "tenants": 1})
    lines = tables.render_status(st, "127.0.0.1:6379").splitlines()
    assert lines[0].endswith("your tenant's view") and "(others) 75% (3.0s), alice 25% (1.0s)" in lines[3]
    assert lines[-1] == "other tenants: 1, holding 1 slices (2 devices)" and "bob" not in "\n".join(lines)


def test_secrets_are_readable_by_their_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    token, created = jobs.ensure_admin_credential()
    path = tmp_path / "home" / "admin.token"
    assert created and path.read_text().strip() == token and mode(path) == 0o600 and mode(path.parent) == 0o700
    path.chmod(0o644)
    assert jobs.ensure_admin_credential() == (token, False) and mode(path) == 0o600
    monkeypatch.setenv("PATHWAYS_CREDENTIAL", "from-env")
    assert jobs.tenant_credential("alice") == ("from-env", "PATHWAYS_CREDENTIAL")
    monkeypatch.delenv("PATHWAYS_CREDENTIAL")
    assert jobs.tenant_credential("alice") is None
    jobs.write_secret(jobs.credential_path("alice"), "s3cret")
    assert jobs.tenant_credential("alice") == ("s3cret", str(jobs.credential_path("alice")))
    with pytest.raises(jobs.CliError, match="no such file"):
        jobs.tenant_credential("alice", str(tmp_path / "missing"))
    with pytest.raises(jobs.CliError, match="tenant '../admin.token'"):  # a job's metadata names no file
        jobs.credential_path("../admin.token")


def test_a_registry_of_another_admin_is_refused(tmp_path, capsys):
    from pathways.auth import digest

    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"admin": digest("old"), "default_quota": None, "tenants": []}))
    cli._check_registry(str(registry), "old")
    assert capsys.readouterr().out == ""
    cli._check_registry(str(registry), "old", quota=4)  # the registry keeps its own default quota: say so
    assert "keeps the default quota it was created with (none)" in capsys.readouterr().out
    with pytest.raises(jobs.CliError, match="belongs to another admin credential"):
        cli._check_registry(str(registry), "new")
    cli._check_registry(str(tmp_path / "none.json"), "new")


def test_the_job_runs_our_python():
    assert jobs.with_our_python(["python", "x.py"]) == [sys.executable, "x.py"]
    assert jobs.with_our_python(["python3", "-m", "m"]) == [sys.executable, "-m", "m"]
    assert jobs.with_our_python(["/usr/bin/python3", "x.py"]) == ["/usr/bin/python3", "x.py"]
    assert jobs.with_our_python(["bash", "run.sh"]) == ["bash", "run.sh"]


def test_names_agree_with_the_session():
    from client import admin, session

    assert (jobs.TENANT_ENV, jobs.CREDENTIAL_ENV, jobs.TICKET_ENV, jobs.HOME_ENV, jobs.ADMIN_FILE) == \
        (session.TENANT_ENV, session.CREDENTIAL_ENV, session.TICKET_ENV, session.HOME_ENV, admin.ADMIN_FILE)
    assert jobs.home() == session.home() and jobs.credential_path("a") == session.credential_file("a")


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
    assert tables.table(["A", "LONG"], [[1, "x"], ["wide", 2]]).splitlines() == ["A     LONG", "1     x", "wide  2"]
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["submit"])  # --tenant is required
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["tenants", "add", "x"])  # --weight is required
