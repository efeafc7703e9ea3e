"""The tenant registry: who may use the cluster, with what weight and device quota, proven by what secret.

The cluster's admin manages it (``pathways tenants ...``); the resource manager
holds it and is the only authority for tenants' weights and quotas: what a
client claims about them is never read. Only SHA-256 digests of credentials are
stored. With a path, the registry is a JSON file readable by its owner only,
rewritten atomically on every change, so it survives a restart of the runtime.
The embedded local cluster keeps it in memory, with one implicit tenant.

Each tenant's jobs run as an OS user of that tenant's own (``job_users``): one the admin names, or, for a
registry kept in a file by a runtime running as root, one it makes when the tenant is added (or at its first job,
for a tenant added before). No two tenants share one. A removed tenant's user is left in place, unused: deleting
it would let the system give its uid to a later user, who would own whatever files it left behind.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pathways import auth
from pathways.admin_requests import KEEP
from pathways.budgets import Budgets
from pathways.errors import ResourceError, TenantAccessError
from resource_manager import job_users

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_WEIGHT = 1e6
WRONG = "unknown tenant or wrong credential; ask the cluster's admin for a credential (pathways tenants add)"


@dataclass
class TenantRecord:
    """One tenant: name, weight, device quota, its credential's SHA-256 digest, and the OS user its jobs run as."""

    name: str
    weight: float
    quota: int | None  # devices the tenant's slices may take at once (None: no limit)
    credential: str  # SHA-256 digest
    budgets: dict = field(default_factory=dict)  # the budgets the admin set (``Budgets`` fills in the rest)
    job_user: str | None = None  # the OS user its jobs run as
    job_user_made: bool = False  # whether the runtime made that user (else the admin named it)

    @property
    def limits(self) -> Budgets:
        """Every budget of the tenant: the admin's, and the defaults for the rest."""
        return Budgets.from_wire(self.budgets)

    def public(self) -> dict:
        """The record without its credential digest."""
        return {"name": self.name, "weight": self.weight, "quota": self.quota, "budgets": self.limits.to_wire(),
                "job_user": self.job_user, "job_user_made": self.job_user_made}


def check_name(name: object) -> str:
    """``name`` if it is a valid tenant name; ResourceError otherwise."""
    if not isinstance(name, str) or not TENANT_PATTERN.match(name):
        raise ResourceError(f"tenant name {name!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a "
                            "letter or digit")
    return name


def check_weight(weight: object) -> float:
    """``weight`` as a float if it is finite and in (0, MAX_WEIGHT]; ResourceError otherwise."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or not 0 < weight <= MAX_WEIGHT:
        raise ResourceError(f"a weight must be a finite number in (0, {MAX_WEIGHT:g}], got {weight!r}")
    return float(weight)


def check_quota(quota: object) -> int | None:
    """``quota`` if it is None (no limit) or a whole number of devices >= 0; ResourceError otherwise."""
    if quota is None:
        return None
    if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
        raise ResourceError(f"a quota is a whole number of devices >= 0 (or none), got {quota!r}")
    return quota


class Registry:
    """Tenants by name and the admin credential's digest; thread-safe, persisted when given a path. With
    ``make_job_users`` (and this process root) it makes each tenant's job user."""

    def __init__(self, path: str | None, admin_digest: str | None, default_quota: int | None = None,
                 make_job_users: bool = False) -> None:
        self.path = Path(os.path.expanduser(path)) if path else None
        self.makes_job_users = make_job_users and job_users.is_root()
        self._lock = threading.Lock()
        self.tenants: dict[str, TenantRecord] = {}
        self.admin_digest = admin_digest
        self.default_quota = check_quota(default_quota)
        if self.path is not None and self.path.exists():
            self._load()
        elif self.path is not None:
            self._save()

    def _load(self) -> None:
        data = json.loads(self.path.read_text())
        self.admin_digest = data.get("admin") or self.admin_digest
        self.default_quota = data.get("default_quota", self.default_quota)
        self.tenants = {t["name"]: TenantRecord(**t) for t in data.get("tenants", [])}

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"admin": self.admin_digest, "default_quota": self.default_quota,
                       "tenants": [asdict(t) for t in self.tenants.values()]}, f, indent=1)
        os.replace(tmp, self.path)

    # -- the admin's operations ---------------------------------------------------------------------------
    def is_admin(self, credential: object) -> bool:
        """Whether ``credential`` is the admin credential; compares digests in constant time."""
        return isinstance(credential, str) and self.admin_digest is not None and auth.matches(credential,
                                                                                             self.admin_digest)

    def add(self, name: str, weight: float = 1.0, quota: int | None = None, digest: str | None = None,
            budgets: dict | None = None, job_user: str | None = None) -> str | None:
        """Register a tenant; returns its new credential (shown once, never stored), or None when the caller
        gave the credential's ``digest`` (a client that starts its own embedded cluster). ``job_user`` names the
        OS user its jobs run as; without one, a registry that makes job users makes it one."""
        name, weight = check_name(name), check_weight(weight)
        quota = self.default_quota if quota is None else check_quota(quota)
        changes = Budgets().with_changes(budgets or {}) and dict(budgets or {})  # checked before anything changes
        secret = None if digest else auth.new_secret()
        with self._lock:
            if name in self.tenants:
                raise ResourceError(f"tenant {name!r} already exists; `pathways tenants set` changes it")
            record = TenantRecord(name, weight, quota, digest or auth.digest(secret), changes)
            if job_user is not None:
                record.job_user = self._named_user(name, job_user).pw_name
            elif self.makes_job_users:
                record.job_user, record.job_user_made = job_users.make(name), True
            self.tenants[name] = record
            self._save()
        return secret

    def set(self, name: str, weight: float | None = None, quota: int | None | str = KEEP,
            new_credential: bool = False, budgets: dict | None = None, job_user: str | None = None) -> str | None:
        """Change a tenant's weight, quota (None: no limit), budgets (merged into the ones it has), credential, or
        job user (its next jobs run as that one); returns a new credential if asked."""
        with self._lock:
            record = self._get(name)
            if budgets:
                record.limits.with_changes(budgets)  # refuses an unknown budget or a bad value
            if job_user is not None and job_user != record.job_user:
                record.job_user, record.job_user_made = self._named_user(name, job_user).pw_name, False
            if weight is not None:
                record.weight = check_weight(weight)
            if quota != KEEP:
                record.quota = check_quota(quota)
            if budgets:
                record.budgets = {**record.budgets, **budgets}
            secret = None
            if new_credential:
                secret = auth.new_secret()
                record.credential = auth.digest(secret)
            self._save()
            return secret

    def remove(self, name: str) -> None:
        """Remove tenant ``name``; ResourceError if there is none."""
        with self._lock:
            self._get(name)
            del self.tenants[name]
            self._save()

    def _named_user(self, tenant: str, user: object) -> pwd.struct_passwd:
        """The user the admin named for ``tenant``'s jobs, if it may be: this process can start processes as it,
        it is neither root nor this process's user, and no other tenant's jobs run as it."""
        if not isinstance(user, str) or not user:
            raise ResourceError(f"a job user is the name of an OS user, got {user!r}")
        if not job_users.is_root():
            raise ResourceError(f"job user {user}: the runtime runs as {_me()}, not as root, so it cannot start jobs "
                                "as another user; run `pathways up` as root")
        entry = job_users.check(user)
        for other in self.tenants.values():
            if other.name != tenant and other.job_user and _uid(other.job_user) == entry.pw_uid:
                raise ResourceError(f"job user {user} already runs the jobs of another tenant; each tenant's jobs run "
                                    "as a user of its own, so that no tenant's job can read another's")
        return entry

    def job_user(self, name: str) -> pwd.struct_passwd:
        """The OS user tenant ``name``'s jobs run as, made now for a tenant added before job users were made;
        ResourceError saying what to do where it has none."""
        with self._lock:
            record = self._get(name)
            if record.job_user is None:
                if not self.makes_job_users:
                    raise ResourceError(_no_job_user(name))
                record.job_user, record.job_user_made = job_users.make(name), True
                self._save()
            return job_users.check(record.job_user)

    def _get(self, name: str) -> TenantRecord:
        record = self.tenants.get(name)
        if record is None:
            raise ResourceError(f"no tenant {name!r}; `pathways tenants list` shows them")
        return record

    # -- what clients prove -------------------------------------------------------------------------------
    def authenticate(self, name: object, credential: object) -> TenantRecord:
        """The tenant this credential proves; one error for every failure, so nothing is revealed."""
        record = self.tenants.get(name) if isinstance(name, str) else None
        if record is None or not isinstance(credential, str) or not auth.matches(credential, record.credential):
            raise TenantAccessError(WRONG)
        return record

    def whoami(self, tenant: object, credential: object) -> dict:
        """Whether a credential is the admin's or ``tenant``'s: ``{"admin", "tenant"}`` (TenantAccessError for
        neither)."""
        if self.is_admin(credential):
            return {"admin": True, "tenant": None}
        return {"admin": False, "tenant": self.authenticate(tenant, credential).name}

    def get(self, name: str) -> TenantRecord | None:
        """The record of tenant ``name``, or None."""
        return self.tenants.get(name)

    def listing(self) -> list[dict]:
        """Every tenant's public record, by name."""
        with self._lock:
            return [t.public() for t in sorted(self.tenants.values(), key=lambda t: t.name)]


def _me() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _uid(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _no_job_user(tenant: str) -> str:
    """Why tenant ``tenant``'s jobs have no user to run as, and what the admin can do."""
    if not job_users.is_root():
        return (f"tenant {tenant}'s jobs have no OS user of their own: the runtime runs as {_me()}, not as root, so it "
                "can neither make one nor start a job as one, and it starts no tenant's code as its own user (which "
                "could read the runtime's files, Ray's token and every other tenant's jobs). The cluster's admin can "
                "run `pathways up` as root (each tenant's jobs then run as a user of the tenant's own), or, where "
                "every tenant may read every other's jobs and the runtime's files, `pathways up "
                "--unsafe-jobs-as-runtime-user`")
    return (f"tenant {tenant}'s jobs have no OS user of their own, and this runtime makes none (an embedded cluster, "
            f"whose tenants live in memory): name one dedicated to them (pw.admin().set_tenant({tenant!r}, "
            "job_user=USER)), or run the cluster with `pathways up`")
