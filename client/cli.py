"""The ``pathways`` console command: start a shared cluster, manage its tenants, submit their jobs, watch it.

    pathways up [--islands N --hosts-per-island H --devices-per-host D] [--port P] [--address ADDR] [--quota D]
    pathways tenants add NAME --weight W [--quota DEVICES]
    pathways tenants list [--json] | set NAME [--weight W] [--quota N | --no-quota] [--new-credential]
    pathways tenants remove NAME
    pathways submit --tenant NAME -- python script.py ...
    pathways status [--json] | pathways jobs | pathways logs JOB [--follow] | pathways stop JOB
    pathways down
    pathways graph script.py:function [--out graph.svg]

Every command talks to ``--address``, else ``RAY_ADDRESS``, else the cluster ``pathways up`` recorded.
``up`` creates the cluster's admin credential (``$PATHWAYS_HOME/admin.token``, readable by its owner
only); the ``tenants`` commands need it. A tenant proves itself with the credential the admin issued
it; ``submit`` exchanges that for a single-use ticket, and only the ticket goes to the job, because
Ray's job API shows every job's entrypoint and environment to anyone. The runtime (resource manager
and islands) lives in detached Ray actors, so it outlives the command that started it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from client import jobs
from client.jobs import CliError, ClusterState
from client.tables import clock, render_status, short, table


def main(argv: list[str] | None = None) -> int:
    """Run the ``pathways`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = parser().parse_args(argv)
    try:
        if args.run is not cmd_graph:
            jobs.enable_token_auth()
        return args.run(args) or 0
    except CliError as exc:
        print(f"pathways: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pathways status | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def parser() -> argparse.ArgumentParser:
    """The ``pathways`` command's argument parser: one subcommand per action, each with a ``run`` function."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", help="Ray address host:port (default: RAY_ADDRESS, else `pathways up`'s)")
    admin = argparse.ArgumentParser(add_help=False)
    admin.add_argument("--admin-credential-file", metavar="FILE",
                       help="the admin credential (default: $PATHWAYS_HOME/admin.token)")
    tenant = argparse.ArgumentParser(add_help=False)
    tenant.add_argument("--credential-file", metavar="FILE", help="the tenant's credential (default: "
                        "PATHWAYS_CREDENTIAL, else $PATHWAYS_HOME/credentials/TENANT)")
    p = argparse.ArgumentParser(prog="pathways", description="Start a shared Pathways cluster on Ray, manage its "
                                "tenants, submit their jobs, watch it, stop it.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    up = sub.add_parser("up", parents=[common], help="start a Ray head (or join --address) and the islands; "
                        "create the admin credential")
    up.add_argument("--islands", type=int, default=2)
    up.add_argument("--hosts-per-island", type=int, default=1)
    up.add_argument("--devices-per-host", type=int, default=4)
    up.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    up.add_argument("--port", type=int, default=6379, help="GCS port of the head this starts (default 6379)")
    up.add_argument("--dashboard-port", type=int, default=None, help="default: 8265 if free, else any free port")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers Ray (default: all)")
    up.add_argument("--quota", type=int, default=None, metavar="DEVICES",
                    help="device quota of tenants added without one (default: no quota)")
    up.add_argument("--registry", metavar="PATH", help="the tenant registry file, a path on the head node "
                    "(default: $PATHWAYS_HOME/registry.json); it outlives `pathways down`")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the cluster to start")
    up.set_defaults(run=cmd_up)

    tn = sub.add_parser("tenants", help="the cluster admin's tenant registry: add, list, set, remove")
    tsub = tn.add_subparsers(required=True, metavar="ACTION")
    ta = tsub.add_parser("add", parents=[common, admin], help="register a tenant; prints its credential once")
    ta.add_argument("name")
    ta.add_argument("--weight", type=float, required=True, help="its share of island time, relative to others")
    ta.add_argument("--quota", type=int, metavar="DEVICES", help="devices its slices may hold at once "
                    "(default: the quota `pathways up --quota` set, else none)")
    ta.set_defaults(run=cmd_tenants_add, action="add")
    tl = tsub.add_parser("list", parents=[common, admin], help="tenants: weight, quota, clients, devices held")
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(run=cmd_tenants_list, action="list")
    ts = tsub.add_parser("set", parents=[common, admin], help="change a tenant's weight, quota or credential")
    ts.add_argument("name")
    ts.add_argument("--weight", type=float)
    quota = ts.add_mutually_exclusive_group()
    quota.add_argument("--quota", type=int, metavar="DEVICES")
    quota.add_argument("--no-quota", action="store_true", help="no device quota")
    ts.add_argument("--new-credential", action="store_true",
                    help="issue a new credential (printed once); the old one stops working")
    ts.set_defaults(run=cmd_tenants_set, action="set")
    tr = tsub.add_parser("remove", parents=[common, admin], help="remove a tenant; its sessions end and what "
                         "it held is reclaimed")
    tr.add_argument("name")
    tr.set_defaults(run=cmd_tenants_remove, action="remove")

    sm = sub.add_parser("submit", parents=[common, tenant], help="submit `-- COMMAND...` as a Ray job of a tenant")
    sm.add_argument("--tenant", required=True)
    sm.add_argument("--weight", help=argparse.SUPPRESS)  # gone: refused with a message that says why
    sm.add_argument("--working-dir", default=".", help="shipped with the job; its cwd (default: .)")
    sm.add_argument("--wait", action="store_true", help="follow the logs; exit 0 only if the job succeeds")
    sm.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- python script.py ...")
    sm.set_defaults(run=cmd_submit)

    st = sub.add_parser("status", parents=[common, admin, tenant], help="islands, hosts, slices, queues, shares: "
                        "the whole cluster with the admin credential, else your tenant's view")
    st.add_argument("--tenant", help="show this tenant's view (default: PATHWAYS_TENANT, when there is no admin "
                    "credential)")
    st.add_argument("--json", action="store_true", help="print the whole ClusterStatus as JSON")
    st.add_argument("--timeout", type=float, default=30.0)
    st.set_defaults(run=cmd_status)

    jb = sub.add_parser("jobs", parents=[common], help="list jobs: id, tenant, status, start, end")
    jb.add_argument("--tenant", help="only this tenant's jobs")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(run=cmd_jobs)

    lg = sub.add_parser("logs", parents=[common, admin, tenant], help="print one of your jobs' logs")
    lg.add_argument("job")
    lg.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    lg.set_defaults(run=cmd_logs)

    sp = sub.add_parser("stop", parents=[common, admin, tenant], help="stop one of your jobs")
    sp.add_argument("job")
    sp.add_argument("--timeout", type=float, default=30.0)
    sp.set_defaults(run=cmd_stop)

    dn = sub.add_parser("down", parents=[common], help="remove the islands; stop the head if `up` started it")
    dn.add_argument("--timeout", type=float, default=30.0)
    dn.set_defaults(run=cmd_down)

    gr = sub.add_parser("graph", help="run SCRIPT.py and print (or --out render) the graph of its @pw.program")
    gr.add_argument("target", metavar="SCRIPT.py:FUNCTION")
    gr.add_argument("--out", help="write the graph here: .dot, or .svg/.png/.pdf with the graphviz extra")
    gr.set_defaults(run=cmd_graph)
    return p


def cmd_graph(args: argparse.Namespace) -> int:
    """``pathways graph``: run a script and print (or write) the graph of one of its programs."""
    from client.graphs import program_graph

    dot = program_graph(args.target, args.out)
    print(f"wrote {args.out}" if args.out else dot, end="\n" if args.out else "")
    return 0


# -- up / down -------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    """``pathways up``: start a Ray head (or join ``--address``) and the runtime on it; create the admin credential."""
    import pathways as pw

    t0 = time.monotonic()
    try:
        topology = pw.Topology(islands=args.islands, hosts_per_island=args.hosts_per_island,
                               devices_per_host=args.devices_per_host, platform=args.platform)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.quota is not None and args.quota < 1:
        raise CliError(f"--quota must be a positive number of devices, got {args.quota}")
    previous = jobs.load_state()
    reuse = previous if previous and jobs.head_alive(previous) else None
    if reuse and (args.address and jobs.resolve_address(args.address) != reuse.address or _runtime_runs(reuse)):
        raise CliError(f"`pathways up` already runs a cluster at {reuse.address}; `pathways down` first")
    registry = args.registry or str((jobs.home() / jobs.REGISTRY_FILE).resolve())
    token, created = jobs.ensure_admin_credential()
    _check_registry(registry, token, args.quota)
    head_pid = temp_dir = dashboard = None
    if reuse:
        address, head_pid, temp_dir, dashboard = reuse.address, reuse.head_pid, reuse.temp_dir, reuse.dashboard
        os.environ["RAY_ADDRESS"] = address
        print(f"the Ray head `pathways up` started at {address} still runs; starting the runtime on it", flush=True)
    elif args.address:
        address = jobs.resolve_address(args.address)
    else:
        dport = args.dashboard_port or (8265 if _port_free(8265) else jobs.free_port())
        address, head_pid, temp_dir = jobs.start_head(args.port, dport, args.num_cpus, args.timeout)
        dashboard = f"http://127.0.0.1:{dport}"
        os.environ["RAY_ADDRESS"] = address
        print(f"Ray head started at {address} (dashboard {dashboard}, logs {temp_dir}) "
              f"in {time.monotonic() - t0:.1f}s", flush=True)
    try:
        joined = _start_runtime(address, topology, token, registry, args.quota, args.timeout)
    except BaseException:
        if head_pid is not None and not reuse:
            jobs.stop_head(head_pid, temp_dir)
        raise
    jobs.save_state(ClusterState(address, dashboard, head_pid, temp_dir, topology.to_wire(), time.time()))
    auth = " RAY_AUTH_MODE=token" if os.environ.get("RAY_AUTH_MODE") == "token" else ""
    print(f"pathways cluster up in {time.monotonic() - t0:.1f}s: {topology}"
          + (" (the runtime already ran there)" if joined else "") + "\n"
          f"  admin credential:    {jobs.admin_path()} ({'created now, ' if created else ''}readable by you only: "
          f"it manages tenants; keep it secret)\n"
          f"  tenant registry:     {registry} (on the head node; kept across `pathways down` / `up`)\n"
          f"  add a tenant:        pathways tenants add NAME --weight W [--quota DEVICES]\n"
          f"  submit a job:        pathways submit --tenant NAME -- python script.py\n"
          f"  attach from Python:  pw.init(address=\"{address}\", tenant=NAME)   (with NAME's credential)\n"
          f"  attach from a shell: export RAY_ADDRESS={address}{auth}\n"
          f"  watch / stop:        pathways status | pathways tenants list | pathways jobs | pathways down")
    return 0


def _runtime_runs(state: ClusterState) -> bool:
    from client.runtime import find_runtime

    _connect(state.address)
    return find_runtime() is not None


def _check_registry(path: str, token: str, quota: int | None = None) -> None:
    """Refuse a registry file on this machine that another admin credential wrote: the runtime would keep that
    one, and this admin would be locked out of it. Say so when it keeps another default quota than --quota."""
    from pathways.auth import digest

    try:
        data = json.loads(Path(path).read_text())
        owner, kept = data.get("admin"), data.get("default_quota")
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError) as exc:
        raise CliError(f"the tenant registry {path} is unreadable ({exc}); fix or move it") from None
    if owner and owner != digest(token):
        raise CliError(f"the tenant registry {path} belongs to another admin credential than {jobs.admin_path()}: "
                       "put that admin.token back, or move the registry away to start with no tenants")
    if quota is not None and kept != quota:
        print(f"note: the tenant registry {path} keeps the default quota it was created with "
              f"({'none' if kept is None else kept}); --quota applies to a new registry", flush=True)


def _start_runtime(address: str, topology: Any, token: str, registry: str, quota: int | None,
                   timeout: float) -> bool:
    """Create the resource manager (a detached actor that starts and owns the islands; they outlive us), unless
    one runs already; check that it takes this admin credential. Returns whether one ran already."""
    import ray

    from client.runtime import Timeouts, find_runtime, start_runtime
    from pathways.auth import digest
    from pathways.errors import PathwaysError

    _connect(address)
    existed = find_runtime() is not None
    try:
        rm = start_runtime(topology, Timeouts(start=timeout), digest(token), registry_path=registry,
                           default_quota=quota)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    who = jobs.whoami(rm, "", token)
    ray.shutdown()
    if not (who and who["admin"]):
        raise CliError(f"the pathways runtime at {address} does not take the admin credential in "
                       f"{jobs.admin_path()}: another admin started it (or its registry was written with "
                       "another admin credential)")
    return existed


def _port_free(port: int) -> bool:
    try:
        jobs.check_port_free(port, "dashboard")
    except CliError:
        return False
    return True


def cmd_down(args: argparse.Namespace) -> int:
    """``pathways down``: remove the runtime's actors, and stop the Ray head if ``pathways up`` started it."""
    address = jobs.resolve_address(args.address)
    state = jobs.load_state()
    ours = state if state and state.address == address and state.owns_head else None
    if ours and not jobs.head_alive(ours):
        print(f"the Ray head at {address} is already gone")
    else:
        removed = _remove_runtime(address, stop_jobs=ours is None)
        print("removed the resource manager and its islands" if removed
              else f"no pathways runtime was running at {address}")
    if ours:
        took = jobs.stop_head(ours.head_pid, ours.temp_dir, args.timeout)
        print(f"stopped the Ray head at {address} that `pathways up` started ({took:.1f}s)")
    else:
        print(f"left the Ray head at {address} running: `pathways up` did not start it")
    if state and state.address == address:
        jobs.clear_state()
    registry = jobs.home() / jobs.REGISTRY_FILE
    if registry.exists():
        print(f"the tenant registry stays in {registry}: the next `pathways up` keeps its tenants")
    return 0


def _remove_runtime(address: str, stop_jobs: bool) -> list[str]:
    """Kill the runtime's named actors, the resource manager first (it owns the islands' actors, so
    they die with it). On a head we keep, also stop the jobs `pathways submit` started that still
    run: they would recreate a resource manager."""
    import ray

    from pathways.names import NAMESPACE, RESOURCE_MANAGER

    _connect(address)

    def named() -> list[str]:
        return sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == NAMESPACE and (a["name"] == RESOURCE_MANAGER
                                                            or a["name"].startswith("island-"))),
                      key=lambda n: n != RESOURCE_MANAGER)

    names = named()
    for name in names:
        for attempt in range(3):  # a handle can fail to load while the GCS is busy; retry briefly
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                break
            except ValueError:  # already gone: its owner (the resource manager) died first
                break
            except Exception as exc:
                if attempt == 2:
                    print(f"could not kill {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                time.sleep(0.5)
    deadline = time.monotonic() + 30
    while (left := named()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise CliError(f"these runtime actors survived: {left}")
    ray.shutdown()
    if stop_jobs:
        client = jobs.job_client(timeout=10.0)
        for row in jobs.job_rows(client):
            if row["tenant"] != "-" and row["status"] in ("PENDING", "RUNNING"):
                client.stop_job(row["id"])
                print(f"stopped job {row['id']} (tenant {row['tenant']})")
    return names


def _connect(address: str) -> None:
    from client.runtime import connect
    from pathways.errors import PathwaysError

    try:
        connect(address)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


# -- tenants (the admin's) -------------------------------------------------------------------------

def _admin(args: argparse.Namespace) -> Any:
    from client.admin import Admin

    credential = jobs.need_admin_credential(args.admin_credential_file, f"`pathways tenants {args.action}`")
    return Admin(jobs.runtime(jobs.resolve_address(args.address)), credential)


def _as_admin(fn: Any, *a: Any, **kw: Any) -> Any:
    """Run one admin operation; what the resource manager refuses becomes a one-line error."""
    from ray.exceptions import GetTimeoutError, RayActorError

    from pathways.errors import PathwaysError

    try:
        return fn(*a, **kw)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    except GetTimeoutError:
        raise CliError("the resource manager did not answer in time") from None
    except RayActorError:
        raise CliError("the resource manager is gone; restart it with `pathways up`") from None


def _check_weight(weight: float | None) -> None:
    if weight is not None and not (math.isfinite(weight) and weight > 0):
        raise CliError(f"--weight must be a positive number, got {weight:g}")


def _check_quota(quota: int | None) -> None:
    if quota is not None and quota < 0:
        raise CliError(f"--quota must be a number of devices >= 0, got {quota}")


def _tenant_line(t: dict) -> str:
    return f"tenant {t['name']}: weight {t['weight']:g}, quota {'none' if t['quota'] is None else t['quota']}"


def _show_credential(name: str, secret: str) -> None:
    path = jobs.write_secret(jobs.credential_path(name), secret)
    print(f"credential of {name} (shown only this once): {secret}\n"
          f"  saved to {path} (readable by you only); there `pathways submit --tenant {name}` and "
          f"pw.init(tenant=\"{name}\") find it.\n"
          f"  Hand it to {name} over a private channel; on their machine they save it as "
          f"$PATHWAYS_HOME/credentials/{name} (or set PATHWAYS_CREDENTIAL).")


def cmd_tenants_add(args: argparse.Namespace) -> int:
    """``pathways tenants add``: register a tenant and print its credential once."""
    jobs.check_tenant(args.name)
    _check_weight(args.weight)
    _check_quota(args.quota)
    admin = _admin(args)
    secret = _as_admin(admin.add_tenant, args.name, args.weight, args.quota)
    (record,) = [t for t in _as_admin(admin.tenants) if t["name"] == args.name]
    print(f"added {_tenant_line(record)}")
    _show_credential(args.name, secret)
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    """``pathways tenants list``: every tenant with its weight, quota, clients and devices held."""
    rows = _as_admin(_admin(args).tenants)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES"],
                [[t["name"], f"{t['weight']:g}", "-" if t["quota"] is None else t["quota"], t["clients"],
                  t["devices"]] for t in rows]) if rows else "no tenants: add one with `pathways tenants add`")
    return 0


def cmd_tenants_set(args: argparse.Namespace) -> int:
    """``pathways tenants set``: change a tenant's weight, quota or credential."""
    if args.weight is None and args.quota is None and not args.no_quota and not args.new_credential:
        raise CliError("nothing to change: pass --weight W, --quota DEVICES, --no-quota or --new-credential")
    _check_weight(args.weight)
    _check_quota(args.quota)
    admin = _admin(args)
    change: dict[str, Any] = {"weight": args.weight, "new_credential": args.new_credential}
    if args.quota is not None or args.no_quota:
        change["quota"] = args.quota
    secret = _as_admin(admin.set_tenant, args.name, **change)
    (record,) = [t for t in _as_admin(admin.tenants) if t["name"] == args.name]
    print(f"changed {_tenant_line(record)}")
    if secret:
        _show_credential(args.name, secret)
    return 0


def cmd_tenants_remove(args: argparse.Namespace) -> int:
    """``pathways tenants remove``: remove a tenant (its sessions end) and delete its saved credential."""
    _as_admin(_admin(args).remove_tenant, args.name)
    print(f"removed tenant {args.name}: its sessions ended and its slices and buffers were reclaimed")
    path = jobs.credential_path(args.name)
    if path.exists():
        path.unlink()
        print(f"  deleted its credential {path}")
    return 0


# -- status ----------------------------------------------------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    """``pathways status``: the whole cluster with the admin credential, else one tenant's view."""
    admin_credential = None if args.tenant else jobs.admin_credential(args.admin_credential_file)
    tenant = args.tenant or os.environ.get(jobs.TENANT_ENV)
    if admin_credential is None and not tenant:
        raise CliError(f"`pathways status` shows the whole cluster with the admin credential ({jobs.admin_path()} "
                       "or --admin-credential-file), or one tenant's view: set PATHWAYS_TENANT (or pass --tenant) "
                       "and hold its credential")
    address = jobs.resolve_address(args.address)
    rm = jobs.runtime(address)
    if admin_credential is not None:
        from client.admin import Admin
        from client.status import admin_status

        admin = Admin(rm, admin_credential, timeout=args.timeout)
        snapshot = _as_admin(admin_status, admin, args.timeout)
        refusals = _as_admin(admin.state).get("refusals", [])
    else:
        snapshot, refusals = _tenant_status(address, tenant, args.credential_file, args.timeout), None
    if args.json:
        print(json.dumps({**asdict(snapshot), "view": "admin" if refusals is not None else f"tenant {tenant}",
                          **({"refusals": refusals} if refusals is not None else {})}, indent=2, default=str))
    else:
        print(render_status(snapshot, address, refusals))
    return 0


def _tenant_status(address: str, tenant: str, credential_file: str | None, timeout: float) -> Any:
    import pathways as pw

    found = jobs.tenant_credential(jobs.check_tenant(tenant), credential_file)
    if found is None:
        raise CliError(_no_credential(tenant))
    try:
        pw.init(address=address, tenant=tenant, credential=found[0])
        return pw.status(timeout=timeout)
    except pw.PathwaysError as exc:
        raise CliError(str(exc)) from None
    finally:
        pw.shutdown()


# -- jobs ------------------------------------------------------------------------------------------

def _no_credential(tenant: str) -> str:
    return (f"no credential for tenant {tenant!r}: pass --credential-file FILE, set PATHWAYS_CREDENTIAL, or save "
            f"it as {jobs.credential_path(tenant)} (the cluster's admin issues it: `pathways tenants add`)")


def cmd_submit(args: argparse.Namespace) -> int:
    """``pathways submit``: run a command as a Ray job of a tenant, handing it a single-use ticket."""
    if args.weight is not None:
        raise CliError("submit takes no --weight: a tenant's weight is the cluster admin's to set "
                       "(`pathways tenants set NAME --weight W`)")
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    tenant = jobs.check_tenant(args.tenant)
    if not entrypoint:
        raise CliError("nothing to run: put the command after `--`, e.g. pathways submit --tenant a -- python x.py")
    working_dir = os.path.abspath(args.working_dir)
    if not Path(working_dir).is_dir():
        raise CliError(f"working directory {args.working_dir!r} does not exist")
    found = jobs.tenant_credential(tenant, args.credential_file)
    if found is None:
        raise CliError(_no_credential(tenant))
    address = jobs.resolve_address(args.address)
    job_id = jobs.new_submission_id(tenant)
    ticket = jobs.issue_ticket(jobs.runtime(address), tenant, found[0], job_id)
    client = jobs.job_client()
    jobs.submit(client, tenant, ticket, entrypoint, working_dir, job_id)
    print(f"submitted {job_id} (tenant {tenant}) to {address}", flush=True)
    if not args.wait:
        print(f"  follow it: pathways logs {job_id} --follow")
        return 0
    jobs.follow_logs(client, job_id, lambda s: print(s, end="", flush=True))
    status = jobs.wait_job(client, job_id, timeout=60)
    # Ray appends the log tail to the message; it was just printed.
    message = (client.get_job_info(job_id).message or "").split(", last available logs")[0] if status != "SUCCEEDED" \
        else ""
    print(f"job {job_id} {status}" + (f": {message}" if message else ""))
    return 0 if status == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    """``pathways jobs``: every submitted job with its tenant and status."""
    jobs.resolve_address(args.address)
    rows = [r for r in jobs.job_rows(jobs.job_client()) if not args.tenant or r["tenant"] == args.tenant]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"],
                [[r["id"], r["tenant"], r["status"], clock(r["start"]), clock(r["end"]), short(r["entrypoint"], 48)]
                 for r in rows]) if rows else "no jobs")
    return 0


def _own_job(args: argparse.Namespace, what: str) -> Any:
    """The job client, once the caller has shown it may act on ``args.job``: it holds the admin credential, or
    the credential of the tenant that submitted the job (the resource manager checks either)."""
    address = jobs.resolve_address(args.address)
    client = jobs.job_client()
    tenant = jobs.job_tenant(client, args.job)
    rm = jobs.runtime(address)
    admin = jobs.admin_credential(args.admin_credential_file)
    if admin is not None and (jobs.whoami(rm, "", admin) or {}).get("admin"):
        return client
    found = jobs.tenant_credential(tenant, args.credential_file) if tenant and jobs.TENANT_PATTERN.match(tenant) \
        else None
    if found is not None and jobs.whoami(rm, tenant, found[0]) is not None:
        return client
    raise CliError(f"job {args.job} is not yours: `pathways {what}` acts only on jobs of a tenant whose credential "
                   "you hold, or on any job with the cluster's admin credential")


def cmd_logs(args: argparse.Namespace) -> int:
    """``pathways logs``: print (or follow) the logs of a job the caller may act on."""
    client = _own_job(args, "logs")
    if args.follow:
        jobs.follow_logs(client, args.job, lambda s: print(s, end="", flush=True))
    else:
        print(client.get_job_logs(args.job), end="")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """``pathways stop``: stop a job the caller may act on, and wait until it ends."""
    client = _own_job(args, "stop")
    client.stop_job(args.job)
    print(f"job {args.job} {jobs.wait_job(client, args.job, args.timeout)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
