"""``pathways status`` (``command.status``) without a runtime: who is asking decides the view (the admin's whole
cluster, else one tenant's), the table or JSON it prints, and one-line errors. The runtime's side (the admin
client's answers, a tenant session's ``pw.status``) is a stand-in: both are connections to another process."""

from __future__ import annotations

import json

import pytest

import client.admin
import pathways
from command import secrets
from command.output import CliError
from command.parser import parser
from command.status import cmd_status
from pathways.cluster import ClusterStatus, HostStatus, IslandStatus
from pathways.errors import PathwaysError, TenantAccessError
from pathways.topology import Topology

ADDRESS = "pathways://127.0.0.1:47001"
TOPOLOGY = Topology(1, 1, 2)


def whole_state(cluster_state: str = "running") -> dict:
    """The resource manager's ``WholeState`` answer for a one-island cluster with one slice of bob's."""
    return {
        "topology": TOPOLOGY.to_wire(),
        "islands": [{"index": 0, "healthy": True, "reason": "", "hosts": [
            {"island": 0, "host": 0, "node": "node0123456789abcdef", "devices": ["cpu:0", "cpu:1"]}]}],
        "allocations": [{"key": "s1", "shape": [2], "axes": ["x"], "island": 0, "tenant": "bob",
                         "devices": [[0, 0], [0, 1]], "client": 1}],
        "clients": {},
        "tenants": {"alice": {"weight": 1.0, "quota": None, "clients": 1, "devices": 0},
                    "bob": {"weight": 3.0, "quota": 2, "clients": 1, "devices": 2}},
        "cluster": {"state": cluster_state},
        "refusals": [{"at": 1.0, "job": "bob-1", "by_job": "alice-7"}],
    }


class AdminClient:
    """Stands in for ``client.admin.Admin``: the resource manager's answers, and who connected."""

    def __init__(self) -> None:
        self.connected: list[tuple[str, str, float]] = []
        self.refuse: PathwaysError | None = None
        self.cluster_state = "running"
        self.unreachable: PathwaysError | None = None

    def connect(self, address: str, credential: str, timeout: float = 60.0) -> AdminClient:
        if self.unreachable:
            raise self.unreachable
        self.connected.append((address, credential, timeout))
        return self

    def state(self) -> dict:
        if self.refuse:
            raise self.refuse
        return whole_state(self.cluster_state)

    def schedules(self) -> list[dict]:
        return [{"island": 0, "queued": 2, "tenant_time_s": {"alice": 1.0, "bob": 3.0}}]

    def host_stats(self) -> list[list[dict | None]]:
        return [[{"buffers": 3, "buffer_bytes": 3 << 20, "queue_depth": 1, "busy_s": 2.5, "busy_fraction": 0.4}]]


class TenantSession:
    """Stands in for ``pw.init`` / ``pw.status`` / ``pw.shutdown`` of a tenant's session."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.timeouts: list[float] = []
        self.shutdowns = 0
        self.refuse: PathwaysError | None = None

    def init(self, **kwargs) -> None:
        self.inits.append(kwargs)
        if self.refuse:
            raise self.refuse

    def status(self, timeout: float) -> ClusterStatus:
        self.timeouts.append(timeout)
        host = HostStatus(island=0, host=0, node="node0123456789abcdef", devices=["cpu:0", "cpu:1"], alive=True)
        island = IslandStatus(0, True, "", [host], tenant_time_s={"alice": 1.0}, others_time_s=3.0)
        return ClusterStatus(TOPOLOGY, [island], [], tenants={"alice": {"weight": 1.0, "quota": None, "clients": 1,
                                                                        "devices": 0}},
                             others={"tenants": 1, "slices": 1, "devices": 2})

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("PATHWAYS_HOME", str(tmp_path / "home"))
    for name in ("PATHWAYS_ADDRESS", "PATHWAYS_TENANT", "PATHWAYS_CREDENTIAL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def admin(home, monkeypatch) -> AdminClient:
    secrets.write_secret(secrets.admin_path(), "admin-secret")
    fake = AdminClient()
    monkeypatch.setattr(client.admin, "Admin", fake)
    return fake


@pytest.fixture
def session(home, monkeypatch) -> TenantSession:
    fake = TenantSession()
    for name in ("init", "status", "shutdown"):
        monkeypatch.setattr(pathways, name, getattr(fake, name))
    secrets.write_secret(secrets.credential_path("alice"), "alice-secret")
    return fake


def status(*argv: str) -> int:
    args = parser().parse_args(["status", "--address", ADDRESS, *argv])
    return cmd_status(args)


def test_the_admin_sees_the_whole_cluster_with_every_tenant_named(admin, capsys):
    assert status("--timeout", "7") == 0
    assert admin.connected == [(ADDRESS, "admin-secret", 7.0)]
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"cluster {ADDRESS}: {TOPOLOGY}; whole cluster (admin)"
    assert lines[3].split()[:5] == ["0", "healthy", "1/1", "2", "3"]  # queue: 2 at the scheduler + 1 on the host
    assert "alice 25% (1.0s), bob 75% (3.0s)" in lines[3]
    assert any(line.split()[:2] == ["bob", "3"] and line.endswith("s1(2,)@island0") for line in lines)
    assert "a second use of the ticket of job bob-1 (presented by job alice-7)" in out


def test_the_admins_json_is_the_whole_snapshot_with_its_view_and_refusals(admin, capsys):
    status("--json")
    got = json.loads(capsys.readouterr().out)
    assert got["view"] == "admin" and got["refusals"] == whole_state()["refusals"]
    assert [a["key"] for a in got["allocations"]] == ["s1"] and set(got["tenants"]) == {"alice", "bob"}
    assert got["islands"][0]["hosts"][0]["buffers"] == 3 and got["islands"][0]["queue_depth"] == 3


def test_a_suspended_cluster_says_so(admin, capsys):
    admin.cluster_state = "suspended"
    status()
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("whole cluster (admin); SUSPENDED")


def test_what_the_runtime_refuses_the_admin_is_a_one_line_error(admin):
    admin.refuse = TenantAccessError("the admin credential is wrong")
    with pytest.raises(CliError, match="^the admin credential is wrong$") as caught:
        status()
    assert caught.value.__cause__ is None


def test_a_runtime_the_admin_cannot_reach_is_a_one_line_error(admin):
    admin.unreachable = PathwaysError(f"nothing answers at {ADDRESS}")
    with pytest.raises(CliError, match=f"^nothing answers at {ADDRESS}$") as caught:
        status()
    assert caught.value.__cause__ is None


def test_a_tenant_sees_its_own_view_through_its_session(admin, session, capsys):
    assert status("--tenant", "alice", "--timeout", "9") == 0  # a named tenant wins over the admin credential
    assert admin.connected == []
    assert session.inits == [{"address": ADDRESS, "tenant": "alice", "credential": "alice-secret"}]
    assert session.timeouts == [9.0] and session.shutdowns == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"cluster {ADDRESS}: {TOPOLOGY}; your tenant's view"
    assert lines[-1] == "other tenants: 1, holding 1 slices (2 devices)"
    assert "refused at" not in "\n".join(lines)


def test_a_tenants_json_names_its_view_and_carries_no_refusals(session, capsys):
    status("--tenant", "alice", "--json")
    got = json.loads(capsys.readouterr().out)
    assert got["view"] == "tenant alice" and "refusals" not in got
    assert got["others"] == {"tenants": 1, "slices": 1, "devices": 2}


def test_a_refused_tenant_session_is_a_one_line_error_and_is_shut_down(session):
    session.refuse = TenantAccessError("wrong tenant or credential")
    with pytest.raises(CliError, match="^wrong tenant or credential$"):
        status("--tenant", "alice")
    assert session.shutdowns == 1 and session.timeouts == []


def test_without_any_credential_it_says_how_to_get_one(home):
    with pytest.raises(CliError, match=r"`pathways status` needs a tenant's credential \(`pathways login ADDRESS"):
        status()


def test_a_tenant_without_a_credential_is_told_the_same(home):
    with pytest.raises(CliError, match="`pathways status` needs a tenant's credential"):
        status("--tenant", "nobody")


def test_the_address_comes_from_the_environment_without_address(admin, monkeypatch, capsys):
    monkeypatch.setenv("PATHWAYS_ADDRESS", "pathways://127.0.0.1:47999")
    args = parser().parse_args(["status"])
    cmd_status(args)
    assert admin.connected[0][0] == "pathways://127.0.0.1:47999"
    assert capsys.readouterr().out.startswith("cluster pathways://127.0.0.1:47999:")
