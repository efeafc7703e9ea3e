"""``pathways tenants add | list | set | remove`` (``command.tenants``) without a runtime: the admin client (a
connection to the resource manager, another process) is a small registry here; everything the command checks,
asks, prints and saves is real. Bad input is refused in one line before the runtime is asked anything."""

from __future__ import annotations

import json
import os
import signal
import stat

import pytest

import client.admin
from command import secrets, tenants
from command.main import main
from command.output import CliError
from command.parser import parser
from pathways.errors import PathwaysError, ResourceError

ADDRESS = "pathways://127.0.0.1:47001"
UNSET = object()


class Registry:
    """Stands in for ``client.admin.Admin`` on a runtime with a tenant registry: it records every request and
    refuses as the resource manager does (a PathwaysError with its reason)."""

    def __init__(self) -> None:
        self.tenants_by_name: dict[str, dict] = {}
        self.requests: list[tuple] = []
        self.connected: list[tuple[str, str]] = []
        self.refuse_connect: str | None = None
        self.serial = 0

    def connect(self, address: str, credential: str, timeout: float = 60.0) -> Registry:
        if self.refuse_connect:
            raise PathwaysError(self.refuse_connect)
        self.connected.append((address, credential))
        return self

    def tenants(self) -> list[dict]:
        return [dict(t) for t in self.tenants_by_name.values()]

    def add_tenant(self, name, weight=1.0, quota=None, budgets=None, job_user=None) -> str:
        self.requests.append(("add", name, weight, quota, budgets, job_user))
        if name in self.tenants_by_name:
            raise PathwaysError(f"tenant {name!r} already exists; `pathways tenants set` changes it")
        self.tenants_by_name[name] = {"name": name, "weight": weight, "quota": quota, "clients": 0, "devices": 0,
                                      "job_user": job_user or f"pw-{name}", "job_user_made": job_user is None}
        return self._secret()

    def set_tenant(self, name, weight=None, quota=UNSET, new_credential=False, budgets=None, job_user=None):
        self.requests.append(("set", name, weight, quota, new_credential, budgets, job_user))
        record = self._known(name)
        if weight is not None:
            record["weight"] = weight
        if quota is not UNSET:
            record["quota"] = quota
        if job_user:
            record["job_user"], record["job_user_made"] = job_user, False
        return self._secret() if new_credential else None

    def remove_tenant(self, name: str) -> None:
        self.requests.append(("remove", name))
        self._known(name)
        del self.tenants_by_name[name]

    def _known(self, name: str) -> dict:
        if name not in self.tenants_by_name:
            raise ResourceError(f"no tenant {name!r}")
        return self.tenants_by_name[name]

    def _secret(self) -> str:
        self.serial += 1
        return f"secret-{self.serial}"


@pytest.fixture
def runtime(monkeypatch, tmp_path) -> Registry:
    """A private PATHWAYS_HOME holding the admin credential, and the runtime's registry behind the admin client."""
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    secrets.write_secret(secrets.admin_path(), "admin-secret")
    registry = Registry()
    monkeypatch.setattr(client.admin, "Admin", registry)
    return registry


@pytest.fixture
def signals():
    """``main`` makes SIGTERM and SIGHUP unwind the command: this process gets its own handlers back after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def run(*argv: str) -> int:
    args = parser().parse_args(list(argv))
    return args.run(args)


def printed_login(out: str) -> tuple[str, str, str]:
    """(address, tenant, credential) as `pathways login` reads the command ``out`` hands over."""
    [command] = [line.split() for line in out.splitlines() if line.strip().startswith("pathways login")]
    args = parser().parse_args(command[1:])
    return args.login_address, args.tenant, args.credential


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_add_registers_the_tenant_and_hands_its_credential_over_once(runtime, capsys):
    assert run("tenants", "add", "acme", "--weight", "2", "--quota", "4", "--budget", "host_bytes=4096",
               "--budget", " op_ms = 50", "--address", ADDRESS) == 0
    assert runtime.connected == [(ADDRESS, "admin-secret")]
    assert runtime.requests == [("add", "acme", 2.0, 4, {"host_bytes": 4096, "op_ms": 50}, None)]
    out = capsys.readouterr().out
    assert "added tenant acme: weight 2, quota 4" in out
    assert "its jobs run as OS user pw-acme (made by the runtime)" in out
    assert printed_login(out) == (ADDRESS, "acme", "secret-1")
    path = secrets.credential_path("acme")
    assert f"saved to {path}" in out and "shown only this once" in out
    assert path.read_text().strip() == "secret-1"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700


def test_add_with_a_job_user_of_the_admins_and_no_quota(runtime, capsys):
    assert run("tenants", "add", "acme", "--weight", "0.5", "--job-user", "acmejobs", "--address", ADDRESS) == 0
    out = capsys.readouterr().out
    assert "added tenant acme: weight 0.5, quota none" in out
    assert "its jobs run as OS user acmejobs\n" in out  # not "made by the runtime"


@pytest.mark.parametrize("argv, says", [
    (["add", "bad name", "--weight", "1"], "tenant 'bad name': use 1-63 letters"),
    (["add", "-x", "--weight", "1"], None),  # argparse's own refusal
    (["add", "t", "--weight", "0"], "--weight must be a positive number, got 0"),
    (["add", "t", "--weight", "-3"], "--weight must be a positive number, got -3"),
    (["add", "t", "--weight", "nan"], "--weight must be a positive number, got nan"),
    (["add", "t", "--weight", "inf"], "--weight must be a positive number, got inf"),
    (["add", "t", "--weight", "1", "--quota", "-1"], "--quota must be a number of devices >= 0, got -1"),
    (["add", "t", "--weight", "1", "--budget", "host_bytes"], "--budget 'host_bytes': write NAME=VALUE"),
    (["add", "t", "--weight", "1", "--budget", "host_bytes=-5"], "--budget 'host_bytes=-5': write NAME=VALUE"),
    (["add", "t", "--weight", "1", "--budget", "host_bytes=4k"], "--budget 'host_bytes=4k': write NAME=VALUE"),
    (["add", "t", "--weight", "1", "--budget", "host_bytes="], "--budget 'host_bytes=': write NAME=VALUE"),
    (["set", "t"], "nothing to change: pass --weight W"),
    (["set", "t", "--weight", "0"], "--weight must be a positive number"),
    (["set", "t", "--quota", "-2"], "--quota must be a number of devices >= 0"),
    (["set", "t", "--budget", "x"], "--budget 'x': write NAME=VALUE"),
])
def test_bad_input_is_refused_in_one_line_before_the_runtime_is_asked(runtime, signals, capsys, argv, says):
    if says is None:
        with pytest.raises(SystemExit):
            run("tenants", *argv)
    else:
        assert main(["tenants", *argv, "--address", ADDRESS]) == 1
        err = capsys.readouterr().err
        assert err.startswith("pathways: error: ") and says in err and err.count("\n") == 1
    assert runtime.requests == []
    assert not secrets.credential_path("t").exists()


def test_a_budget_of_digits_int_cannot_read_is_a_one_line_error(runtime):
    with pytest.raises(CliError, match="write NAME=VALUE"):
        run("tenants", "add", "t", "--weight", "1", "--budget", "host_bytes=²", "--address", ADDRESS)


def test_the_printed_login_command_works_for_a_credential_that_begins_with_a_dash(runtime, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "_secret", lambda: "-dash-first-secret")
    run("tenants", "add", "acme", "--weight", "1", "--address", ADDRESS)
    assert printed_login(capsys.readouterr().out) == (ADDRESS, "acme", "-dash-first-secret")


def test_without_the_admin_credential_nothing_is_asked(runtime, capsys):
    secrets.admin_path().unlink()
    with pytest.raises(CliError, match=r"`pathways tenants list` needs the cluster's admin credential: .*admin.token"
                                       r" does not exist .*pass --admin-credential-file FILE"):
        run("tenants", "list", "--address", ADDRESS)
    assert runtime.connected == []


def test_an_admin_credential_file_that_is_not_there_is_named(runtime, tmp_path):
    with pytest.raises(CliError, match=r"--admin-credential-file .*nope: no such file \(or it is empty\)"):
        run("tenants", "list", "--address", ADDRESS, "--admin-credential-file", str(tmp_path / "nope"))
    other = tmp_path / "other-admin"
    other.write_text("another-admin-secret\n")
    run("tenants", "list", "--address", ADDRESS, "--admin-credential-file", str(other))
    assert runtime.connected == [(ADDRESS, "another-admin-secret")]


def test_a_runtime_that_cannot_be_reached_is_a_one_line_error(runtime):
    runtime.refuse_connect = "nothing answers at pathways://127.0.0.1:47001"
    with pytest.raises(CliError, match="^nothing answers at pathways://127.0.0.1:47001$"):
        run("tenants", "list", "--address", ADDRESS)


def test_what_the_runtime_refuses_is_a_one_line_error_and_no_credential_is_saved(runtime):
    run("tenants", "add", "acme", "--weight", "1", "--address", ADDRESS)
    secrets.credential_path("acme").unlink()
    with pytest.raises(CliError, match="^tenant 'acme' already exists; `pathways tenants set` changes it$"):
        run("tenants", "add", "acme", "--weight", "1", "--address", ADDRESS)
    assert not secrets.credential_path("acme").exists()


def test_list_shows_every_tenant_as_a_table_or_json(runtime, capsys):
    assert run("tenants", "list", "--address", ADDRESS) == 0
    assert capsys.readouterr().out.strip() == "no tenants: add one with `pathways tenants add`"
    run("tenants", "add", "acme", "--weight", "2", "--quota", "4", "--address", ADDRESS)
    run("tenants", "add", "beta", "--weight", "1.5", "--job-user", "bjobs", "--address", ADDRESS)
    capsys.readouterr()
    run("tenants", "list", "--address", ADDRESS)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES", "JOB", "USER"]
    assert lines[1].split() == ["acme", "2", "4", "0", "0", "pw-acme"]
    assert lines[2].split() == ["beta", "1.5", "-", "0", "0", "bjobs"]
    run("tenants", "list", "--json", "--address", ADDRESS)
    assert [t["name"] for t in json.loads(capsys.readouterr().out)] == ["acme", "beta"]


def test_set_changes_only_what_is_named(runtime, capsys):
    run("tenants", "add", "acme", "--weight", "2", "--quota", "4", "--address", ADDRESS)
    capsys.readouterr()
    assert run("tenants", "set", "acme", "--weight", "3", "--address", ADDRESS) == 0
    assert runtime.requests[-1] == ("set", "acme", 3.0, UNSET, False, {}, None)  # the quota is kept
    assert capsys.readouterr().out.strip() == "changed tenant acme: weight 3, quota 4"
    run("tenants", "set", "acme", "--no-quota", "--address", ADDRESS)
    assert runtime.requests[-1][3] is None
    assert "quota none" in capsys.readouterr().out
    run("tenants", "set", "acme", "--quota", "0", "--budget", "op_ms=9", "--address", ADDRESS)
    assert runtime.requests[-1][3] == 0 and runtime.requests[-1][5] == {"op_ms": 9}
    run("tenants", "set", "acme", "--job-user", "ajobs", "--address", ADDRESS)
    assert "its jobs run as OS user ajobs" in capsys.readouterr().out
    assert secrets.credential_path("acme").read_text().strip() == "secret-1"  # no new credential was asked for


def test_set_with_a_new_credential_hands_it_over_and_replaces_the_saved_one(runtime, capsys):
    run("tenants", "add", "acme", "--weight", "1", "--address", ADDRESS)
    capsys.readouterr()
    run("tenants", "set", "acme", "--new-credential", "--address", ADDRESS)
    out = capsys.readouterr().out
    assert "the old credential, its sessions and its jobs' unused tickets no longer work" in out
    assert printed_login(out) == (ADDRESS, "acme", "secret-2")
    assert secrets.credential_path("acme").read_text().strip() == "secret-2"


def test_set_of_an_unknown_tenant_is_the_runtimes_one_line_refusal(runtime):
    with pytest.raises(CliError, match="^no tenant 'ghost'$"):
        run("tenants", "set", "ghost", "--weight", "2", "--address", ADDRESS)


def test_remove_deletes_the_saved_credential_and_says_what_happens_to_a_made_user(runtime, capsys):
    run("tenants", "add", "acme", "--weight", "1", "--address", ADDRESS)
    capsys.readouterr()
    path = secrets.credential_path("acme")
    assert run("tenants", "remove", "acme", "--address", ADDRESS) == 0
    out = capsys.readouterr().out
    assert "removed tenant acme: its sessions ended, its jobs stop" in out
    assert "its OS user pw-acme stays, unused" in out and "`userdel pw-acme`" in out
    assert f"deleted its credential {path}" in out and not path.exists()
    assert runtime.tenants_by_name == {}


def test_remove_of_a_tenant_with_its_own_job_user_and_no_saved_credential(runtime, capsys):
    run("tenants", "add", "acme", "--weight", "1", "--job-user", "ajobs", "--address", ADDRESS)
    secrets.credential_path("acme").unlink()
    capsys.readouterr()
    run("tenants", "remove", "acme", "--address", ADDRESS)
    out = capsys.readouterr().out
    assert "userdel" not in out and "deleted its credential" not in out


def test_a_refused_remove_keeps_the_saved_credential(runtime):
    path = secrets.write_secret(secrets.credential_path("ghost"), "kept")
    with pytest.raises(CliError, match="^no tenant 'ghost'$"):
        run("tenants", "remove", "ghost", "--address", ADDRESS)
    assert path.read_text().strip() == "kept"


def test_as_admin_turns_a_refusal_into_a_cli_error_and_passes_results_through():
    assert tenants.as_admin(lambda a, b=0: a + b, 1, b=2) == 3

    def refused() -> None:
        raise ResourceError("over quota")

    with pytest.raises(CliError, match="^over quota$") as caught:
        tenants.as_admin(refused)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # one line, no chained traceback

    def bug() -> None:
        raise KeyError("a bug, not a refusal")

    with pytest.raises(KeyError):  # only the runtime's refusals become one-line errors
        tenants.as_admin(bug)
