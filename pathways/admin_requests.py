"""The cluster admin's operations as typed requests, each declared once: its operation name, its fields with their
wire schema, and what it checks in meaning.

An admin request travels inside ``pathways.requests.AdminOp``, next to the admin credential, as its operation name
(``op``) and its fields by name (``args``): ``to_wire`` gives that form and ``from_wire`` builds the typed request
back, refusing an unknown operation, an unknown or missing field, or a value of the wrong type with an error that
names it. The resource manager checks the credential before it reads anything else, then runs the one handler the
request's type has (``resource_manager.admin``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from pathways import wire
from pathways.errors import PathwaysError, ResourceError, WireFormatError

KEEP = "keep"  # ``TenantSet.quota``: leave the quota as it is (the field is then left out of the message)
MAX_TIMEOUT_S = 24 * 3600
T = TypeVar("T")
_BY_OP: dict[str, type] = {}


def admin_request(op: str, schema: dict[str, Any]) -> Callable[[type[T]], type[T]]:
    """Make the class a frozen dataclass that is admin operation ``op``, with one ``schema`` entry per field (a field
    with a default may be left out of the message)."""

    def wrap(cls: type[T]) -> type[T]:
        cls = dataclass(frozen=True)(cls)
        names = [f.name for f in fields(cls)]
        if names != list(schema):
            raise TypeError(f"admin operation {op!r}: fields {names} differ from its schema's {list(schema)}")
        if op in _BY_OP:
            raise ValueError(f"admin operation {op!r} is declared twice")
        cls.OP = op  # type: ignore[attr-defined]
        cls.SCHEMA = schema  # type: ignore[attr-defined]
        cls.CHECKS = {name: wire.checker(sub) for name, sub in schema.items()}  # type: ignore[attr-defined]
        _BY_OP[op] = cls
        return cls

    return wrap


def operations() -> list[str]:
    """Every admin operation's name, sorted."""
    return sorted(_BY_OP)


def to_wire(request: Any) -> tuple[str, dict[str, Any]]:
    """``request`` as ``AdminOp`` carries it: (op, args); checked first, so a bad value fails where it was made."""
    args = {f.name: getattr(request, f.name) for f in fields(request)
            if not (f.default == KEEP and getattr(request, f.name) == KEEP)}
    from_wire(request.OP, args)
    return request.OP, args


def from_wire(op: object, args: object) -> Any:
    """The typed request ``AdminOp`` carries; ResourceError for an unknown operation, WireFormatError naming the
    field for a bad one, and the request's own ``check`` error for a value it refuses in meaning."""
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ResourceError(f"unknown admin operation {op!r}; known: {', '.join(operations())}")
    if not isinstance(args, dict):
        raise WireFormatError(f"admin {op}: its fields come as a map, not {type(args).__name__}")
    schema = cls.SCHEMA  # type: ignore[attr-defined]
    unknown = sorted(str(n) for n in args if n not in schema)
    if unknown:
        raise WireFormatError(f"admin {op}: no field {unknown[0]!r}; its fields are {', '.join(schema) or 'none'}")
    values = {}
    for f in fields(cls):
        if f.name in args:
            cls.CHECKS[f.name](args[f.name], f"admin {op}.{f.name}")  # type: ignore[attr-defined]
            values[f.name] = args[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise WireFormatError(f"admin {op}: missing field {f.name!r}")
    request = cls(**values)
    check = getattr(request, "check", None)
    if check is not None:
        check()
    return request


def check_timeout(value: float | None) -> None:
    """PathwaysError unless ``value`` is None (the runtime's default) or seconds in (0, ``MAX_TIMEOUT_S``]."""
    if value is not None and not 0 < value <= MAX_TIMEOUT_S:
        raise PathwaysError(f"a timeout is a number of seconds between 0 and {MAX_TIMEOUT_S}, not {value!r}")


# -- tenants ------------------------------------------------------------------------------------------------

@admin_request("tenants", {})
class TenantList:
    """Every registered tenant: name, weight, quota, budgets, clients now, devices held now."""


@admin_request("tenant_add", {"name": str, "weight": float, "quota": ("opt", int), "budgets": ("map", wire.ANY),
                              "job_user": ("opt", str)})
class TenantAdd:
    """Register tenant ``name``; answered ``{"credential": ...}``, the only time it is shown. ``budgets`` overrides
    some default budgets (``pathways.budgets.Budgets`` checks them); ``job_user`` names the OS user its jobs run as
    (default: one the runtime makes, where it runs as root with a registry file)."""

    name: str
    weight: float = 1.0
    quota: int | None = None
    budgets: dict = field(default_factory=dict)
    job_user: str | None = None


@admin_request("tenant_set", {"name": str, "weight": ("opt", float), "quota": ("opt", int),
                              "new_credential": bool, "budgets": ("map", wire.ANY), "job_user": ("opt", str)})
class TenantSet:
    """Change tenant ``name``'s weight (None: keep it), device quota (``KEEP``: keep it; None: no limit), budgets
    (merged into its own), credential (``new_credential``: answered ``{"credential": ...}``; the old one, its
    sessions and its jobs' unused tickets stop working at once), or the OS user its next jobs run as."""

    name: str
    weight: float | None = None
    quota: int | None | str = KEEP
    new_credential: bool = False
    budgets: dict = field(default_factory=dict)
    job_user: str | None = None


@admin_request("tenant_remove", {"name": str})
class TenantRemove:
    """Remove tenant ``name``: its sessions end, its slices and buffers are reclaimed."""

    name: str


@admin_request("reclaim", {"tenant": ("opt", str), "client": ("opt", int)})
class Reclaim:
    """End client ``client``'s session, or every session of ``tenant``, and free what it held; answered with what
    each ended session held."""

    tenant: str | None = None
    client: int | None = None


# -- islands and hosts --------------------------------------------------------------------------------------

@admin_request("mark", {"island": int, "healthy": bool, "reason": str})
class MarkIsland:
    """Take island ``island`` out of placement (``healthy`` False, saying ``reason``), or put it back."""

    island: int
    healthy: bool
    reason: str = ""


@admin_request("schedule", {})
class Schedules:
    """Each healthy island's scheduler counters, every tenant's island time by name."""


@admin_request("host_stats", {})
class HostCounters:
    """Every host's counters, by island (None for a host that did not answer)."""


@admin_request("probe_network", {"src": ("list", int), "dst": ("list", int), "nbytes": int})
class ProbeNetwork:
    """Seconds to push ``nbytes`` raw bytes from host ``src`` to host ``dst`` (each [island, host]) over one plain
    connection of the network path."""

    src: list
    dst: list
    nbytes: int

    def check(self) -> None:
        """Each end is [island, host]."""
        for end in (self.src, self.dst):
            if len(end) != 2 or min(end) < 0:
                raise WireFormatError(f"admin probe_network: an end is [island, host], got {end!r}")


@admin_request("usage", {})
class TenantUsage:
    """Buffers and bytes each tenant holds on each island, counted now."""


# -- the cluster --------------------------------------------------------------------------------------------

@admin_request("state", {})
class WholeState:
    """The whole cluster, every tenant named."""


@admin_request("suspend", {"dir": ("opt", str), "timeout": ("opt", float)})
class Suspend:
    """Save the cluster into ``dir`` (default: a new directory under the runtime's ``--suspend-dir``) and stop the
    islands, each step bounded by ``timeout`` seconds (default: the runtime's)."""

    dir: str | None = None
    timeout: float | None = None

    def check(self) -> None:
        """The timeout, if given, is a sane number of seconds."""
        check_timeout(self.timeout)


@admin_request("resume", {"dir": ("opt", str), "timeout": ("opt", float)})
class Resume:
    """Restore the cluster saved in ``dir`` (default: where this runtime was suspended to, else the newest suspend
    under its ``--suspend-dir``), each step bounded by ``timeout`` seconds (default: the runtime's)."""

    dir: str | None = None
    timeout: float | None = None

    def check(self) -> None:
        """The timeout, if given, is a sane number of seconds."""
        check_timeout(self.timeout)


AdminRequest = (TenantList | TenantAdd | TenantSet | TenantRemove | Reclaim | MarkIsland | Schedules | HostCounters
                | ProbeNetwork | TenantUsage | WholeState | Suspend | Resume)
