"""Per-tenant budgets: how much of each shared resource one tenant may hold, so that no tenant's volume can
stop another's work.

The cluster's admin sets them per tenant (``pathways tenants add/set --budget NAME=VALUE``); a tenant added
without one gets the defaults below, which keep a small cluster safe. The resource manager holds them in its
registry and tells the hosts with each session, so a host never reads a budget from a client's message. A
message that would take a tenant over one of its budgets fails alone with a ``ResourceError`` that names the
budget; nothing of another tenant's changes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pathways.errors import ResourceError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Budgets:
    """What one tenant may hold at once (per host where it says so).

    host_bytes: bytes of the tenant's resident buffers on any one host (next to its device quota).
    pending_fetches: fetches of the tenant waiting on one host for a value that is not there yet.
    mailboxes: receives on one host holding pieces that arrived before their recv op was admitted.
    parked_bytes: bytes of such pieces (landed for receives not admitted yet) on one host.
    program_ops: ops in one fragment (program) the tenant sends an island.
    templates: distinct fragment templates of the tenant an island keeps decoded.
    sessions: the tenant's open client sessions at once.
    executable_bytes: bytes of serialized executables the tenant keeps on one host.
    connections: the tenant's open connections to one endpoint of the runtime.
    jobs: the tenant's jobs running at once (``pathways submit``).
    job_disk_bytes: bytes the tenant's jobs hold on the runtime's disk: archives being received and unpacked working
        directories (a job's folder is removed when it ends).
    frame_bytes: bytes of the tenant's messages being read at once on one endpoint (a message's bytes are taken as
        they arrive, never as its head announces them).
    ahead_batches: the tenant's batches one island holds that arrived ahead of their turn in the client's stream.
    ahead_bytes: bytes of such batches.
    op_ms: milliseconds one computation of the tenant may run on an island. A running computation cannot be
        stopped, so this caps what follows: a program one of whose computations ran longer is refused from then on
        (until the admin raises the budget), and once the tenant held an island longer than this without a break
        (a computation, a compile, a run of calls), all its later work there, new programs included, is held to its
        weight's share of the island's time: after holding it for t seconds, it waits t x (the weights of the others
        that used the island in the last 10 s) / its weight, one piece in flight at a time, until it has stayed within
        the budget for 10 s. No tenant holds an island in long unbreakable pieces, and another tenant waits for at
        most one such piece at a time.
    """

    host_bytes: int = 8 * GiB
    pending_fetches: int = 256
    mailboxes: int = 4096
    parked_bytes: int = 1 * GiB
    program_ops: int = 16384
    templates: int = 1024
    sessions: int = 16
    executable_bytes: int = 512 * MiB
    connections: int = 64
    jobs: int = 8
    job_disk_bytes: int = 2 * GiB
    frame_bytes: int = 512 * MiB
    ahead_batches: int = 64
    ahead_bytes: int = 256 * MiB
    op_ms: int = 60_000

    def to_wire(self) -> dict[str, int]:
        """Every budget by name (what the registry stores and the hosts are told)."""
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> Budgets:
        """Budgets from ``to_wire``'s form; missing names keep their defaults. ResourceError for anything else."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ResourceError(f"budgets must be a map of name to a whole number, got {type(data).__name__}")
        return cls().with_changes(data)

    def with_changes(self, changes: dict[str, Any]) -> Budgets:
        """These budgets with ``changes`` applied; ResourceError naming an unknown budget or a bad value."""
        known = {f.name for f in fields(self)}
        for name, value in changes.items():
            if name not in known:
                raise ResourceError(f"no budget named {name!r}; the budgets are: {', '.join(sorted(known))}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResourceError(f"budget {name} must be a whole number >= 0, got {value!r}")
        return replace(self, **changes)


def over(budget: str, tenant_holds: int, wants: int, limit: int, unit: str = "") -> ResourceError:
    """The error for a tenant whose request would take it over one budget: it names the budget, what the
    tenant holds, what it asked for, and who can raise the limit."""
    sep = " " if unit else ""
    return ResourceError(f"over your {budget} budget: you hold {tenant_holds}{sep}{unit} and this needs "
                         f"{wants}{sep}{unit} more, over the limit of {limit}{sep}{unit}; free something first, or ask "
                         f"the cluster's admin to raise it (pathways tenants set NAME --budget {budget}=N)")
