"""Submit one training job per tenant at once, then follow them.

    python -m examples.multi_tenant.submit [--address pathways://HOST:PORT] [--tenants alice:1,bob:3] [--steps N]

Run it as the cluster's admin (who ran ``pathways up``: it reads ``$PATHWAYS_HOME/admin.token``).
Tenants missing from the registry are registered with the weights asked for, and their credentials
saved in ``$PATHWAYS_HOME/credentials/``; tenants already there keep the weight the registry gives
them (``pathways tenants set NAME --weight W`` changes it). Each job ships this folder as its
working directory and runs ``python train.py`` with a single-use ticket of its tenant, never the
tenant's credential.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from command import secrets
from command.address import resolve_address
from command.jobs import Jobs, pack
from command.output import CliError


def parse_tenants(spec: str) -> list[tuple[str, float]]:
    out = []
    for item in spec.split(","):
        name, _, weight = item.partition(":")
        try:
            out.append((secrets.check_tenant(name.strip()), float(weight or 1)))
        except ValueError:
            raise CliError(f"--tenants: {item!r} is not NAME:WEIGHT") from None
        if not out[-1][1] > 0:
            raise CliError(f"--tenants: the weight of {name} must be positive")
    return out


def register(address: str, tenants: list[tuple[str, float]]) -> None:
    """Register (as the admin) the tenants the registry does not have yet, saving their credentials."""
    from client.admin import Admin
    from pathways.errors import PathwaysError

    admin = Admin.connect(address, secrets.need_admin_credential(None, "registering tenants"))
    try:
        known = {t["name"]: t for t in admin.tenants()}
        for name, weight in tenants:
            if name not in known:
                secrets.write_secret(secrets.credential_path(name), admin.add_tenant(name, weight))
                print(f"registered tenant {name} (weight {weight:g}); its credential is in "
                      f"{secrets.credential_path(name)}")
            elif known[name]["weight"] != weight:
                print(f"tenant {name} exists with weight {known[name]['weight']:g}, which it keeps "
                      f"(`pathways tenants set {name} --weight {weight:g}` changes it)")
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    finally:
        admin.close()


def last_line(logs: str, marker: str) -> str:
    lines = [line for line in logs.splitlines() if marker in line]
    return lines[-1].strip() if lines else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="the runtime's address (default: PATHWAYS_ADDRESS, else `pathways up`'s)")
    p.add_argument("--tenants", default="alice:1,bob:3", help="NAME:WEIGHT,... (default alice:1,bob:3)")
    p.add_argument("--steps", type=int, default=2000, help="training steps of each job (default 2000)")
    p.add_argument("--seconds", type=float, default=60.0, help="each job's time budget (default 60)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting after this many seconds")
    p.add_argument("--no-wait", action="store_true", help="submit and return")
    args = p.parse_args(argv)
    runners: dict[str, Jobs] = {}
    try:
        tenants = parse_tenants(args.tenants)
        address = resolve_address(args.address)
        register(address, tenants)
        archive = pack(str(Path(__file__).resolve().parent))
        entry = ["python", "train.py", "--steps", str(args.steps), "--seconds", str(args.seconds)]
        ids = {}
        for tenant, _ in tenants:
            found = secrets.tenant_identity(tenant)
            if found is None:
                raise CliError(f"tenant {tenant} is registered, but its credential is not in "
                               f"{secrets.credential_path(tenant)}: `pathways tenants set {tenant} "
                               "--new-credential` issues a new one there")
            runners[tenant] = Jobs(address, *found)
            ids[tenant] = runners[tenant].submit(entry, archive)["id"]
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for tenant, job in ids.items():
        print(f"submitted {job} (tenant {tenant}) to {address}")
    if args.no_wait:
        return 0
    print("while they run: pathways status | pathways jobs | pathways logs <id> --follow", flush=True)
    deadline = time.monotonic() + args.timeout
    while True:
        logs = {t: runners[t].logs(j) for t, j in ids.items()}
        for tenant in ids:
            print(f"  {tenant:>8} {logs[tenant]['status']:<9} {last_line(logs[tenant]['text'], f'[{tenant}]')}")
        if all(chunk["ended"] for chunk in logs.values()):
            break
        if time.monotonic() > deadline:
            print(f"error: jobs still running after {args.timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(5.0)
    for tenant, job in ids.items():
        if logs[tenant]["status"] != "SUCCEEDED":
            print(f"--- {tenant} ({job}) {logs[tenant]['status']}:\n{logs[tenant]['text'][-3000:]}", file=sys.stderr)
    return 0 if all(chunk["status"] == "SUCCEEDED" for chunk in logs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
