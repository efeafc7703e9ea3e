"""The resource manager's parts, wired as ``ResourceManager`` wires them, over real island hosts that this test
starts on the session cluster's Ray (without the manager's watches, so that each step happens when the test says):
``Fleet`` (hosts, signed orders and calls, restarts), ``IslandHealth`` (failures found, islands back in service),
``Slices`` (placement within quotas), ``Sessions`` (what every host is told of them), ``ClusterView`` (what each
tenant sees) and ``AdminOps`` (the admin's typed requests, each through its one handler).

What a host was told is read the way an attacker would find out: a connection proven with a session's key is
accepted by the host only while the host holds that session.
"""

from __future__ import annotations

import time

import pytest

from pathways import admin_requests as ar
from pathways import auth
from pathways.errors import ClusterSuspendedError, PathwaysError, ResourceError, TenantAccessError
from pathways.protocol.connection import connect
from pathways.topology import Topology
from resource_manager.admin import AdminOps
from resource_manager.fleet import Fleet
from resource_manager.health import IslandHealth
from resource_manager.notices import Notices
from resource_manager.phase import RUNNING, SUSPENDED, ClusterPhase
from resource_manager.registry import WRONG, Registry
from resource_manager.sessions import Sessions
from resource_manager.slices import Slices
from resource_manager.suspension import Suspension
from resource_manager.tickets import Tickets
from resource_manager.view import ClusterView, cluster_state

ADMIN = "the-admin-credential"
WAIT_S = 60.0


class Parts:
    """The parts over one fleet of 2 islands x 1 host x 2 devices."""

    def __init__(self) -> None:
        topology = Topology(islands=2, hosts_per_island=1, devices_per_host=2)
        self.phase = ClusterPhase()
        self.registry = Registry(None, auth.digest(ADMIN))
        self.tickets = Tickets()
        self.fleet = Fleet(topology, auth.new_key(), "parts-test", 30.0, 5.0, 180.0)
        self.health = IslandHealth(self.fleet, self.phase)
        self.slices = Slices(topology, self.fleet, self.health)
        self.sessions = Sessions(self.registry, self.tickets, self.slices, self.fleet, self.health, self.phase, 30.0)
        self.notices = Notices(lambda: cluster_state(self.phase, self.health))
        self.suspension = Suspension(self.phase, self.fleet, self.health, self.sessions, self.slices, self.notices)
        self.view = ClusterView(topology, "parts-test", time.time(), None, self.registry, self.sessions,
                                self.slices, self.health, self.tickets, self.phase, self.suspension)
        self.admin = AdminOps(self.registry, self.sessions, self.health, self.fleet, self.suspension, self.view,
                              None, 30.0)

    def run(self, request: object, credential: str = ADMIN) -> object:
        return self.admin.run(credential, *ar.to_wire(request))


@pytest.fixture(scope="module")
def parts(cluster):
    import ray

    from resource_manager.launch import enable_token_auth

    enable_token_auth()
    ray.init(address=cluster.embedded.ray_address, namespace="manager-parts-test", logging_level="ERROR")
    try:
        made = Parts()
        yield made
        made.fleet.stop_all()
    finally:
        ray.shutdown()  # the hosts and placement groups this driver made go with it


def accepted(parts: Parts, island: int, client: int, key: bytes) -> bool:
    """Whether the host of ``island`` accepts a connection proven as ``client`` with ``key``."""
    address = parts.fleet.island(island).host_info[0]["client"]
    try:
        connect(address, client, key, lambda identity: None, 1 << 20, 1 << 20).close()
        return True
    except TenantAccessError:
        return False


def eventually(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {WAIT_S:.0f}s: {what}")
        time.sleep(0.1)


def tenant(parts: Parts, name: str, quota: int | None = None) -> str:
    """A new credential of tenant ``name`` (added now, or its credential rotated: its sessions end)."""
    if any(t["name"] == name for t in parts.run(ar.TenantList())):
        return parts.run(ar.TenantSet(name, quota=quota, new_credential=True))["credential"]
    return parts.run(ar.TenantAdd(name, quota=quota))["credential"]


# -- Fleet --------------------------------------------------------------------------------------------------

def test_the_fleet_starts_every_island_and_signs_each_call_for_the_one_host_it_goes_to(parts):
    islands = parts.fleet.islands()
    assert [(i.index, i.epoch, len(i.hosts)) for i in islands] == [(0, 0, 1), (1, 0, 1)]
    assert parts.fleet.hosts(islands) == [(0, 0, islands[0].hosts[0]), (1, 0, islands[1].hosts[0])]
    counts = parts.fleet.call("census", lambda i, k: (), 30.0)
    assert counts == [{}, {}]  # every host answered a call signed for it: nothing held yet
    import ray

    with pytest.raises(Exception, match="TenantAccessError"):  # island 0's MAC does not open island 1's host
        ray.get(islands[1].hosts[0].census.remote(parts.fleet.sign(0, 0, "census")), timeout=30)


# -- Sessions, Slices, Tickets ------------------------------------------------------------------------------

def test_an_open_session_is_known_to_every_healthy_host_and_forgotten_by_them_when_it_closes(parts):
    credential = tenant(parts, "alice", quota=3)
    client, key, record = parts.sessions.open("alice", credential, None, 1234, None)
    assert record.name == "alice" and parts.sessions.tenant_of(client) == "alice"
    assert accepted(parts, 0, client, key) and accepted(parts, 1, client, key)
    assert not accepted(parts, 0, client, auth.new_key())  # the key, not the id, proves the session
    assert parts.sessions.caller(client)[:2] == (key, "alice")
    parts.sessions.close(client)
    assert parts.sessions.caller(client) is None
    with pytest.raises(TenantAccessError, match="this session has ended"):
        parts.sessions.renew(client)
    eventually(lambda: not accepted(parts, 0, client, key) and not accepted(parts, 1, client, key),
               "the hosts refuse a closed session")


def test_a_session_needs_the_tenants_credential_or_its_jobs_ticket_once(parts):
    tenant(parts, "alice")
    with pytest.raises(TenantAccessError, match=WRONG.split(";")[0]):
        parts.sessions.open("alice", "guessed", None, 1, None)
    ticket = parts.tickets.issue("alice", "job-7")
    client, key, record = parts.sessions.open("nobody-checks-this-name", None, ticket, 1, "job-7")
    assert record.name == "alice"  # the ticket says the tenant, not the message
    with pytest.raises(TenantAccessError, match="already used"):
        parts.sessions.open("alice", None, ticket, 1, "job-7")
    parts.sessions.close(client)


def test_slices_are_placed_within_the_quota_and_only_their_tenant_releases_them(parts):
    alice = parts.sessions.open("alice", tenant(parts, "alice", quota=3), None, 1, None)[0]
    bob_credential = tenant(parts, "bob")
    bob = parts.sessions.open("bob", bob_credential, None, 1, None)[0]
    first = parts.sessions.allocate(alice, (2,), ("x",), None)
    second = parts.sessions.allocate(alice, (1,), ("x",), None)
    assert first["island"] != second["island"]  # the least loaded island
    with pytest.raises(ResourceError, match="holds 3 of its quota of 3 devices"):
        parts.sessions.allocate(alice, (1,), ("x",), None)
    with pytest.raises(ResourceError, match=f"you hold no slice '{first['key']}'"):
        parts.sessions.release(bob, first["key"])
    with pytest.raises(ResourceError, match="on island 5, which does not exist"):
        parts.sessions.allocate(bob, (1,), ("x",), 5)
    parts.sessions.release(alice, first["key"])
    assert [a.key for a in parts.slices.listing()] == [second["key"]]
    parts.sessions.close(alice)  # its slices go with it
    parts.sessions.close(bob)
    assert parts.slices.listing() == []


def test_nothing_is_opened_or_placed_while_the_cluster_is_not_running(parts):
    client = parts.sessions.open("bob", tenant(parts, "bob"), None, 1, None)[0]
    parts.phase.move(SUSPENDED)
    try:
        with pytest.raises(ClusterSuspendedError, match="placing a slice: the cluster is suspended"):
            parts.sessions.allocate(client, (1,), ("x",), None)
        with pytest.raises(ClusterSuspendedError, match="opening a session"):
            parts.sessions.open("bob", "whatever", None, 1, None)
    finally:
        parts.phase.move(RUNNING)
    parts.sessions.close(client)


# -- AdminOps and ClusterView -------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ar.operations() + ["no_such_op"])
def test_every_admin_request_needs_the_admin_credential_before_anything_of_it_is_read(parts, op):
    with pytest.raises(TenantAccessError, match="needs the cluster's admin credential"):
        parts.admin.run("guessed", op, {"name": "hostile", "weight": 1e6})
    with pytest.raises(TenantAccessError):
        parts.admin.run(None, op, {})


def test_the_admin_requests_are_typed_on_the_way_in(parts):
    with pytest.raises(ResourceError, match="unknown admin operation 'drop'; known: host_stats, mark"):
        parts.admin.run(ADMIN, "drop", {})
    with pytest.raises(PathwaysError, match="admin mark.island: expected int"):
        parts.admin.run(ADMIN, "mark", {"island": "0", "healthy": False})
    with pytest.raises(ResourceError, match="no island 7"):
        parts.run(ar.MarkIsland(7, False))
    tenant(parts, "bob")
    with pytest.raises(ResourceError, match="a weight must be a finite number"):
        parts.run(ar.TenantSet("bob", weight=-1.0))
    with pytest.raises(ResourceError, match="no host 3 on island 0"):
        parts.run(ar.ProbeNetwork([0, 3], [1, 0], 10))
    with pytest.raises(PathwaysError, match="name the directory to suspend into"):
        parts.run(ar.Suspend())


def test_a_rotated_credential_ends_the_tenants_sessions_and_unused_tickets(parts):
    credential = tenant(parts, "bob")
    client, key, _ = parts.sessions.open("bob", credential, None, 1, None)
    ticket = parts.tickets.issue("bob", "job-9")
    assert parts.run(ar.TenantSet("bob", new_credential=True))["credential"] != credential
    assert parts.sessions.caller(client) is None
    assert parts.sessions.reclaimed()[-1]["why"] == "its credential was rotated"
    with pytest.raises(TenantAccessError, match="already used"):
        parts.sessions.open("bob", None, ticket, 1, "job-9")
    with pytest.raises(TenantAccessError):
        parts.sessions.open("bob", credential, None, 1, None)
    eventually(lambda: not accepted(parts, 0, client, key), "the hosts refuse the rotated tenant's session")


def test_each_tenant_sees_its_own_by_name_and_the_others_as_counts_and_the_admin_sees_all(parts):
    carol = parts.sessions.open("carol", tenant(parts, "carol"), None, 42, "train")[0]
    dave = parts.sessions.open("dave", tenant(parts, "dave"), None, 43, None)[0]
    parts.sessions.allocate(dave, (2,), ("x",), 0)
    ticket = parts.tickets.issue("dave", "job-5")
    with pytest.raises(TenantAccessError, match="belongs to another job"):
        parts.sessions.open("dave", None, ticket, 1, "job-6")
    mine = parts.view.state(parts.sessions.tenant_of(carol))
    assert list(mine["clients"].values()) == [{"tenant": "carol", "pid": 42, "since": mine["clients"][str(carol)]
                                               ["since"], "job": "train"}]
    assert mine["allocations"] == [] and mine["others"]["slices"] == 1 and mine["others"]["devices"] == 2
    assert set(mine["tenants"]) == {"carol"} and mine["refusals"] == [] and "pid" not in mine["cluster"]
    whole = parts.run(ar.WholeState())
    assert {"carol", "dave"} <= set(whole["tenants"]) and whole["tenants"]["dave"]["devices"] == 2
    assert whole["tenants"]["dave"]["clients"] == 1 and whole["cluster"]["state"] == "running"
    assert whole["refusals"][-1]["by_job"] == "job-6" and whole["refusals"][-1]["job"] == "job-5"
    listing = {t["name"]: t for t in parts.run(ar.TenantList())}
    assert listing["carol"]["clients"] == 1 and listing["dave"]["devices"] == 2
    assert [r["client"] for r in parts.run(ar.Reclaim(tenant="dave"))] == [dave]
    assert parts.slices.listing() == [] and parts.sessions.reclaimed()[-1]["why"] == "reclaimed by the admin"
    parts.run(ar.TenantRemove("carol"))
    assert parts.sessions.caller(carol) is None and "carol" not in parts.view.state(None)["tenants"]


def test_the_admin_reads_every_hosts_counters_and_each_islands_schedule_and_usage(parts):
    stats = parts.run(ar.HostCounters())
    assert [len(row) for row in stats] == [1, 1] and all(isinstance(s, dict) for row in stats for s in row)
    assert len(parts.run(ar.Schedules())) == 2
    assert set(parts.run(ar.TenantUsage())) <= {"0", "1"}


# -- IslandHealth, with a restart as ResourceManager runs it -------------------------------------------------

def test_an_island_marked_out_takes_no_slices_until_it_is_put_back(parts):
    client = parts.sessions.open("bob", tenant(parts, "bob"), None, 1, None)[0]
    parts.run(ar.MarkIsland(0, False, "maintenance"))
    assert parts.health.unhealthy() == {0: "maintenance"} and [i.index for i in parts.health.healthy()] == [1]
    assert {parts.sessions.allocate(client, (1,), ("x",), None)["island"] for _ in range(2)} == {1}
    with pytest.raises(ResourceError, match="on island 0, which is unhealthy \\(maintenance\\)"):
        parts.sessions.allocate(client, (1,), ("x",), 0)
    parts.run(ar.MarkIsland(0, True))
    assert parts.health.unhealthy() == {} and parts.view.cluster_state()["islands"][0]["healthy"]
    parts.sessions.close(client)


def test_a_dead_host_fails_its_island_once_and_the_restarted_island_learns_every_session_and_slice(parts):
    import ray

    client, key, _ = parts.sessions.open("bob", tenant(parts, "bob"), None, 1, None)
    placed = parts.sessions.allocate(client, (1,), ("x",), 1)
    assert parts.health.check() == []
    old = parts.fleet.island(1)
    ray.kill(old.hosts[0], no_restart=True)
    failures: list = []
    deadline = time.monotonic() + WAIT_S
    while not failures and time.monotonic() < deadline:
        failures = parts.health.check(only=1)
    (island, reason, lost), = failures
    assert island is old and "host 0" in reason and parts.health.unhealthy()[1] == reason
    assert parts.health.restarting() == {1} and parts.health.check(only=1) == []  # failed once, restarting now
    with pytest.raises(ResourceError, match="which is unhealthy"):
        parts.sessions.allocate(client, (1,), ("x",), 1)
    new = parts.fleet.restart(island, 180.0)  # what ResourceManager._restart does, step by step
    parts.fleet.install(new)
    parts.fleet.tell_peers([*parts.health.healthy(), new])
    assert not accepted(parts, 1, client, key)  # new hosts know no session yet
    parts.sessions.welcome(new, reason, lost)
    assert new.epoch == 1 and parts.fleet.island(1) is new and parts.health.unhealthy() == {}
    assert parts.health.restarting() == set() and parts.health.restarts()[-1]["epoch"] == 1
    assert accepted(parts, 1, client, key) and accepted(parts, 0, client, key)
    assert [a.key for a in parts.slices.listing()] == [placed["key"]]
    assert parts.view.cluster_state()["islands"][1]["epoch"] == 1
    parts.sessions.close(client)
