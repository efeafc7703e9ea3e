"""The cluster admin's operations: tenants, their weights, quotas and credentials; islands; reclaiming.

Every operation carries the admin credential, which the resource manager
checks against the digest it holds. ``pathways up`` writes that credential to
``$PATHWAYS_HOME/admin.token`` (readable by its owner only); a client that
started its own embedded cluster holds it in memory (``pw.admin()``).

    admin = pw.admin()
    credential = admin.add_tenant("alice", weight=2, quota=4)   # shown once: hand it to alice
    admin.set_tenant("alice", weight=3)
    print(admin.tenants())
"""

from __future__ import annotations

from typing import Any

import ray

from client.jobs import ADMIN_FILE
from pathways import wire
from pathways.errors import TenantAccessError, from_wire

_KEEP = object()


class Admin:
    """The admin's view of one runtime (``rm``: the resource manager's handle)."""

    def __init__(self, rm: Any, credential: str, timeout: float = 60.0) -> None:
        self._rm, self._credential, self._timeout = rm, credential, timeout

    def _call(self, op: str, **args: Any) -> Any:
        payload = wire.encode("admin", {"credential": self._credential, "op": op, "args": args})
        msg = wire.decode(ray.get(self._rm.admin.remote(payload), timeout=self._timeout), "reply")
        if not msg["ok"]:
            raise from_wire(*msg["value"])
        return msg["value"]

    def tenants(self) -> list[dict]:
        """Every registered tenant: name, weight, quota, clients now, devices held now."""
        return self._call("tenants")

    def add_tenant(self, name: str, weight: float = 1.0, quota: int | None = None) -> str:
        """Register a tenant; returns its credential (the only time it is shown)."""
        return self._call("tenant_add", name=name, weight=weight, quota=quota)["credential"]

    def set_tenant(self, name: str, weight: float | None = None, quota: Any = _KEEP,
                   new_credential: bool = False) -> str | None:
        """Change a tenant's weight, device quota (None: no limit) or credential (returns the new one)."""
        args: dict[str, Any] = {"name": name, "weight": weight, "new_credential": new_credential}
        if quota is not _KEEP:
            args["quota"] = quota
        return self._call("tenant_set", **args)["credential"]

    def remove_tenant(self, name: str) -> None:
        """Remove a tenant: its sessions end, its slices and buffers are reclaimed."""
        self._call("tenant_remove", name=name)

    def reclaim(self, tenant: str | None = None, client: int | None = None) -> list[dict]:
        """End a client's session (or every session of a tenant) and free what it held."""
        return self._call("reclaim", tenant=tenant, client=client)

    def mark_island(self, island: int, healthy: bool, reason: str = "") -> None:
        """Take an island out of placement (or put it back)."""
        self._call("mark", island=island, healthy=healthy, reason=reason)

    def state(self) -> dict:
        """The whole cluster, every tenant named."""
        return self._call("state")

    def schedules(self) -> list[dict]:
        """Each healthy island's scheduler counters, every tenant's island time by name."""
        return self._call("schedule")

    def usage(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Buffers and bytes each tenant holds on each island, counted now."""
        return {int(i): {t: tuple(v) for t, v in c.items()} for i, c in self._call("usage").items()}

    def probe_network(self, src: tuple[int, int], dst: tuple[int, int], nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes from host ``src`` to host ``dst`` (each (island, host)) over one
        plain connection of the network path: the bare link, for benchmarks."""
        return self._call("probe_network", src=list(src), dst=list(dst), nbytes=nbytes)

    def hosts(self) -> list[list[Any]]:
        """Every island's host actor handles (to read their counters)."""
        payload = wire.encode("admin", {"credential": self._credential, "op": "hosts", "args": {}})
        raw, handles = ray.get(self._rm.admin_hosts.remote(payload), timeout=self._timeout)
        msg = wire.decode(raw, "reply")
        if not msg["ok"]:
            raise from_wire(*msg["value"])
        return handles


def admin(credential: str | None = None) -> Admin:
    """The admin operations of the runtime this process is attached to (``pw.init`` first).

    Args:
        credential: the cluster's admin credential. Default: the one this process holds because its
            ``pw.init`` started the runtime, else the contents of ``$PATHWAYS_HOME/admin.token``
            (which ``pathways up`` writes).

    Returns:
        A ``pw.Admin``. The resource manager checks the credential on every operation, which raises
        TenantAccessError if it is not the admin's.

    Raises:
        TenantAccessError: no credential was given or found.
        PathwaysError: ``pw.init`` was not called.
    """
    from client.session import current, home

    session = current()
    credential = credential or session.admin_credential or _read(home() / ADMIN_FILE)
    if credential is None:
        raise TenantAccessError(f"no admin credential: this process did not start the runtime and "
                                f"{home() / ADMIN_FILE} does not exist")
    return Admin(session.rm, credential, session.timeouts.start)


def _read(path: Any) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None

