"""``pathways login`` and ``logout`` (``command.login``) without a runtime: the connection to the resource
manager is a small stand-in that answers ``WhoAmI`` from a real tenant registry (``resource_manager.registry``),
as the resource manager does; what the command checks, refuses and saves is real."""

from __future__ import annotations

import argparse
import json
import os
import stat

import pytest

from client.runtime import Login, load_login, login_path, save_login
from command import login
from command.login import cmd_login, cmd_logout
from command.output import CliError
from command.parser import parser
from pathways import auth
from pathways.errors import PathwaysError
from pathways.requests import WhoAmI
from resource_manager.registry import Registry

ADDRESS = "pathways://127.0.0.1:47001"
ADMIN = "the-admin-credential"
SECRETS = {"acme": "acme-credential", "beta": "beta-credential"}  # fixed: a random one may begin with '-'


class Runtime:
    """The resource manager's side of the link: a real registry, and what each connection asked."""

    def __init__(self) -> None:
        self.registry = Registry(None, auth.digest(ADMIN))
        for name, secret in SECRETS.items():
            self.registry.add(name, 1.0, digest=auth.digest(secret))
        self.secret = SECRETS["acme"]
        self.links: list[Link] = []
        self.unreachable: str | None = None


class Link:
    """Stands in for ``client.link.Link`` to the resource manager at ``address``."""

    runtime: Runtime

    def __init__(self, address: str, session: int, key: bytes | None, expect, what: str) -> None:
        if self.runtime.unreachable:
            raise PathwaysError(self.runtime.unreachable)
        self.address, self.session, self.key, self.what = address, session, key, what
        self.requests: list[WhoAmI] = []
        self.closed = False
        self.runtime.links.append(self)

    def call(self, make, timeout: float) -> dict:
        request = make(len(self.requests) + 1)
        self.requests.append(request)
        assert isinstance(request, WhoAmI) and timeout > 0
        return self.runtime.registry.whoami(request.tenant, request.credential)  # TenantAccessError as it raises

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def runtime(monkeypatch, tmp_path) -> Runtime:
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    rt = Runtime()
    monkeypatch.setattr(Link, "runtime", rt, raising=False)
    monkeypatch.setattr(login, "Link", Link)
    return rt


def args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["login", *argv])


def test_a_tenants_credential_is_checked_then_saved_for_this_user_only(runtime, capsys):
    assert cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", runtime.secret)) == 0
    [link] = runtime.links
    assert link.address == ADDRESS and link.session == 0 and link.key is None and link.closed
    assert [(r.tenant, r.credential) for r in link.requests] == [("acme", runtime.secret)]
    assert load_login() == Login(ADDRESS, "acme", runtime.secret)
    path = login_path()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    out = capsys.readouterr().out
    assert f"logged in to {ADDRESS} as acme; saved in {path} (readable by you only)" in out


def test_the_credential_may_come_from_a_file(runtime, tmp_path):
    file = tmp_path / "cred"
    file.write_text(f"  {runtime.secret}\n")
    cmd_login(args(ADDRESS, "--tenant", "acme", "--credential-file", str(file)))
    assert load_login().credential == runtime.secret


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_a_credential_file_that_is_missing_or_empty_is_named(runtime, tmp_path, content):
    file = tmp_path / "cred"
    if content is not None:
        file.write_text(content)
    with pytest.raises(CliError, match=f"--credential-file {file}: no such file \\(or it is empty\\)"):
        cmd_login(args(ADDRESS, "--tenant", "acme", "--credential-file", str(file)))
    assert runtime.links == [] and not login_path().exists()


@pytest.mark.parametrize("tenant", ["", "bad name", "-dash", "a" * 64, "../up"])
def test_an_invalid_tenant_name_is_refused_before_anything_is_asked(runtime, tenant):
    with pytest.raises(CliError, match="use 1-63 letters, digits"):
        cmd_login(args(ADDRESS, f"--tenant={tenant}", "--credential", "x"))
    assert runtime.links == []


def test_a_wrong_credential_is_refused_with_the_runtimes_reason_and_nothing_is_saved(runtime):
    with pytest.raises(CliError, match=f"^login to {ADDRESS} as acme failed: ") as caught:
        cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", "not-the-secret"))
    assert "\n" not in str(caught.value) and caught.value.__cause__ is None
    with pytest.raises(CliError, match="as ghost failed"):  # an unknown tenant gets the same answer
        cmd_login(args(ADDRESS, "--tenant", "ghost", "--credential", runtime.secret))
    assert not login_path().exists()


def test_an_unreachable_runtime_is_a_one_line_error_and_an_earlier_login_is_kept(runtime):
    save_login(Login("pathways://10.0.0.1:1", "acme", "old"))
    runtime.unreachable = f"nothing answers at {ADDRESS}"
    with pytest.raises(CliError, match=f"^login to {ADDRESS} as acme failed: nothing answers at {ADDRESS}$"):
        cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", runtime.secret))
    assert load_login() == Login("pathways://10.0.0.1:1", "acme", "old")


def test_the_admin_credential_is_not_a_login(runtime):
    with pytest.raises(CliError, match="that is the admin credential; log in with a tenant's credential"):
        cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", ADMIN))
    assert not login_path().exists()


def test_logout_forgets_the_login_and_says_when_there_is_none(runtime, capsys):
    cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", runtime.secret))
    capsys.readouterr()
    assert cmd_logout(argparse.Namespace()) == 0
    assert f"forgot the login in {login_path()}" in capsys.readouterr().out
    assert not login_path().exists() and load_login() is None
    assert cmd_logout(argparse.Namespace()) == 0
    assert capsys.readouterr().out.strip() == "not logged in"


def test_a_second_login_replaces_the_first(runtime):
    other = SECRETS["beta"]
    cmd_login(args(ADDRESS, "--tenant", "acme", "--credential", runtime.secret))
    cmd_login(args("pathways://127.0.0.1:47002", "--tenant", "beta", "--credential", other))
    assert json.loads(login_path().read_text()) == {"address": "pathways://127.0.0.1:47002", "tenant": "beta",
                                                    "credential": other}
