"""The cluster admin's operations: tenants, their weights, quotas, budgets and credentials; islands; reclaiming.

Every operation carries the admin credential, which the resource manager checks against the digest it holds.
``pathways up`` writes that credential to ``$PATHWAYS_HOME/admin.token`` (readable by its owner only); a client
that started its own embedded cluster holds it in memory (``pw.admin()``).

    admin = pw.admin()
    credential = admin.add_tenant("alice", weight=2, quota=4)   # shown once: hand it to alice
    admin.set_tenant("alice", weight=3, budgets={"host_bytes": 2 << 30})
    print(admin.tenants())
"""

from __future__ import annotations

from typing import Any

from client.link import Link, expect_role
from client.runtime import home
from pathways import admin_requests as ar
from pathways.errors import TenantAccessError
from pathways.requests import AdminOp

ADMIN_FILE = "admin.token"


class Admin:
    """The admin's view of one runtime, over ``link`` (a connection to its resource manager)."""

    def __init__(self, link: Link, credential: str, timeout: float = 60.0) -> None:
        self._link, self._credential, self._timeout = link, credential, timeout

    @classmethod
    def connect(cls, address: str, credential: str, timeout: float = 60.0) -> Admin:
        """The admin operations of the runtime at ``address`` (over a connection of their own)."""
        return cls(Link(address, 0, None, expect_role(None, "rm"), "the resource manager"), credential, timeout)

    def close(self) -> None:
        """Close the connection (only one this object made)."""
        self._link.close()

    def _call(self, request: ar.AdminRequest) -> Any:
        op, args = ar.to_wire(request)
        return self._link.call(lambda rid: AdminOp(rid, self._credential, op, args), self._timeout)

    def tenants(self) -> list[dict]:
        """Every registered tenant: name, weight, quota, budgets, clients now, devices held now."""
        return self._call(ar.TenantList())

    def add_tenant(self, name: str, weight: float = 1.0, quota: int | None = None,
                   budgets: dict[str, int] | None = None, job_user: str | None = None) -> str:
        """Register a tenant; returns its credential (the only time it is shown). ``budgets`` overrides some of
        the default per-tenant budgets (``pathways.budgets.Budgets``); ``job_user`` names the OS user its jobs run
        as (default: one the runtime makes, where it runs as root with a registry file)."""
        return self._call(ar.TenantAdd(name, weight, quota, budgets or {}, job_user))["credential"]

    def set_tenant(self, name: str, weight: float | None = None, quota: Any = ar.KEEP, new_credential: bool = False,
                   budgets: dict[str, int] | None = None, job_user: str | None = None) -> str | None:
        """Change a tenant's weight, device quota (None: no limit), budgets, credential (returns the new one;
        the old one, its sessions and its jobs' unused tickets stop working at once), or the OS user its next
        jobs run as."""
        return self._call(ar.TenantSet(name, weight, quota, new_credential, budgets or {}, job_user))["credential"]

    def remove_tenant(self, name: str) -> None:
        """Remove a tenant: its sessions end, its slices and buffers are reclaimed."""
        self._call(ar.TenantRemove(name))

    def reclaim(self, tenant: str | None = None, client: int | None = None) -> list[dict]:
        """End a client's session (or every session of a tenant) and free what it held."""
        return self._call(ar.Reclaim(tenant, client))

    def mark_island(self, island: int, healthy: bool, reason: str = "") -> None:
        """Take an island out of placement (or put it back)."""
        self._call(ar.MarkIsland(island, healthy, reason))

    def state(self) -> dict:
        """The whole cluster, every tenant named."""
        return self._call(ar.WholeState())

    def schedules(self) -> list[dict]:
        """Each healthy island's scheduler counters, every tenant's island time by name."""
        return self._call(ar.Schedules())

    def host_stats(self) -> list[list[dict | None]]:
        """Every host's counters, by island (None for a host that did not answer)."""
        return self._call(ar.HostCounters())

    def usage(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Buffers and bytes each tenant holds on each island, counted now."""
        return {int(i): {t: tuple(v) for t, v in c.items()} for i, c in self._call(ar.TenantUsage()).items()}

    def suspend(self, directory: str | None = None, timeout: float = 60.0) -> dict:
        """Save every tenant's arrays, sessions and executables into ``directory`` (a path on the resource
        manager's machine or an fsspec URL; default: the runtime's ``--suspend-dir``) and stop the islands. Each
        step waits at most ``timeout`` seconds; if one fails, nothing is saved and the cluster runs on
        (PathwaysError says why). Returns what was saved: seconds, bytes, buffers, sessions."""
        return self._slow(ar.Suspend(directory, timeout))

    def resume(self, directory: str | None = None, timeout: float = 60.0) -> dict:
        """Restore a suspended cluster from ``directory`` (default: where this runtime was suspended to), here
        or on a freshly started runtime of the same topology; attached clients go on. If it fails, nothing of
        it is used (PathwaysError says why). Returns what was restored: seconds, bytes, buffers, sessions."""
        return self._slow(ar.Resume(directory, timeout))

    def _slow(self, request: ar.Suspend | ar.Resume) -> dict:
        """A suspend or resume, on a connection of its own: the resource manager serves a connection's requests
        in order, and this process's session must go on talking to it meanwhile."""
        op, args = ar.to_wire(request)
        link = Link(self._link.address, 0, None, expect_role(None, "rm"), "the resource manager")
        try:
            return link.call(lambda rid: AdminOp(rid, self._credential, op, args), _long(request.timeout))
        finally:
            link.close()

    def probe_network(self, src: tuple[int, int], dst: tuple[int, int], nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes from host ``src`` to host ``dst`` (each (island, host)) over one
        plain connection of the network path: the bare link, for benchmarks."""
        return self._call(ar.ProbeNetwork(list(src), list(dst), nbytes))


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
    from client.session import current

    session = current()
    credential = credential or session.admin_credential or _read(home() / ADMIN_FILE)
    if credential is None:
        raise TenantAccessError(f"no admin credential: this process did not start the runtime and "
                                f"{home() / ADMIN_FILE} does not exist")
    return Admin(session.rm, credential, session.timeouts.start)


def _long(timeout: float) -> float:
    """How long to wait for a suspend or resume that bounds each of its steps by ``timeout`` (a few steps, and
    the time to move the bytes)."""
    return 4 * timeout + 600.0


def _read(path: Any) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
