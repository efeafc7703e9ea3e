"""The `pathways` command's local side, no cluster needed: bad input refused in one line before anything starts,
the status table, secret files readable by their owner only, the registry's owner check, what a job's archive
holds, where the command finds the runtime, and that the command never imports Ray."""

from __future__ import annotations

import ast
import io
import json
import os
import socket
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from suite_paths import ROOT

from client import runtime
from command import address, head, jobs, launcher, secrets, suspend, tables, up
from command.main import main
from command.output import CliError
from command.parser import parser

pytestmark = pytest.mark.usefixtures("restored_environ")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def nowhere(monkeypatch, tmp_path):
    """A home with nothing in it, no address in the environment, and no runtime published on this machine."""
    for name in (*head.PRIVATE_ENV, "PATHWAYS_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(runtime, "machine_runtime", lambda: None)
    monkeypatch.setattr(address, "machine_runtime", lambda: None)
    return tmp_path


@pytest.mark.parametrize("args, words", [
    (["submit", "--tenant", "bad name", "--", "python", "x.py"], "tenant 'bad name'"),
    (["submit", "--tenant", "t3"], "nothing to run"),
    (["submit", "--tenant", "t3", "--", "python", "x.py"], "needs your tenant's credential"),
    (["tenants", "add", "t3", "--weight", "1"], "needs the cluster's admin credential"),
    (["tenants", "add", "t3", "--weight", "0"], "--weight must be a positive number"),
    (["tenants", "add", "t3", "--weight", "1", "--budget", "host_bytes"], "write NAME=VALUE"),
    (["tenants", "set", "t3"], "nothing to change"),
    (["status"], "`pathways status` needs a tenant's credential"),
    (["jobs", "--tenant", "t3", "--credential-file", "/nonexistent"], "no such file"),
    (["login", "http://127.0.0.1:8265", "--tenant", "t3", "--credential", "x"], "is not a pathways address"),
    (["login", "pathways://127.0.0.1:1", "--tenant", "t3", "--credential", "x"], "nothing answers at"),
    (["up", "--islands", "0"], "Topology.islands must be a positive int"),
    (["up", "--quota", "0"], "--quota must be a positive"),
    (["up", "--session-grace", "-1"], "--session-grace must be a positive"),
    (["up", "--job-user", "nobody"], "`pathways up --job-user` is gone"),
    (["suspend", "--timeout", "0"], "--timeout must be a number of seconds between 0 and 86400"),
    (["graph", "job.py"], "expected SCRIPT.py:FUNCTION"),
])
def test_bad_input_is_one_line_error(args, words, capsys, nowhere):
    """Refused before anything starts (so run in-process)."""
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("pathways: error: ") and err.count("\n") == 1 and words in err, err


def test_down_with_nothing_to_stop_says_so_and_succeeds(capsys, nowhere):
    assert main(["down"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("nothing to stop: no cluster that `pathways up` started is recorded in ") and \
        out.out.count("\n") == 1 and out.err == "", out


def test_the_command_finds_the_runtime_in_order(nowhere, monkeypatch):
    with pytest.raises(CliError, match="no cluster: pass --address"):
        address.resolve_address(None)
    monkeypatch.setattr(address, "machine_runtime", lambda: "pathways://10.0.0.9:7100")
    assert address.resolve_address(None) == "pathways://10.0.0.9:7100"  # what `pathways up` published here
    head.save_state(head.ClusterState("pathways://10.0.0.1:7100", "10.0.0.1:6379", None, None, {}, 0.0))
    assert address.resolve_address(None) == "pathways://10.0.0.1:7100"  # what our own `up` recorded
    runtime.save_login(runtime.Login("pathways://10.0.0.2:7100", "alice", "s3cret"))
    assert address.resolve_address(None) == "pathways://10.0.0.2:7100"  # a login goes first
    assert mode(runtime.login_path()) == 0o600 and mode(runtime.login_path().parent) == 0o700
    monkeypatch.setenv("PATHWAYS_ADDRESS", "pathways://10.0.0.3:7100")
    assert address.resolve_address(None) == "pathways://10.0.0.3:7100"
    assert address.resolve_address("pathways://10.0.0.4:1") == "pathways://10.0.0.4:1"
    assert secrets.tenant_identity(None) == ("alice", "s3cret")  # the login's tenant and credential
    assert runtime.find_address(None) == ("pathways://10.0.0.3:7100", "PATHWAYS_ADDRESS")


def test_a_port_in_time_wait_is_free_and_one_in_use_is_not():
    """Up to three ports: another process of a busy machine may take a port the moment it is closed (an outgoing
    connection's ephemeral port), but not three times running; a port_free that counted TIME-WAIT as in use
    would fail every time."""
    seen = []
    for _ in range(3):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        assert not head.port_free(port)  # something listens there
        conn.close()  # the server side closes first: its end waits in TIME-WAIT
        client.close()
        server.close()
        seen.append(head.port_free(port))  # what `pathways up` right after `down` sees
        if seen[-1]:
            break
    assert seen[-1], f"ports in TIME-WAIT counted as in use {len(seen)} times running"


def test_rays_ports_are_distinct_and_keep_clear_of_the_runtimes(monkeypatch):
    """Ray refuses to start when two of its components get one port: the kernel handing out a port twice, or the
    runtime's own, must not reach it."""
    real = socket.socket
    handed = iter([41001, 41001, 41002, 41003, 41004, 41002, 41005])  # a repeat, and the runtime's port 41002

    class Bound:  # a socket whose bind(("", 0)) gets the next port of `handed`
        def __init__(self) -> None:
            self.port = next(handed)

        def bind(self, address: tuple) -> None:
            assert address == ("", 0)

        def getsockname(self) -> tuple:
            return ("0.0.0.0", self.port)

        def close(self) -> None:
            pass

    monkeypatch.setattr(head.socket, "socket", Bound)
    ports = head.free_ports(3, {41002})
    monkeypatch.setattr(head.socket, "socket", real)
    assert ports == [41001, 41003, 41004], ports  # the repeat could not happen: 41001 was still held
    many = head.free_ports(40, {head.free_ports(1, set())[0]})
    assert len(set(many)) == 40


def test_the_status_table_shows_the_admin_everything_and_a_tenant_only_its_own():
    from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
    from pathways.topology import Topology

    host = HostStatus(island=0, host=0, node="abcdef0123456789", devices=["cpu:0", "cpu:1"], alive=True,
                      buffers=3, buffer_bytes=3 << 20, queue_depth=1, busy_s=2.5, busy_fraction=0.4)
    island = IslandStatus(0, True, "", [host], queue_depth=4, tenant_time_s={"alice": 1.0, "bob": 3.0})
    st = ClusterStatus(Topology(1, 1, 2), [island], [{"key": "s1", "shape": [2], "axes": ["x"], "island": 0,
                                                       "tenant": "bob", "devices": [[0, 0], [0, 1]]}],
                       tenants={"alice": {"weight": 1.0, "quota": None, "clients": 1, "devices": 0},
                                "bob": {"weight": 3.0, "quota": 2, "clients": 1, "devices": 2}})
    lines = tables.render_status(st, "pathways://127.0.0.1:7100",
                                 [{"at": 0.0, "job": "a-1", "by_job": "b-2"}]).splitlines()
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
    lines = tables.render_status(st, "pathways://127.0.0.1:7100").splitlines()
    assert lines[0].endswith("your tenant's view") and "(others) 75% (3.0s), alice 25% (1.0s)" in lines[3]
    assert lines[-1] == "other tenants: 1, holding 1 slices (2 devices)" and "bob" not in "\n".join(lines)


def test_secrets_are_readable_by_their_owner_only(nowhere, monkeypatch):
    token, created = secrets.ensure_admin_credential()
    path = nowhere / "home" / "admin.token"
    assert created and path.read_text().strip() == token and mode(path) == 0o600 and mode(path.parent) == 0o700
    path.chmod(0o644)
    assert secrets.ensure_admin_credential() == (token, False) and mode(path) == 0o600
    monkeypatch.setenv("PATHWAYS_CREDENTIAL", "from-env")
    assert secrets.tenant_identity("alice") == ("alice", "from-env")
    monkeypatch.delenv("PATHWAYS_CREDENTIAL")
    assert secrets.tenant_identity("alice") is None
    secrets.write_secret(secrets.credential_path("alice"), "s3cret")
    assert secrets.tenant_identity("alice") == ("alice", "s3cret")
    with pytest.raises(CliError, match="no such file"):
        secrets.tenant_identity("alice", str(nowhere / "missing"))
    with pytest.raises(CliError, match="tenant '../admin.token'"):  # a name never leaves the folder
        secrets.credential_path("../admin.token")


def test_a_registry_of_another_admin_is_refused(tmp_path, capsys):
    from pathways.auth import digest

    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"admin": digest("old"), "default_quota": None, "tenants": []}))
    up._check_registry(str(registry), "old")
    assert capsys.readouterr().out == ""
    up._check_registry(str(registry), "old", quota=4)  # the registry keeps its own default quota: say so
    assert "keeps the default quota it was created with (none)" in capsys.readouterr().out
    with pytest.raises(CliError, match="belongs to another admin credential"):
        up._check_registry(str(registry), "new")
    up._check_registry(str(tmp_path / "none.json"), "new")


def test_a_jobs_archive_holds_the_working_directory_without_what_does_not_belong(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("x")
    for junk in (".git/HEAD", "__pycache__/m.pyc", ".venv/bin/python", "pkg.egg-info/PKG-INFO"):
        (tmp_path / junk).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / junk).write_text("junk")
    (tmp_path / "link").symlink_to("/etc/passwd")
    with tarfile.open(fileobj=io.BytesIO(jobs.pack(str(tmp_path))), mode="r:gz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert names == ["data/x.txt", "train.py"]
    with pytest.raises(CliError, match="does not exist"):
        jobs.pack(str(tmp_path / "missing"))
    assert jobs.entrypoint_of(["--", "python", "x.py"]) == ["python", "x.py"]


def test_the_command_imports_neither_ray_nor_jax_to_start():
    code = ("import sys\nimport command.main\nfrom command.parser import parser\nparser()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'jax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS")})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_launcher_imports_no_jax():
    """`pathways up`/`down` and `pw.init()`'s launcher import the manager's actor class and sign with its key, and
    the manager's modules (JAX among them) load only in the actor's process: JAX costs a launch 0.8 s of CPU."""
    code = ("import sys\nimport resource_manager.launch\nfrom resource_manager.actor import ManagerActor, launch_mac\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout[-2000:], out.stderr[-2000:])


def test_format_and_required_arguments():
    assert tables.table(["A", "LONG"], [[1, "x"], ["wide", 2]]).splitlines() == ["A     LONG", "1     x", "wide  2"]
    with pytest.raises(SystemExit):
        parser().parse_args(["tenants", "add", "x"])  # --weight is required
    with pytest.raises(SystemExit):
        parser().parse_args(["login", "pathways://h:1"])  # --tenant and a credential are required


def test_the_address_is_published_only_in_a_folder_of_this_user(tmp_path, monkeypatch):
    """Whoever could change the folder could send this machine's clients, credentials and all, elsewhere."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("PATHWAYS_TMPDIR", str(tmp_path / "link"))
    with pytest.raises(CliError, match="is a link"):
        head.publish("pathways://127.0.0.1:1")
    assert not (tmp_path / "elsewhere" / "current").exists()
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        monkeypatch.setenv("PATHWAYS_TMPDIR", str(theirs))
        with pytest.raises(CliError, match="belongs to uid 65534"):
            head.publish("pathways://127.0.0.1:1")
    monkeypatch.setenv("PATHWAYS_TMPDIR", str(tmp_path / "mine"))
    head.publish("pathways://127.0.0.1:1")
    assert (tmp_path / "mine" / "current").read_text() == "pathways://127.0.0.1:1\n"
    assert mode(tmp_path / "mine") == 0o755


def test_the_runtimes_launcher_answers_in_one_line_and_its_refusal_is_a_one_line_error():
    """``up`` and ``down`` reach the runtime only through ``python -m resource_manager.launch``: what it refuses
    comes back as the command's one-line error (no cluster is needed to be refused)."""
    with pytest.raises(CliError, match="unknown launcher command 'sideways'; use embedded, private, up or down"):
        launcher.launch("sideways", {}, timeout=120)


def test_a_suspend_directory_is_read_as_the_runtime_on_this_machine_reads_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert suspend.location("saved") == str(tmp_path / "saved")
    assert suspend.location("~/saved") == os.path.expanduser("~/saved")
    assert suspend.location("s3://bucket/saved") == "s3://bucket/saved"  # an fsspec URL as given
    assert suspend.location(None) is None


def imported(package: str) -> dict[str, set[str]]:
    """The top-level packages each module of ``package`` imports (at its top or inside a function)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_the_command_sits_beside_the_client_and_reaches_the_runtime_only_through_its_launcher():
    """The command may use the client and the shared vocabulary; the runtime it starts by running
    ``python -m resource_manager.launch``, never by importing it (nor Ray); nothing below it imports it."""
    modules = imported("command")
    assert "command/launcher.py" in modules and "command/main.py" in modules
    assert {m: names & {"ray", "resource_manager"} for m, names in modules.items() if names & {"ray",
                                                                                              "resource_manager"}} == {}
    below = {**imported("client"), **imported("pathways"), **imported("resource_manager")}
    assert [m for m, names in below.items() if "command" in names] == []
