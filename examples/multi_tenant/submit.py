"""Submit one training job per tenant at once through Ray's job submission API, then follow them.

    python -m examples.multi_tenant.submit [--address ADDR] [--tenants alice:1,bob:3] [--steps N]

Run it as the cluster's admin (who ran ``pathways up``: it reads ``$PATHWAYS_HOME/admin.token``).
Tenants missing from the registry are registered with the weights asked for, and their credentials
saved in ``$PATHWAYS_HOME/credentials/``; tenants already there keep the weight the registry gives
them (``pathways tenants set NAME --weight W`` changes it). Each job ships this folder as its
working directory and runs ``python train.py`` with a single-use ticket of its tenant
(PATHWAYS_TICKET), never the tenant's credential.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from client import jobs


def parse_tenants(spec: str) -> list[tuple[str, float]]:
    out = []
    for item in spec.split(","):
        name, _, weight = item.partition(":")
        try:
            out.append((jobs.check_tenant(name.strip()), float(weight or 1)))
        except ValueError:
            raise jobs.CliError(f"--tenants: {item!r} is not NAME:WEIGHT") from None
        if not out[-1][1] > 0:
            raise jobs.CliError(f"--tenants: the weight of {name} must be positive")
    return out


def register(rm, tenants: list[tuple[str, float]]) -> None:
    """Register (as the admin) the tenants the registry does not have yet, saving their credentials."""
    from client.admin import Admin
    from pathways.errors import PathwaysError

    admin = Admin(rm, jobs.need_admin_credential(None, "registering tenants"))
    try:
        known = {t["name"]: t for t in admin.tenants()}
        for name, weight in tenants:
            if name not in known:
                jobs.write_secret(jobs.credential_path(name), admin.add_tenant(name, weight))
                print(f"registered tenant {name} (weight {weight:g}); its credential is in "
                      f"{jobs.credential_path(name)}")
            elif known[name]["weight"] != weight:
                print(f"tenant {name} exists with weight {known[name]['weight']:g}, which it keeps "
                      f"(`pathways tenants set {name} --weight {weight:g}` changes it)")
    except PathwaysError as exc:
        raise jobs.CliError(str(exc)) from None


def last_line(logs: str, marker: str) -> str:
    lines = [line for line in logs.splitlines() if marker in line]
    return lines[-1].strip() if lines else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else `pathways up`'s)")
    p.add_argument("--tenants", default="alice:1,bob:3", help="NAME:WEIGHT,... (default alice:1,bob:3)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=60.0, help="each job's time budget")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting after this many seconds")
    p.add_argument("--no-wait", action="store_true", help="submit and return")
    args = p.parse_args(argv)
    jobs.enable_token_auth()
    try:
        tenants = parse_tenants(args.tenants)
        address = jobs.resolve_address(args.address)
        rm = jobs.runtime(address)
        register(rm, tenants)
        client = jobs.job_client()
        here = str(Path(__file__).resolve().parent)
        entry = ["python", "train.py", "--steps", str(args.steps), "--seconds", str(args.seconds)]
        ids = {}
        for tenant, _ in tenants:
            found = jobs.tenant_credential(tenant)
            if found is None:
                raise jobs.CliError(f"tenant {tenant} is registered, but its credential is not in "
                                    f"{jobs.credential_path(tenant)}: `pathways tenants set {tenant} "
                                    "--new-credential` issues a new one there")
            job = jobs.new_submission_id(tenant)
            ids[tenant] = jobs.submit(client, tenant, jobs.issue_ticket(rm, tenant, found[0], job), entry, here, job)
    except jobs.CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for tenant, job in ids.items():
        print(f"submitted {job} (tenant {tenant}) to {address}")
    if args.no_wait:
        return 0
    print("while they run: pathways status | pathways jobs | pathways logs <id> --follow", flush=True)
    deadline = time.monotonic() + args.timeout
    while True:
        states = {t: str(client.get_job_status(j).value) for t, j in ids.items()}
        for tenant, job in ids.items():
            print(f"  {tenant:>8} {states[tenant]:<9} {last_line(client.get_job_logs(job), f'[{tenant}]')}")
        if all(s in ("SUCCEEDED", "FAILED", "STOPPED") for s in states.values()):
            break
        if time.monotonic() > deadline:
            print(f"error: jobs still running after {args.timeout:.0f}s: {states}", file=sys.stderr)
            return 1
        time.sleep(5.0)
    for tenant, job in ids.items():
        if states[tenant] != "SUCCEEDED":
            print(f"--- {tenant} ({job}) {states[tenant]}:\n{client.get_job_logs(job)[-3000:]}", file=sys.stderr)
    return 0 if all(s == "SUCCEEDED" for s in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
