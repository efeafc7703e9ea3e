"""The job runner on this machine, without Ray: each tenant's jobs run as an OS user of the tenant's own, in folders
of their own that go when they end, within the tenant's ``job_disk_bytes``; hostile jobs try what the issue of a
shared cluster lists and are refused.

The runner is the real one, with a real tenant registry (which makes real OS users), real tickets and real
processes, as the resource manager wires them (``runner_over`` below). Needs root, as making users and starting
processes as them do.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from job_users_env import NEEDS_ROOT, denied, is_root, job_users_machine, probe, uid_of
from suite_paths import ROOT, script

from command.jobs import pack
from pathways import auth
from pathways.errors import ResourceError, TenantAccessError
from resource_manager import jobs as jobs_module
from resource_manager.job_disk import Folders, private_dir
from resource_manager.job_users import processes_of
from resource_manager.jobs import MAX_ARCHIVE, Job, JobRunner
from resource_manager.registry import Registry
from resource_manager.tickets import Tickets

pytestmark = [pytest.mark.skipif(not is_root(), reason=NEEDS_ROOT), pytest.mark.os_users]
ADMIN = "admin-secret"
HOSTILE = Path(script("hostile_job.py"))
VICTIM = textwrap.dedent("""
    import os, sys, time
    ticket = os.read(int(os.environ["PATHWAYS_TICKET_FD"]), 4096)  # what a job holds in memory
    with open("secret", "w") as f:
        f.write("the victim's data")
    print("READY", os.getpid(), os.getcwd(), flush=True)
    time.sleep(300)
""")


def runner_over(registry: Registry, base: Path, unsafe_runtime_user: bool = False) -> JobRunner:
    """A job runner over ``registry`` and tickets of its own, as the resource manager makes one."""
    return JobRunner(registry, Tickets(), secrets.token_hex(8), "pathways://127.0.0.1:1", str(base / "jobs"),
                     unsafe_runtime_user)


@pytest.fixture(scope="module")
def machine():
    with job_users_machine():
        yield


@pytest.fixture
def base(machine):
    """A folder other users may pass through (as the jobs' folders' parents must be), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="pathways-jobs-test-"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cluster(base):
    """A registry kept in a file (which makes job users) and a runner over it; every job ends with the test."""
    registry = Registry(str(base / "registry.json"), auth.digest(ADMIN), make_job_users=True)
    runner = runner_over(registry, base)
    yield registry, runner
    runner.stop_all()


def workdir(base: Path, name: str, files: dict[str, str | bytes]) -> Path:
    folder = base / "src" / name
    folder.mkdir(parents=True)
    for path, content in files.items():
        (folder / path).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def submit(runner: JobRunner, tenant: str, credential: str, folder: Path, *entrypoint: str) -> Job:
    """Submit as the resource manager's endpoint does: admitted, received from a stream, started, released."""
    archive = pack(str(folder))
    upload = runner.admit(tenant, credential, list(entrypoint), None, len(archive))
    try:
        runner.receive(upload, io.BytesIO(archive).readinto)
        return runner.jobs[runner.start(upload)["id"]]
    finally:
        runner.release(upload)


def log_of(runner: JobRunner, job: Job) -> str:
    return runner.logs("", ADMIN, job.id, 0)["text"]


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f}s"
        time.sleep(0.05)


def ended(job: Job, timeout: float = 60.0) -> str:
    assert job.done.wait(timeout), f"job {job.id} did not end within {timeout:.0f}s"
    return job.status


def ready_victim(runner: JobRunner, tenant: str, credential: str, base: Path) -> tuple[Job, str, str]:
    victim = submit(runner, tenant, credential, workdir(base, f"victim-{tenant}", {"victim.py": VICTIM}), "python",
                    "victim.py")
    wait_for(lambda: "READY" in log_of(runner, victim), "the victim's start")
    _, pid, cwd = next(line for line in log_of(runner, victim).splitlines() if line.startswith("READY")).split()
    return victim, pid, cwd


def hostile(runner: JobRunner, tenant: str, credential: str, base: Path, targets: dict) -> dict[str, str]:
    import json

    folder = workdir(base, f"hostile-{secrets.token_hex(3)}", {"hostile_job.py": HOSTILE.read_text()})
    job = submit(runner, tenant, credential, folder, "python", "hostile_job.py", json.dumps(targets))
    assert ended(job) == "SUCCEEDED", log_of(runner, job)
    return probe(log_of(runner, job))


def test_one_tenants_job_cannot_reach_anothers_job_or_the_runtimes_files(cluster, base):
    registry, runner = cluster
    alice, bob = registry.add("alice"), registry.add("bob")
    users = {t["name"]: t["job_user"] for t in registry.listing()}
    assert users["alice"] != users["bob"] and uid_of(users["alice"]) != uid_of(users["bob"])
    victim, pid, cwd = ready_victim(runner, "alice", alice, base)
    folder = runner.folders.path
    targets = {"read": [f"{cwd}/secret", str(base / "registry.json"), str(victim.log)],
               "list": [cwd, str(folder.parent), str(folder), str(folder / "jobs"), str(folder / "logs")],
               "write": [cwd, str(folder.parent), str(folder), str(folder / "jobs"), str(folder / "incoming")],
               "environ": [pid], "memory": [pid]}
    results = hostile(runner, "bob", bob, base, targets)
    assert len(results) == 15 and not denied(results), denied(results)
    # the same tries from another job of alice's (the same user) reach her first job: the tries can succeed
    own = hostile(runner, "alice", alice, base, {"read": [f"{cwd}/secret"], "environ": [pid], "memory": [pid]})
    assert set(own.values()) == {"allowed"}, own
    runner.stop("alice", alice, victim.id)


def test_a_job_ends_with_what_it_started_and_leaves_no_folder(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice")
    script = textwrap.dedent("""
        import os, time
        if os.fork() == 0:  # a daemon: its own session, out of the job's process group
            os.setsid()
            if os.fork() == 0:
                time.sleep(300)
            os._exit(0)
        os.wait()
        print("LEFT A DAEMON", flush=True)
    """)
    job = submit(runner, "alice", alice, workdir(base, "daemon", {"job.py": script}), "python", "job.py")
    uid = job.user.pw_uid
    assert ended(job) == "SUCCEEDED" and "LEFT A DAEMON" in log_of(runner, job)
    assert not job.folder.exists() and not processes_of(uid)
    assert runner.ledger.held("alice") == job.log_bytes  # only its log is kept, and counted


def test_a_tar_bomb_is_refused_before_anything_is_unpacked(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice", budgets={"job_disk_bytes": 8 << 20})
    folder = workdir(base, "bomb", {"zeros": bytes(64 << 20), "job.py": "print('never')"})
    with pytest.raises(ResourceError, match="over your job_disk_bytes budget"):
        submit(runner, "alice", alice, folder, "python", "job.py")
    assert not os.listdir(runner.folders.path / "jobs") and not os.listdir(runner.folders.path / "incoming")
    assert runner.ledger.held("alice") == 0 and not runner.jobs


def test_the_disk_budget_refuses_the_next_archive_until_a_job_ends(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice", budgets={"job_disk_bytes": 5 << 20})
    folder = workdir(base, "data", {"data": os.urandom(2 << 20), "job.py": "import time; time.sleep(300)"})
    first = submit(runner, "alice", alice, folder, "python", "job.py")  # holds its 2 MiB while it runs
    with pytest.raises(ResourceError, match="over your job_disk_bytes budget"):
        submit(runner, "alice", alice, folder, "python", "job.py")
    assert len(os.listdir(runner.folders.path / "jobs")) == 1 and not os.listdir(runner.folders.path / "incoming")
    assert runner.stop("alice", alice, first.id) == "STOPPED"
    second = submit(runner, "alice", alice, folder, "python", "job.py")
    runner.stop("alice", alice, second.id)


def test_an_archive_over_the_budget_is_refused_before_a_byte_is_read(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice", budgets={"job_disk_bytes": 1 << 20})
    with pytest.raises(ResourceError, match="over your job_disk_bytes budget"):
        runner.admit("alice", alice, ["python", "x.py"], None, 2 << 20)
    with pytest.raises(ResourceError, match="packs to"):
        runner.admit("alice", alice, ["python", "x.py"], None, MAX_ARCHIVE + 1)
    with pytest.raises(TenantAccessError):
        runner.admit("alice", "a guess", ["python", "x.py"], None, 1 << 10)
    with pytest.raises(TenantAccessError, match="not the admin's"):
        runner.admit("", ADMIN, ["python", "x.py"], None, 1 << 10)
    assert runner.ledger.held("alice") == 0 and not runner.jobs


def test_a_jobs_log_is_bounded(cluster, base, monkeypatch):
    monkeypatch.setattr(jobs_module, "LOG_BYTES", 1 << 20)
    registry, runner = cluster
    alice = registry.add("alice")
    script = "import sys\nfor _ in range(48):\n    sys.stdout.write('x' * 65535 + '\\n')\n"  # 3 MiB
    job = submit(runner, "alice", alice, workdir(base, "loud", {"job.py": script}), "python", "job.py")
    assert ended(job) == "SUCCEEDED"
    tail = runner.logs("alice", alice, job.id, (1 << 20) - 10)["text"]  # `pathways logs` reads 1 MiB at a time
    assert job.log_bytes == 1 << 20 and "the log stops here: it reached 1 MiB" in tail, tail
    assert job.log.stat().st_size < (1 << 20) + 200 and runner.ledger.held("alice") == 1 << 20


def test_an_ended_jobs_log_makes_room_for_the_next_job(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice", budgets={"job_disk_bytes": 3 << 20})
    script = "import sys\nfor _ in range(32):\n    sys.stdout.write('x' * 65535 + '\\n')\n"  # 2 MiB
    loud = submit(runner, "alice", alice, workdir(base, "loud", {"job.py": script}), "python", "job.py")
    assert ended(loud) == "SUCCEEDED" and runner.ledger.held("alice") == 2 << 20
    data = workdir(base, "data", {"data": os.urandom(1 << 20), "job.py": "print('ok')"})
    job = submit(runner, "alice", alice, data, "python", "job.py")  # 2 MiB of log + 1 MiB archive + 1 MiB unpacked
    assert ended(job) == "SUCCEEDED" and loud.id not in runner.jobs and not loud.log.exists()
    assert runner.ledger.held("alice") == job.log_bytes


def test_removing_a_tenant_stops_its_jobs_and_its_name_starts_afresh(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice")
    old_user = registry.get("alice").job_user
    job = submit(runner, "alice", alice, workdir(base, "long", {"job.py": "import time; time.sleep(300)"}),
                 "python", "job.py")
    registry.remove("alice")
    assert ended(job, 30) == "STOPPED" and not processes_of(uid_of(old_user))
    again = registry.add("alice")
    assert registry.get("alice").job_user != old_user  # the old user stays, unused (its uid is never reused)
    assert runner.list("alice", again) == [] and uid_of(old_user)


def test_a_job_user_is_never_root_the_runtimes_or_another_tenants(cluster):
    registry, _ = cluster
    registry.add("alice")
    for user, words in (("root", "is root"), ("no-such-user-here", "no such user"),
                        (registry.get("alice").job_user, "another tenant")):
        with pytest.raises(ResourceError, match=words):
            registry.add("bob", job_user=user)
    assert registry.get("bob") is None
    registry.add("bob", job_user="nobody")
    assert registry.get("bob").job_user == "nobody" and not registry.get("bob").job_user_made
    again = Registry(str(registry.path), None)  # the users are kept in the registry's file
    assert {t["name"]: t["job_user"] for t in again.listing()} == {t["name"]: t["job_user"]
                                                                   for t in registry.listing()}


def test_without_a_job_user_a_job_is_refused_saying_what_to_do(machine, base):
    registry = Registry(None, auth.digest(ADMIN))  # in memory, as an embedded cluster's: it makes no users
    credential = registry.add("alice")
    runner = runner_over(registry, base)
    with pytest.raises(ResourceError, match=r"set_tenant\('alice', job_user=USER\)"):
        runner.admit("alice", credential, ["python", "x.py"], None, 1 << 10)
    snippet = ("from resource_manager.registry import Registry\nr = Registry(None, None, make_job_users=True)\n"
               "r.add('alice')\ntry:\n    r.job_user('alice')\nexcept Exception as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         user="nobody", group="nogroup", extra_groups=[])  # as a runtime that is not root
    assert "not as root" in out.stdout and "--unsafe-jobs-as-runtime-user" in out.stdout, out.stdout + out.stderr


def test_only_the_unsafe_flag_runs_jobs_as_the_runtimes_user(machine, base):
    registry = Registry(None, auth.digest(ADMIN))
    credential = registry.add("alice")
    runner = runner_over(registry, base, unsafe_runtime_user=True)
    job = submit(runner, "alice", credential, workdir(base, "uid", {"job.py": "import os; print('UID', os.getuid())"}),
                 "python", "job.py")
    assert ended(job) == "SUCCEEDED" and f"UID {os.getuid()}" in log_of(runner, job)
    runner.stop_all()


def test_the_jobs_folders_are_the_runtimes_and_go_with_it(cluster, base):
    registry, runner = cluster
    alice = registry.add("alice")
    crashed = base / "jobs" / "a-crashed-runtime"
    (crashed / "jobs").mkdir(parents=True)
    (crashed / "alive").touch()  # its lock is free: the runtime that held it is gone
    job = submit(runner, "alice", alice, workdir(base, "ok", {"job.py": "print('ok')"}), "python", "job.py")
    assert ended(job) == "SUCCEEDED" and not crashed.exists()
    folder = runner.folders.path
    modes = {p: oct(p.stat().st_mode & 0o777) for p in (base / "jobs", folder, folder / "jobs", folder / "logs",
                                                         folder / "incoming", job.log)}
    assert list(modes.values()) == ["0o711", "0o711", "0o711", "0o700", "0o700", "0o600"], modes
    assert {p.stat().st_uid for p in modes} == {os.geteuid()}
    runner.stop_all()
    assert not folder.exists() and os.listdir(base / "jobs") == []


def test_a_jobs_folder_nobody_else_may_change_or_reach_is_refused(machine, base):
    (base / "elsewhere").mkdir()
    (base / "link").symlink_to(base / "elsewhere")
    with pytest.raises(ResourceError, match="is a link"):
        private_dir(base / "link", 0o711)
    closed = base / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    with pytest.raises(ResourceError, match="closed to other users"):
        Folders(closed / "jobs", "r", others_pass=True).ready()
    open_to_all = base / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(ResourceError, match="may be changed by other users"):
        private_dir(open_to_all / "jobs", 0o711)
