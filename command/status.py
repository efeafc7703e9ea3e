"""``pathways status``: islands, hosts, slices, queues and shares: the whole cluster with the admin credential,
else one tenant's view of it."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from command.address import resolve_address
from command.output import CliError
from command.secrets import identity
from command.tables import render_status
from command.tenants import as_admin
from pathways.errors import PathwaysError


def cmd_status(args: argparse.Namespace) -> int:
    """``pathways status``: the whole cluster with the admin credential, else one tenant's view."""
    tenant, credential, is_admin = identity(args, "status")
    address = resolve_address(args.address)
    if is_admin:
        from client.admin import Admin
        from client.status import admin_status

        try:
            admin = Admin.connect(address, credential, timeout=args.timeout)
            snapshot, refusals = as_admin(admin_status, admin), as_admin(admin.state).get("refusals", [])
        except PathwaysError as exc:
            raise CliError(str(exc)) from None
    else:
        snapshot, refusals = _tenant_status(address, tenant, credential, args.timeout), None
    if args.json:
        print(json.dumps({**asdict(snapshot), "view": "admin" if refusals is not None else f"tenant {tenant}",
                          **({"refusals": refusals} if refusals is not None else {})}, indent=2, default=str))
    else:
        print(render_status(snapshot, address, refusals))
    return 0


def _tenant_status(address: str, tenant: str, credential: str, timeout: float) -> Any:
    import pathways as pw

    try:
        pw.init(address=address, tenant=tenant, credential=credential)
        return pw.status(timeout=timeout)
    except pw.PathwaysError as exc:
        raise CliError(str(exc)) from None
    finally:
        pw.shutdown()
