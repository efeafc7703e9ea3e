"""The `pathways` command's local side, no cluster needed: bad input refused in one line before anything touches
Ray, the status table, secret files readable by their owner only, the registry's owner check, which python a
job runs, and where the command finds the cluster."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from client import cli, jobs, tables

pytestmark = pytest.mark.usefixtures("restored_environ")  # the CLI sets RAY_ADDRESS & co. in-process


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


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
    for name in jobs.PRIVATE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path))
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("pathways: error: ") and err.count("\n") == 1 and words in err, err



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
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):  # resolve_address sets them: restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
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
