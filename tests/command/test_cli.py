"""The `pathways` command, an admin's and a tenant's day, end to end, no mocks.

This module starts its own clusters instead of using conftest's embedded one, because `pathways up` is what
it tests: a Ray head started by `ray start --head`, and the runtime as detached actors that outlive the
command. To never touch another engineer's cluster it uses free ports, its own PATHWAYS_HOME (state, admin
credential, tenants' credentials, registry) and PATHWAYS_TMPDIR, and `pathways down` must stop exactly the
head it started. Every command runs in a subprocess, through this venv's python by absolute path with a PATH
that lacks the venv (as if it were not activated). The tenant works from a home of its own, as on its own
machine: what `pathways tenants add` printed is all it gets. Where the suite runs as root (as here and in CI), each
tenant's jobs run as an OS user the runtime made for it, and hostile jobs try to reach another tenant's job, the
runtime's secrets and Ray.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import await_line
from job_users_env import denied, is_root, job_users_machine, probe, registry_users
from pathways_cli import Cli, head_processes, mode, stop_head_of
from suite_paths import ROOT, script

from command import head

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("restored_environ")]

JOB_SCRIPT = textwrap.dedent("""
    import os, shutil, sys
    import numpy as np, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import pathways as pw
    session = pw.init()  # the runtime's address comes with the job, the ticket through a pipe
    s = pw.slice((2,), ("x",))
    x = pw.put(np.arange(8.0, dtype=np.float32), s, P("x"))
    y = pw.jit(lambda v: jnp.sum(v * v), slice=s, in_specs=(P("x"),), out_specs=P())(x)
    print("RESULT", float(y.fetch()), "TENANT", session.tenant, "WEIGHT", session.weight)
    print("EXE", sys.executable, "WHICH", shutil.which("python"))
    print("ENV", sorted(k for k in os.environ if k.startswith(("RAY", "PATHWAYS"))))
    print("UID", os.getuid(), "CWD", os.getcwd())
    pw.shutdown()
    try:  # the same ticket again
        pw.init()
        print("SECOND accepted")
    except pw.PathwaysError as exc:
        print("SECOND", type(exc).__name__, exc)
""")


def free_port() -> int:
    return head.free_ports(1, set())[0]


def one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("pathways: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to check which processes `pathways down` stopped")
    workdir = tmp_path_factory.mktemp("job-dir")
    (workdir / "job.py").write_text(JOB_SCRIPT)
    return workdir


@pytest.fixture(scope="module")
def machine():
    """Where the suite runs as root: the tenants' job users can run this Python, and go with the module."""
    if not is_root():
        yield False
        return
    with job_users_machine():
        yield True


@pytest.fixture(scope="module")
def pw_cli(tmp_path_factory, workdir, machine):
    """The cluster the tests of this module share; each test leaves it as it found it: up, with a runtime."""
    run = Cli(tmp_path_factory.mktemp("pathways-home"), workdir, tmp_path_factory.mktemp("pathways-tmp"))
    run.root = machine
    # a runtime that is not root runs no tenant's job unless told to run them all as itself, unsafely
    run.job_options = [] if machine else ["--unsafe-jobs-as-runtime-user"]
    run.up_out = run.up(*run.job_options).stdout
    yield run
    stop_head_of(run)


@pytest.fixture(scope="module")
def tenants(pw_cli, tmp_path_factory):
    """alice (weight 2, quota 2 devices), set up on a machine of her own from what the admin printed; bob
    (weight 1) on the admin's."""
    added = pw_cli("tenants", "add", "alice", "--weight", "2", "--quota", "2").stdout
    pw_cli.alice = pw_cli.tenant_home(tmp_path_factory.mktemp("alice-home"), added)
    pw_cli.added = added
    pw_cli("tenants", "add", "bob", "--weight", "1")
    pw_cli.users = registry_users(pw_cli.home / "registry.json")
    return pw_cli


@pytest.fixture(scope="module")
def alice_job(tenants) -> dict:
    """A job of alice's that runs to its end, submitted from her machine: what `submit --wait` printed."""
    out = tenants("submit", "--wait", "--", "python", "job.py", env=tenants.alice, timeout=240).stdout
    return {"out": out, "job": out.split()[1], "status": json.loads(tenants("status", "--json").stdout)}


def test_up_prints_the_address_and_keeps_the_admins_secrets_to_the_admin(pw_cli):
    state = pw_cli.state()
    address = f"pathways://{state['ray_address'].rsplit(':', 1)[0]}:{pw_cli.client_port}"
    assert state["address"] == address and state["phase"] == "up" and head_processes(state)
    token = pw_cli.home / "admin.token"
    assert mode(token) == 0o600 and mode(pw_cli.home) == 0o700 and len(token.read_text().strip()) >= 40
    assert mode(pw_cli.home / "registry.json") == 0o600  # the head is this machine
    out = pw_cli.up_out
    assert f"address:             {address}" in out and f"admin credential:    {token}" in out, out
    assert token.read_text().strip() not in out
    published = Path(pw_cli.env["PATHWAYS_TMPDIR"]) / "current"
    assert published.read_text().strip() == address and mode(published) == 0o644
    assert mode(head.ray_token_path()) == 0o600  # a job running as another user cannot read Ray's token
    ray_dir = Path(state["temp_dir"])  # Ray makes its temp dir 0777: it is inside a folder of the runtime's alone
    assert mode(ray_dir) == 0o700 and ray_dir.stat().st_uid == os.geteuid() and (ray_dir / "ray").is_dir()
    mode_line = "an OS user of each tenant's own" if pw_cli.root else "the runtime's own user (--unsafe-jobs-as"
    assert f"jobs run as:         {mode_line}" in out, out


def test_a_second_up_is_refused(pw_cli):
    one_line_error(pw_cli("up", "--port", str(free_port()), ok=False), "already runs a cluster")


def test_a_tenants_machine_needs_only_the_login_the_admin_printed(tenants, tmp_path):
    assert "pathways login pathways://" in tenants.added and tenants.credential("alice") in tenants.added
    status = json.loads(tenants("status", "--json", env=tenants.alice).stdout)
    assert status["view"] == "tenant alice" and list(status["tenants"]) == ["alice"]
    script = "import pathways as pw\ns = pw.init()\nprint(s.tenant, s.weight, s.address)\n"  # a bare pw.init()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**tenants.env, **tenants.alice})
    assert out.stdout.split() == ["alice", "2.0", tenants.state()["address"]], out.stderr[-2000:]
    nobody = {"PATHWAYS_HOME": str(tmp_path / "nobody")}
    one_line_error(tenants("jobs", ok=False, env=nobody), "`pathways jobs` needs a tenant's credential")


def test_a_bare_pw_init_on_the_machine_attaches_to_the_runtime_up_started(tenants, tmp_path):
    """The admin who ran `up` (this home) attaches as tenant `default`, the admin's own, shown in `pathways status`
    like any tenant; anyone else on the machine (another home) finds the runtime but no credential of it."""
    credential = tenants.home / "credentials" / "default"
    assert mode(credential) == 0o600 and mode(credential.parent) == 0o700  # the admin's alone
    assert (f"attach from Python:  pw.init()   (you, on this machine: tenant default, its credential in {credential}"
            in tenants.up_out), tenants.up_out
    script = ("import sys, pathways as pw\ntry:\n    s = pw.init()\nexcept pw.TenantAccessError as exc:\n"
              "    print('REFUSED', exc)\n    sys.exit()\nprint('ATTACHED', flush=True)\nsys.stdin.readline()\n"
              "print(s.tenant, s.address)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=tenants.env)
    await_line(proc, "ATTACHED", 120)
    status = json.loads(tenants("status", "--json").stdout)
    out, err = proc.communicate("go\n", timeout=60)
    assert out.split() == ["default", tenants.state()["address"]], out + err[-2000:]
    assert status["tenants"]["default"]["clients"] == 1, status["tenants"]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**tenants.env, "PATHWAYS_HOME": str(tmp_path)})
    # it found the runtime (no second, embedded cluster) and asks for a credential of it
    assert out.stdout.startswith("REFUSED tenant 'default' has no credential") and "pathways login" in out.stdout, \
        out.stdout + out.stderr[-2000:]


def test_tenants_commands_need_the_admin_credential(tenants, tmp_path):
    one_line_error(tenants("tenants", "add", "mallory", "--weight", "9", ok=False, env=tenants.alice),
                   "needs the cluster's admin credential")
    (tmp_path / "alice").write_text(tenants.credential("alice"))
    one_line_error(tenants("tenants", "add", "mallory", "--weight", "9", "--admin-credential-file",
                           str(tmp_path / "alice"), ok=False, env=tenants.alice),
                   "this operation needs the cluster's admin credential")
    assert "mallory" not in tenants("tenants", "list").stdout


def test_tenants_add_list_set_remove(tenants):
    out = tenants("tenants", "add", "carol", "--weight", "3", "--quota", "1", "--budget", "sessions=2").stdout
    path = tenants.home / "credentials" / "carol"
    first = path.read_text().strip()
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert "added tenant carol: weight 3, quota 1" in out and first in out
    lines = tenants("tenants", "list").stdout.splitlines()
    assert lines[0].split() == ["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES", "JOB", "USER"]
    users = registry_users(tenants.home / "registry.json")
    rows = [line.split() for line in lines[1:] if line.split()[0] != "default"]  # `up`'s own tenant, the admin's
    assert rows == [["alice", "2", "2", "0", "0", users["alice"] or "-"],
                    ["bob", "1", "-", "0", "0", users["bob"] or "-"],
                    ["carol", "3", "1", "0", "0", users["carol"] or "-"]]
    if tenants.root:  # a user of each tenant's own, made by `tenants add`
        assert len(set(users.values())) == len(users) and f"its jobs run as OS user {users['carol']}" in out
    carol = next(t for t in json.loads(tenants("tenants", "list", "--json").stdout) if t["name"] == "carol")
    assert carol["budgets"]["sessions"] == 2
    out = tenants("tenants", "set", "carol", "--weight", "5", "--no-quota", "--new-credential").stdout
    second = path.read_text().strip()
    assert "changed tenant carol: weight 5, quota none" in out and second in out and second != first
    one_line_error(tenants("tenants", "set", "carol", "--budget", "bytes=5", ok=False), "no budget named 'bytes'")
    out = tenants("tenants", "remove", "carol").stdout
    assert "removed tenant carol" in out and not path.exists()
    if tenants.root:
        assert f"its OS user {users['carol']} stays, unused" in out


def test_a_job_holds_a_ticket_and_the_address_and_nothing_else(tenants, alice_job):
    """The job runs as alice with the registry's weight, as her OS user, in the runtime's python although no venv
    is on PATH; its environment names neither Ray nor a credential nor its ticket; a second use of the ticket
    fails; once it ended, its folder is gone."""
    out, job = alice_job["out"], alice_job["job"]
    assert out.startswith("submitted ") and job.startswith("alice-")
    assert "RESULT 140.0 TENANT alice WEIGHT 2.0" in out and f"job {job} SUCCEEDED" in out, out
    assert f"EXE {sys.executable} WHICH {os.path.dirname(sys.executable)}{os.sep}python" in out, out
    assert "ENV ['PATHWAYS_ADDRESS', 'PATHWAYS_JOB', 'PATHWAYS_TENANT']" in out, out
    assert "SECOND TenantAccessError" in out and "ticket" in out.split("SECOND")[-1], out
    for secret in (tenants.credential("alice"), (tenants.home / "admin.token").read_text().strip()):
        assert secret not in out
    uid, cwd = out.split("UID ")[1].split()[0], out.split(" CWD ")[1].split()[0]
    if tenants.root:
        assert int(uid) == pwd.getpwnam(tenants.users["alice"]).pw_uid, out
    assert cwd.endswith(f"/jobs/{job}/work") and not Path(cwd).parent.exists()


VICTIM_SCRIPT = textwrap.dedent("""
    import os, time
    import pathways as pw
    session = pw.init()  # its memory now holds the session's key
    with open("secret", "w") as f:
        f.write("bob's data")
    print("READY", os.getpid(), os.getcwd(), flush=True)
    time.sleep(300)
""")


def test_a_hostile_job_reaches_neither_another_tenants_job_nor_the_runtime_nor_ray(tenants, workdir):
    """Bob's job holds a session; alice's job, knowing every path and the Ray cluster's address as an attacker
    would, tries to read bob's job's environment, memory and files, the admin's and Ray's tokens and the
    registry, to write into bob's folder, Ray's temp dir and the jobs' folders, and to attach to Ray."""
    if not tenants.root:
        pytest.skip("each tenant's jobs run as a user of its own only where the runtime runs as root")
    (workdir / "victim.py").write_text(VICTIM_SCRIPT)
    (workdir / "hostile_job.py").write_text(Path(script("hostile_job.py")).read_text())
    victim = tenants("submit", "--tenant", "bob", "--", "python", "victim.py").stdout.split()[1]
    deadline = time.monotonic() + 120
    while "READY" not in (log := tenants("logs", victim).stdout):
        assert time.monotonic() < deadline and "RUNNING" in tenants("jobs").stdout, log
        time.sleep(0.2)
    _, pid, cwd = next(line for line in log.splitlines() if line.startswith("READY")).split()
    state, jobs_root = tenants.state(), Path(cwd).parents[3]
    ray_dir = Path(state["temp_dir"])
    targets = {"read": [f"{cwd}/secret", str(tenants.home / "admin.token"), str(head.ray_token_path()),
                        str(tenants.home / "registry.json")],
               "list": [cwd, str(jobs_root), str(ray_dir)],
               "write": [cwd, str(jobs_root), str(Path(cwd).parents[1]), str(ray_dir), str(ray_dir / "ray"),
                         str(ray_dir / "ray" / "session_latest" / "sockets")],
               "environ": [pid], "memory": [pid], "ray": [state["ray_address"]]}
    out = tenants("submit", "--wait", "--", "python", "hostile_job.py", json.dumps(targets), env=tenants.alice,
                  timeout=240).stdout
    results = probe(out)
    assert len(results) == 16 and not denied(results), denied(results)
    assert "InvalidAuthToken" in results[f"attach to Ray at {state['ray_address']}"]
    assert tenants("stop", victim).stdout.strip() == f"job {victim} STOPPED"


def test_the_disk_budget_refuses_an_archive_before_it_is_sent(tenants):
    tenants("tenants", "set", "bob", "--budget", "job_disk_bytes=4096")
    try:
        one_line_error(tenants("submit", "--tenant", "bob", "--", "python", "job.py", ok=False),
                       "over your job_disk_bytes budget")
    finally:
        tenants("tenants", "set", "bob", "--budget", "job_disk_bytes=2147483648")


def test_stop_and_logs_only_on_your_own_jobs(tenants, alice_job):
    bob = tenants("submit", "--tenant", "bob", "--", "python", "-c", "import time; time.sleep(300)").stdout.split()[1]
    for command in ("stop", "logs"):
        one_line_error(tenants(command, bob, ok=False, env=tenants.alice), f"no job {bob!r} of yours")
    assert "RESULT 140.0 TENANT alice" in tenants("logs", alice_job["job"], env=tenants.alice).stdout
    mine = [r["id"] for r in json.loads(tenants("jobs", "--json", env=tenants.alice).stdout)]
    assert alice_job["job"] in mine and bob not in mine  # a tenant lists its own jobs only
    t0 = time.monotonic()
    out = tenants("stop", bob, "--tenant", "bob").stdout  # bob's credential file is on this machine
    assert out.strip() == f"job {bob} STOPPED" and time.monotonic() - t0 < 30
    table = tenants("jobs").stdout.splitlines()  # the admin lists every job
    assert table[0].split() == ["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"]
    assert any(line.startswith(bob) and " bob " in line and "STOPPED" in line for line in table)
    log = tenants("logs", bob).stdout
    assert "Traceback" not in log  # a stopped job's log ends without a stack dump


def test_rotating_a_credential_ends_the_tenants_sessions(tenants, tmp_path):
    script = textwrap.dedent("""
        import sys, time, pathways as pw
        s = pw.init()
        print("attached", flush=True)
        sys.stdin.readline()  # the admin rotates the credential meanwhile
        try:
            pw.slice((1,), ("x",))
            print("STILL WORKS")
        except pw.PathwaysError as exc:
            print("ENDED", type(exc).__name__, exc)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**tenants.env, "PATHWAYS_TENANT": "bob",
                                                                     "PATHWAYS_CREDENTIAL": tenants.credential("bob")})
    assert proc.stdout.readline().strip() == "attached"
    tenants("tenants", "set", "bob", "--new-credential")
    out, err = proc.communicate("go\n", timeout=60)
    assert out.startswith("ENDED TenantAccessError") and "session has ended" in out, out + err[-2000:]


def lingers(port: int) -> bool:
    """Whether a connection of ``port`` on this machine's side waits in TIME-WAIT (the kernel's tcp tables)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if int(local.rsplit(":", 1)[1], 16) == port and state == "06":  # 06: TIME_WAIT
                    return True
    return False


def where(pid: int) -> str:
    """What process ``pid`` is doing, from /proc (for a failure's message): each thread's state and kernel wait."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        return f"process {pid} has exited"
    out = []
    for task in sorted(tasks.iterdir()):
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            out.append(f"{status.get('Name', '?').strip()} {status.get('State', '?').strip()} "
                       f"in {(task / 'wchan').read_text().strip() or '-'}")
        except OSError:
            continue
    return f"process {pid} alive, threads: " + "; ".join(out)


def leave_in_time_wait(port: int) -> None:
    """A connection to ``port`` that its server side closes first, as a stopped head's GCS does to its clients'
    (a `down` leaves some, depending on timing): it lingers in TIME-WAIT for a minute."""
    with socket.create_server(("", port)) as server:
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = server.accept()
        conn.close()
        assert client.recv(1) == b""  # the server's end is closed
        client.close()
    deadline = time.monotonic() + 5
    while not lingers(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lingers(port)


# `pathways ARGS` as from a terminal, where Ctrl-C raises KeyboardInterrupt: a suite started in the background of a
# shell has SIGINT ignored (POSIX), and every process it starts inherits that
WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('command', run_name='__main__', alter_sys=True)")


def interrupt_up(run: Cli, sig: signal.Signals, tries: int = 3) -> dict:
    """Start `pathways up` and send it ``sig`` while it starts the Ray head (Ray's daemons run beside `ray start`,
    and must not outlive the interrupted `up`); returns the state it had then. A busy machine may finish the start
    before the signal lands (or start the head again, in a new folder): a start that finished is taken down and
    tried again, since what is under test is an interrupted one."""
    for _ in range(tries):
        proc = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, "up", "--port", str(run.port), "--client-port",
                                 str(run.client_port), *run.topology], cwd=run.workdir, env=run.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline, state = time.monotonic() + 90, None
        while proc.poll() is None and time.monotonic() < deadline:
            state = run.state() or state
            if state and state["head_pid"] and state["phase"] == "starting" and len(head_processes(state)) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"`pathways up` did not end within 90 s of signal {sig.name}: {where(proc.pid)}; state "
                        f"{run.state()}; it printed {exc.stdout!r} {exc.stderr!r}")
        now = run.state()
        if now is None or now["phase"] == "starting":
            assert state and state["temp_dir"], f"`pathways up` ended before it started the head: {err}"
            return state
        assert "stopped the Ray head" in run("down", timeout=90).stdout  # it finished starting first: again
    pytest.fail(f"`pathways up` finished starting before the signal each of {tries} times")


def test_down_then_an_interrupted_up_is_cleaned_up_and_up_right_after_down_succeeds_at_once(tenants, alice_job):
    """The module's cluster, after the tests above ran tenants' jobs on it: `down` stops all of it; an `up` killed
    while it starts is cleaned up (Ctrl-C by itself, a kill by the next `down`); then an `up` at once on the same
    ports, with a connection of the Ray port in TIME-WAIT (which a busy check took for in use), bringing it back
    with its tenants, as the module's other tests expect it."""
    run = tenants
    state = run.state()
    cwd = alice_job["out"].split(" CWD ")[1].split()[0]
    out = run("down", timeout=90).stdout
    assert "stopped the runtime's jobs" in out and "stopped the Ray head" in out, out
    assert not Path(cwd).parents[2].exists()  # the runtime's jobs' folder went with it
    assert "the tenant registry stays in" in out, out
    assert not head_processes(state) and run.state() is None and not Path(state["temp_dir"]).exists()
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the runtime's port any more
        socket.create_connection(("127.0.0.1", run.client_port), timeout=5).close()
    for sig in (signal.SIGINT, signal.SIGKILL):  # Ctrl-C cleans up itself; a kill leaves it to `down`
        state = interrupt_up(run, sig)
        if sig == signal.SIGKILL:
            assert run.state()["phase"] == "starting" and head_processes(state)
            assert "interrupted `pathways up`" in run("down", timeout=60).stdout
        assert run.state() is None and not head_processes(state) and not Path(state["temp_dir"]).exists()
    leave_in_time_wait(run.port)  # up right after that down, with the Ray port's connection in TIME-WAIT
    t0 = time.monotonic()
    run.up(*run.job_options)
    print(f"up right after down: {time.monotonic() - t0:.1f} s")
    assert run.state()["phase"] == "up" and head_processes(run.state())
    tenants = [t["name"] for t in json.loads(run("tenants", "list", "--json").stdout)]
    assert "alice" in tenants and "bob" in tenants, tenants  # the registry outlived the cluster


def readme_block(heading: str, index: int) -> list[str]:
    """The commands of the ``index``-th bash block under ``heading`` in the README (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n")[1 + index].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_shared_cluster_commands_work_as_written(tmp_path, machine):
    """Every command of the README's shared-cluster section, in order: the admin's on this machine, the
    tenant's from a home of its own holding only what `pathways tenants add` printed."""
    if not machine:
        pytest.skip("the README's `pathways submit` needs a runtime running as root (a job user per tenant)")
    admin, tenant = readme_block("## A shared cluster", 0), readme_block("## A shared cluster", 1)
    assert admin[0].startswith("pathways up") and admin[-1] == "pathways down" and tenant[0].startswith(
        "pathways login pathways://HOST:7100")
    if not (head.port_free(6379) and head.port_free(7100)):
        pytest.skip("the README's ports (6379, 7100) are in use on this machine")
    run = Cli(tmp_path / "admin", ROOT, tmp_path / "tmp")
    alice = {"PATHWAYS_HOME": str(tmp_path / "alice")}

    def command(line: str, env: dict | None = None) -> str:
        words = line.split()
        argv = (run.command if words[0] == "pathways" else [sys.executable]) + words[1:]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT,
                              env={**run.env, **(env or {})})
        assert proc.returncode == 0, f"`{line}` failed:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    try:
        printed = {}
        for line in admin[:-1]:
            printed[line] = command(line)
        login = next(line.strip() for line in printed["pathways tenants add alice --weight 1 --quota 8"].splitlines()
                     if line.strip().startswith("pathways login"))
        outs = [command(login, alice)] + [command(line, alice) for line in tenant[1:]]
        assert "logged in to" in outs[0] and "y = [3. 5.] on island 1" in outs[1], outs
        assert "submitted alice-" in outs[2] and "alice" in outs[3] and "your tenant's view" in outs[4], outs
        assert "whole cluster (admin)" in printed["pathways status"]
    finally:
        out = command(admin[-1]) if run.state() else ""
        stop_head_of(run)
    assert "stopped the Ray head" in out
