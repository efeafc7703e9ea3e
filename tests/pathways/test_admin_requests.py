"""The admin's typed requests: each declared once, sent as ``AdminOp``'s (op, args), built back typed and checked."""

from __future__ import annotations

import dataclasses

import pytest

from pathways import admin_requests as ar
from pathways import wire
from pathways.errors import PathwaysError, ResourceError, WireFormatError
from pathways.requests import AdminOp

EVERY = [ar.TenantList(), ar.TenantAdd("alice", 2.0, 4, {"host_bytes": 1 << 20}, "alice-jobs"),
         ar.TenantSet("alice", weight=3.0, quota=None, new_credential=True, budgets={"op_ms": 5}),
         ar.TenantRemove("alice"), ar.Reclaim(tenant="alice"), ar.Reclaim(client=7),
         ar.MarkIsland(1, False, "maintenance"), ar.Schedules(), ar.HostCounters(),
         ar.ProbeNetwork([0, 0], [1, 0], 1 << 20), ar.TenantUsage(), ar.WholeState(), ar.Suspend("/tmp/x", 30.0),
         ar.Resume(None, None)]


def test_every_operation_is_declared_once_and_each_round_trips_through_the_admin_message():
    assert sorted({type(r).OP for r in EVERY}) == ar.operations()
    for request in EVERY:
        op, args = ar.to_wire(request)
        message = wire.parse(AdminOp(9, "credential", op, args).encode(), AdminOp)
        assert ar.from_wire(message.op, message.args) == request


def test_the_wire_form_is_the_operation_name_and_its_fields_by_name():
    assert ar.to_wire(ar.TenantAdd("bob")) == ("tenant_add", {"name": "bob", "weight": 1.0, "quota": None,
                                                              "budgets": {}, "job_user": None})
    assert ar.to_wire(ar.Suspend("/d", 5.0)) == ("suspend", {"dir": "/d", "timeout": 5.0})


def test_a_quota_left_as_it_is_stays_out_of_the_message_and_none_lifts_it():
    op, args = ar.to_wire(ar.TenantSet("alice"))
    assert op == "tenant_set" and "quota" not in args
    assert ar.from_wire(op, args).quota == ar.KEEP
    assert ar.from_wire(*ar.to_wire(ar.TenantSet("alice", quota=None))).quota is None
    assert ar.to_wire(ar.TenantSet(ar.KEEP))[1]["name"] == ar.KEEP  # only the quota's "keep" is left out


def test_fields_with_defaults_may_be_left_out():
    assert ar.from_wire("mark", {"island": 0, "healthy": True}) == ar.MarkIsland(0, True, "")
    assert ar.from_wire("reclaim", {}) == ar.Reclaim(None, None)


def test_an_unknown_operation_is_refused_naming_the_known_ones():
    with pytest.raises(ResourceError, match=r"unknown admin operation 'drop_tables'; known: host_stats, mark, "):
        ar.from_wire("drop_tables", {})
    with pytest.raises(ResourceError, match="unknown admin operation 5"):
        ar.from_wire(5, {})


@pytest.mark.parametrize(("op", "args", "says"), [
    ("state", {"name": "x"}, r"admin state: no field 'name'; its fields are none"),
    ("tenant_remove", {}, r"admin tenant_remove: missing field 'name'"),
    ("mark", {"island": "0", "healthy": True}, r"admin mark.island: expected int, got str"),
    ("mark", {"island": 0, "healthy": 1}, r"admin mark.healthy: expected bool, got int"),
    ("tenant_add", {"name": "a", "weight": True}, r"admin tenant_add.weight: expected float, got bool"),
    ("tenant_add", {"name": "a", "budgets": ["x"]}, r"admin tenant_add.budgets: expected a map"),
    ("reclaim", {"client": 1.5}, r"admin reclaim.client: expected int, got float"),
    ("probe_network", {"src": [0], "dst": [0, 0], "nbytes": 1}, r"an end is \[island, host\], got \[0\]"),
    ("probe_network", {"src": [0, -1], "dst": [0, 0], "nbytes": 1}, r"an end is \[island, host\], got \[0, -1\]"),
    ("suspend", {"dir": 5}, r"admin suspend.dir: expected str, got int"),
    ("tenants", ["x"], r"admin tenants: its fields come as a map, not list"),
])
def test_a_bad_field_is_refused_naming_it(op, args, says):
    with pytest.raises(WireFormatError, match=says):
        ar.from_wire(op, args)


@pytest.mark.parametrize("timeout", [0, -1.0, 86400.5, float("nan"), float("inf")])
def test_a_suspend_or_resume_timeout_is_a_sane_number_of_seconds(timeout):
    for op in ("suspend", "resume"):
        with pytest.raises(PathwaysError, match="a timeout is a number of seconds between 0 and 86400"):
            ar.from_wire(op, {"timeout": timeout})


def test_a_bad_request_fails_where_it_is_made_before_it_is_sent():
    with pytest.raises(WireFormatError, match="admin mark.island"):
        ar.to_wire(ar.MarkIsland("0", True))  # type: ignore[arg-type]


def test_requests_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ar.TenantRemove("a").name = "b"  # type: ignore[misc]


def test_an_operation_cannot_be_declared_twice_nor_with_fields_its_schema_lacks():
    with pytest.raises(ValueError, match="declared twice"):
        ar.admin_request("state", {})(type("Again", (), {}))
    with pytest.raises(TypeError, match="differ from its schema"):
        ar.admin_request("novel", {"a": int})(type("Novel", (), {"__annotations__": {"b": "int"}}))
