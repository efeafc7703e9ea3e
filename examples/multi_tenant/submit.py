"""Submit one training job per tenant at once through Ray's job submission API, then follow them.

    python -m examples.multi_tenant.submit [--address ADDR] [--tenants alice:1,bob:3] [--steps N]

Each job ships this folder as its working directory and runs ``python train.py``; the tenant and
weight reach ``pw.init()`` through the job's environment (PATHWAYS_TENANT, PATHWAYS_WEIGHT).
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
            out.append((name.strip(), float(weight or 1)))
        except ValueError:
            raise jobs.CliError(f"--tenants: {item!r} is not NAME:WEIGHT") from None
    for name, weight in out:
        jobs.check_tenant(name, weight)
    return out


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
        client = jobs.job_client()
        here = str(Path(__file__).resolve().parent)
        entry = ["python", "train.py", "--steps", str(args.steps), "--seconds", str(args.seconds)]
        ids = {tenant: jobs.submit(client, tenant, weight, entry, here) for tenant, weight in tenants}
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
