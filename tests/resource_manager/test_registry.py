"""The tenant registry (resource_manager/registry.py): persisted readable by its owner only, surviving a
reload, weights finite and positive, names and quotas checked, only digests stored, and one error for an
unknown tenant or a wrong credential."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

import pathways as pw
from pathways import auth
from pathways.budgets import Budgets
from resource_manager.registry import WRONG, Registry

ADMIN = "the-admin-credential"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "state" / "registry.json"


def brief(registry: Registry) -> list[dict]:
    """Each tenant's name, weight and quota (its budgets are tested on their own)."""
    return [{k: t[k] for k in ("name", "weight", "quota")} for t in registry.listing()]


def test_the_registry_file_is_readable_by_its_owner_only_and_rewritten_whole(path):
    registry = Registry(str(path), auth.digest(ADMIN))
    assert path.exists() and mode(path) == 0o600 and mode(path.parent) == 0o700
    registry.add("alice", weight=2.0)
    assert mode(path) == 0o600 and sorted(os.listdir(path.parent)) == ["registry.json"]  # no temporary left


def test_the_registry_survives_a_reload(path):
    registry = Registry(str(path), auth.digest(ADMIN), default_quota=4)
    alice = registry.add("alice", weight=2.0, quota=2)
    bob = registry.add("bob", weight=0.5)
    registry.set("alice", weight=3.0)
    again = Registry(str(path), None)  # a restarted runtime: the file has the admin and the tenants
    assert brief(again) == [{"name": "alice", "weight": 3.0, "quota": 2}, {"name": "bob", "weight": 0.5, "quota": 4}]
    assert again.authenticate("alice", alice).name == "alice" and again.authenticate("bob", bob).weight == 0.5
    assert again.is_admin(ADMIN) and not again.is_admin(alice) and again.default_quota == 4


def test_only_digests_of_credentials_are_stored(path):
    registry = Registry(str(path), auth.digest(ADMIN))
    secret = registry.add("alice")
    text = path.read_text()
    assert secret not in text and ADMIN not in text
    assert json.loads(text)["tenants"][0]["credential"] == auth.digest(secret)


def test_a_registry_without_a_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    registry = Registry(None, auth.digest(ADMIN))
    registry.add("alice")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("weight", [0, -1.0, math.nan, math.inf, -math.inf, 1e6 + 1, True, "2", None])
def test_a_weight_must_be_finite_and_positive(weight):
    registry = Registry(None, None)
    with pytest.raises(pw.ResourceError, match="a weight must be a finite number"):
        registry.add("alice", weight=weight)
    registry.add("bob", weight=1.0)
    if weight is not None:  # None leaves the weight as it is
        with pytest.raises(pw.ResourceError, match="a weight must be a finite number"):
            registry.set("bob", weight=weight)
    assert brief(registry) == [{"name": "bob", "weight": 1.0, "quota": None}]


@pytest.mark.parametrize("weight", [1e-9, 1, 2.5, 1e6])
def test_finite_positive_weights_are_kept_as_floats(weight):
    registry = Registry(None, None)
    registry.add("alice", weight=weight)
    assert registry.get("alice").weight == float(weight) and isinstance(registry.get("alice").weight, float)


@pytest.mark.parametrize("name", ["", "bad name", "../admin", "-lead", ".hidden", "a" * 64, "é", 5, None, "a/b"])
def test_a_tenant_name_is_checked(name):
    with pytest.raises(pw.ResourceError, match="tenant name"):
        Registry(None, None).add(name)


@pytest.mark.parametrize("name", ["a", "A.b_c-1", "9lives", "a" * 63])
def test_names_of_letters_digits_dots_dashes_and_underscores_are_accepted(name):
    registry = Registry(None, None)
    registry.add(name)
    assert registry.get(name) is not None


@pytest.mark.parametrize("quota", [-1, 1.5, True, "2"])
def test_a_quota_is_a_whole_number_of_devices_or_none(quota):
    with pytest.raises(pw.ResourceError, match="a quota is a whole number of devices"):
        Registry(None, None).add("alice", quota=quota)


def test_the_default_quota_applies_when_none_is_given_and_set_can_lift_it():
    registry = Registry(None, None, default_quota=8)
    registry.add("alice")
    registry.add("bob", quota=2)
    assert [t["quota"] for t in registry.listing()] == [8, 2]
    registry.set("alice", quota=None)
    registry.set("bob", weight=2.0)  # the quota stays as it was
    assert [t["quota"] for t in registry.listing()] == [None, 2]


@pytest.mark.parametrize("name, credential", [("alice", "guessed"), ("nobody", "guessed"), ("alice", None),
                                              (None, "x"), (["alice"], "x"), ("alice", b"bytes")])
def test_an_unknown_tenant_and_a_wrong_credential_get_the_same_error(name, credential):
    registry = Registry(None, None)
    registry.add("alice")
    with pytest.raises(pw.TenantAccessError) as info:
        registry.authenticate(name, credential)
    assert str(info.value) == WRONG


def test_a_new_credential_replaces_the_old_one():
    registry = Registry(None, None)
    old = registry.add("alice")
    new = registry.set("alice", new_credential=True)
    assert new != old and registry.authenticate("alice", new).name == "alice"
    with pytest.raises(pw.TenantAccessError):
        registry.authenticate("alice", old)


def test_a_client_may_register_with_the_digest_of_its_own_credential():
    registry = Registry(None, None)
    assert registry.add("me", digest=auth.digest("my secret")) is None  # nothing to show: the client has it
    assert registry.authenticate("me", "my secret").name == "me"


def test_adding_an_existing_tenant_or_changing_a_missing_one_is_refused():
    registry = Registry(None, None)
    registry.add("alice")
    with pytest.raises(pw.ResourceError, match="tenant 'alice' already exists"):
        registry.add("alice")
    for change in (lambda: registry.set("bob", weight=2.0), lambda: registry.remove("bob")):
        with pytest.raises(pw.ResourceError, match="no tenant 'bob'"):
            change()
    registry.remove("alice")
    assert registry.listing() == [] and registry.get("alice") is None


def test_the_admin_is_whoever_holds_the_admin_credential():
    registry = Registry(None, auth.digest(ADMIN))
    assert registry.is_admin(ADMIN)
    assert not registry.is_admin("not it") and not registry.is_admin(None) and not registry.is_admin(ADMIN.encode())
    assert not Registry(None, None).is_admin(ADMIN)  # no admin digest: nobody is the admin


def test_the_listing_shows_no_credentials_and_is_sorted():
    registry = Registry(None, None)
    for name in ("carol", "alice", "bob"):
        registry.add(name)
    listing = registry.listing()
    assert [t["name"] for t in listing] == ["alice", "bob", "carol"]
    assert all(set(t) == {"name", "weight", "quota", "budgets", "job_user", "job_user_made"} for t in listing)
    assert all(t["budgets"] == Budgets().to_wire() for t in listing)  # every budget, at its default


def test_budgets_are_the_admins_checked_and_kept_across_a_reload(tmp_path):
    path = tmp_path / "registry.json"
    registry = Registry(str(path), None)
    registry.add("alice", budgets={"host_bytes": 1 << 20})
    with pytest.raises(pw.ResourceError, match="no budget named 'bytes'"):
        registry.add("bob", budgets={"bytes": 5})
    with pytest.raises(pw.ResourceError, match="budget sessions must be a whole number"):
        registry.set("alice", budgets={"sessions": -1})
    registry.set("alice", budgets={"sessions": 2})
    again = Registry(str(path), None).get("alice").limits
    assert (again.host_bytes, again.sessions, again.pending_fetches) == (1 << 20, 2, Budgets().pending_fetches)
    assert Registry(str(path), None).get("bob") is None  # a refused add leaves nothing behind


def test_whoami_says_whether_a_credential_is_the_admins_or_the_tenants_and_nothing_else():
    registry = Registry(None, auth.digest(ADMIN))
    secret = registry.add("alice")
    assert registry.whoami("anyone", ADMIN) == {"admin": True, "tenant": None}
    assert registry.whoami("alice", secret) == {"admin": False, "tenant": "alice"}
    for name, credential in (("alice", "guessed"), ("bob", secret), (None, secret), ("alice", None)):
        with pytest.raises(pw.TenantAccessError, match=WRONG.split(";")[0]):
            registry.whoami(name, credential)
