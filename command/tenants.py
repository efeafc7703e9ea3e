"""``pathways tenants add | list | set | remove``: the cluster admin's tenant registry, through the runtime; each
refusal becomes a one-line error. A new credential is printed once, with the login command that hands it over."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from command import secrets
from command.address import resolve_address
from command.output import CliError
from command.tables import table
from pathways.errors import PathwaysError


def _admin(args: argparse.Namespace) -> Any:
    from client.admin import Admin

    credential = secrets.need_admin_credential(args.admin_credential_file, f"`pathways tenants {args.action}`")
    try:
        return Admin.connect(resolve_address(args.address), credential)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def as_admin(fn: Any, *a: Any, **kw: Any) -> Any:
    """Run one admin operation; what the resource manager refuses becomes a one-line error."""
    try:
        return fn(*a, **kw)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def _budgets(pairs: list[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdecimal():
            raise CliError(f"--budget {pair!r}: write NAME=VALUE with a whole number, e.g. host_bytes=4294967296")
        out[name.strip()] = int(value)
    return out


def _check_weight(weight: float | None) -> None:
    if weight is not None and not (math.isfinite(weight) and weight > 0):
        raise CliError(f"--weight must be a positive number, got {weight:g}")


def _check_quota(quota: int | None) -> None:
    if quota is not None and quota < 0:
        raise CliError(f"--quota must be a number of devices >= 0, got {quota}")


def _tenant_line(t: dict) -> str:
    return f"tenant {t['name']}: weight {t['weight']:g}, quota {'none' if t['quota'] is None else t['quota']}"


def _job_user_line(t: dict) -> str:
    if not t.get("job_user"):
        return "  its jobs have no OS user of their own yet: `pathways submit` says what to do"
    return f"  its jobs run as OS user {t['job_user']}" + (" (made by the runtime)" if t.get("job_user_made") else "")


def _show_credential(name: str, secret: str, address: str) -> None:
    path = secrets.write_secret(secrets.credential_path(name), secret)
    print(f"credential of {name} (shown only this once), saved to {path} (readable by you only).\n"
          f"  Hand {name} this command over a private channel; on their machine it sets everything up:\n\n"
          f"    pathways login {address} --tenant {name} --credential={secret}\n")


def cmd_tenants_add(args: argparse.Namespace) -> int:
    """``pathways tenants add``: register a tenant and print its login command once."""
    secrets.check_tenant(args.name)
    _check_weight(args.weight)
    _check_quota(args.quota)
    budgets = _budgets(args.budget)
    admin = _admin(args)
    secret = as_admin(admin.add_tenant, args.name, args.weight, args.quota, budgets, args.job_user)
    (record,) = [t for t in as_admin(admin.tenants) if t["name"] == args.name]
    print(f"added {_tenant_line(record)}\n{_job_user_line(record)}")
    _show_credential(args.name, secret, resolve_address(args.address))
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    """``pathways tenants list``: every tenant with its weight, quota, clients and devices held."""
    rows = as_admin(_admin(args).tenants)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES", "JOB USER"],
                [[t["name"], f"{t['weight']:g}", "-" if t["quota"] is None else t["quota"], t["clients"],
                  t["devices"], t.get("job_user") or "-"] for t in rows])
          if rows else "no tenants: add one with `pathways tenants add`")
    return 0


def cmd_tenants_set(args: argparse.Namespace) -> int:
    """``pathways tenants set``: change a tenant's weight, quota, budgets or credential."""
    if (args.weight is None and args.quota is None and not args.no_quota and not args.new_credential
            and not args.budget and not args.job_user):
        raise CliError("nothing to change: pass --weight W, --quota DEVICES, --no-quota, --budget NAME=VALUE, "
                       "--job-user USER or --new-credential")
    _check_weight(args.weight)
    _check_quota(args.quota)
    admin = _admin(args)
    change: dict[str, Any] = {"weight": args.weight, "new_credential": args.new_credential,
                              "budgets": _budgets(args.budget), "job_user": args.job_user}
    if args.quota is not None or args.no_quota:
        change["quota"] = args.quota
    secret = as_admin(admin.set_tenant, args.name, **change)
    (record,) = [t for t in as_admin(admin.tenants) if t["name"] == args.name]
    print(f"changed {_tenant_line(record)}" + (f"\n{_job_user_line(record)}" if args.job_user else ""))
    if secret:
        print("  the old credential, its sessions and its jobs' unused tickets no longer work")
        _show_credential(args.name, secret, resolve_address(args.address))
    return 0


def cmd_tenants_remove(args: argparse.Namespace) -> int:
    """``pathways tenants remove``: remove a tenant (its sessions and jobs end) and delete its saved credential."""
    admin = _admin(args)
    record = next((t for t in as_admin(admin.tenants) if t["name"] == args.name), {})
    as_admin(admin.remove_tenant, args.name)
    print(f"removed tenant {args.name}: its sessions ended, its jobs stop, and its slices and buffers were reclaimed")
    if record.get("job_user_made"):
        print(f"  its OS user {record['job_user']} stays, unused, so that its uid is given to no one else (who would "
              f"own what its jobs left in /tmp); `userdel {record['job_user']}` once nothing of it is left")
    path = secrets.credential_path(args.name)
    if path.exists():
        path.unlink()
        print(f"  deleted its credential {path}")
    return 0
