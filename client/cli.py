"""The ``pathways`` console command: start a shared cluster, manage its tenants, submit their jobs, watch it.

    pathways up [--islands N --hosts-per-island H --devices-per-host D] [--port P] [--client-port C]
                [--ray-address RAY_ADDRESS] [--quota D] [--jobs-dir DIR] [--unsafe-jobs-as-runtime-user]
    pathways tenants add NAME --weight W [--quota DEVICES] [--budget NAME=VALUE ...] [--job-user USER]
                                                                                      (prints a login command)
    pathways tenants list [--json] | set NAME [...] | remove NAME
    pathways login pathways://HOST:PORT --tenant NAME --credential SECRET     (a tenant, on their own machine)
    pathways submit [--tenant NAME] -- python script.py ...
    pathways status [--json] | pathways jobs | pathways logs JOB [--follow] | pathways stop JOB
    pathways down
    pathways graph script.py:function [--out graph.svg]

Every command talks to the runtime's address: ``--address``, else ``PATHWAYS_ADDRESS``, else the one
``pathways login`` saved, else the cluster ``pathways up`` started on this machine. ``up`` creates the
cluster's admin credential (``$PATHWAYS_HOME/admin.token``, readable by its owner only); the ``tenants``
commands need it. A tenant proves itself with the credential the admin issued it. The command never imports
Ray: ``up`` and ``down`` run ``python -m resource_manager.launch``, the only Ray driver, for the runtime.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from client import head, secrets
from client.head import ClusterState
from client.jobs import Jobs, entrypoint_of, pack, working_dir_of
from client.link import Link, expect_role
from client.runtime import (
    DEFAULT_TENANT,
    Login,
    Timeouts,
    home,
    load_login,
    login_path,
    machine_runtime,
    save_login,
)
from client.secrets import CliError
from client.tables import clock, render_status, short, table
from pathways.errors import PathwaysError, TenantAccessError
from pathways.names import ADDRESS_ENV
from pathways.requests import WhoAmI

CLIENT_PORT = 7100  # where `pathways up` serves the runtime's address by default


def main(argv: list[str] | None = None) -> int:
    """Run the ``pathways`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = parser().parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a kill or a closed terminal unwinds like Ctrl-C: nothing is left
        signal.signal(sig, _interrupted)
    try:
        return args.run(args) or 0
    except CliError as exc:
        print(f"pathways: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pathways status | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def say(text: str) -> None:
    """Print a line for the user; a reader that went away (``| head``) never stops the command."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def parser() -> argparse.ArgumentParser:
    """The ``pathways`` command's argument parser: one subcommand per action, each with a ``run`` function."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", help="the runtime's address pathways://HOST:PORT (default: PATHWAYS_ADDRESS, "
                        "else `pathways login`'s, else the cluster `pathways up` started here)")
    admin = argparse.ArgumentParser(add_help=False)
    admin.add_argument("--admin-credential-file", metavar="FILE",
                       help="the admin credential (default: $PATHWAYS_HOME/admin.token)")
    tenant = argparse.ArgumentParser(add_help=False)
    tenant.add_argument("--tenant", help="the tenant to act as (default: PATHWAYS_TENANT, else `pathways login`'s)")
    tenant.add_argument("--credential-file", metavar="FILE", help="the tenant's credential (default: "
                        "PATHWAYS_CREDENTIAL, else $PATHWAYS_HOME/credentials/TENANT, else `pathways login`'s)")
    p = argparse.ArgumentParser(prog="pathways", description="Start a shared Pathways cluster on Ray, manage its "
                                "tenants, submit their jobs, watch it, stop it.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start a Ray head (or join --ray-address) and the runtime; create the admin "
                        "credential; print the runtime's address")
    up.add_argument("--islands", type=int, default=2)
    up.add_argument("--hosts-per-island", type=int, default=1)
    up.add_argument("--devices-per-host", type=int, default=4)
    up.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    up.add_argument("--port", type=int, default=6379, help="GCS port of the Ray head this starts (default 6379)")
    up.add_argument("--client-port", type=int, default=CLIENT_PORT,
                    help=f"the runtime's client port: its address is pathways://HOST:PORT (default {CLIENT_PORT})")
    up.add_argument("--ray-address", metavar="HOST:PORT", help="start the runtime on this running Ray cluster "
                    "instead of starting a head")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers Ray (default: all)")
    up.add_argument("--quota", type=int, default=None, metavar="DEVICES",
                    help="device quota of tenants added without one (default: no quota)")
    up.add_argument("--registry", metavar="PATH", help="the tenant registry file, a path on the head node "
                    "(default: $PATHWAYS_HOME/registry.json); it outlives `pathways down`")
    up.add_argument("--jobs-dir", metavar="DIR", help="where tenants' jobs unpack and log, a folder of the runtime's "
                    "user alone on the head node (default: /var/lib/pathways/jobs as root, else "
                    "$PATHWAYS_HOME/jobs)")
    up.add_argument("--unsafe-jobs-as-runtime-user", action="store_true",
                    help="UNSAFE: run every tenant's jobs as the runtime's own user, where they can read the "
                    "runtime's files, Ray's token and each other's memory and files (default: each tenant's jobs "
                    "run as an OS user of the tenant's own, which needs the runtime to run as root)")
    up.add_argument("--job-user", help=argparse.SUPPRESS)  # replaced: refused with what to use instead
    up.add_argument("--session-grace", type=float, default=Timeouts().grace, metavar="SECONDS",
                    help="how long a session whose client vanished is kept before it is reclaimed")
    up.add_argument("--suspend-dir", metavar="DIR", help="where SIGTERM to the runtime (a preemption notice) "
                    "suspends the cluster, and the default of `pathways suspend`: a path on the head node or an "
                    "fsspec URL")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the cluster to start")
    up.set_defaults(run=cmd_up)

    su = sub.add_parser("suspend", parents=[common, admin], help="save every tenant's arrays, sessions and "
                        "executables into DIR and stop the islands; attached clients wait")
    su.add_argument("dir", nargs="?", metavar="DIR", help="a new or empty directory on the head node, or an fsspec "
                    "URL (default: `up --suspend-dir`)")
    su.add_argument("--timeout", type=float, default=60.0, help="seconds each step may take (default 60)")
    su.set_defaults(run=cmd_suspend)
    rs = sub.add_parser("resume", parents=[common, admin], help="restore a suspended cluster from DIR, here or on "
                        "a new cluster of the same topology; attached clients go on")
    rs.add_argument("dir", nargs="?", metavar="DIR", help="what `pathways suspend` wrote (default: where this "
                    "runtime was suspended to)")
    rs.add_argument("--timeout", type=float, default=60.0, help="seconds each step may take (default 60)")
    rs.set_defaults(run=cmd_resume)

    dn = sub.add_parser("down", parents=[admin], help="stop the runtime and its jobs; stop the Ray head if `up` "
                        "started it (also what an interrupted `up` left)")
    dn.add_argument("--timeout", type=float, default=30.0)
    dn.set_defaults(run=cmd_down)

    lg = sub.add_parser("login", help="save a runtime's address, your tenant and its credential for this machine's "
                        "`pathways` and pw.init()")
    lg.add_argument("login_address", metavar="ADDRESS", help="pathways://HOST:PORT, as the admin gave it")
    lg.add_argument("--tenant", required=True)
    who = lg.add_mutually_exclusive_group(required=True)
    who.add_argument("--credential", help="the credential the admin issued")
    who.add_argument("--credential-file", metavar="FILE", help="a file holding it")
    lg.set_defaults(run=cmd_login)
    lo = sub.add_parser("logout", help="forget what `pathways login` saved")
    lo.set_defaults(run=cmd_logout)

    tn = sub.add_parser("tenants", help="the cluster admin's tenant registry: add, list, set, remove")
    tsub = tn.add_subparsers(required=True, metavar="ACTION")
    ta = tsub.add_parser("add", parents=[common, admin], help="register a tenant; prints its login command once")
    ta.add_argument("name")
    ta.add_argument("--weight", type=float, required=True, help="its share of island time, relative to others")
    ta.add_argument("--quota", type=int, metavar="DEVICES", help="devices its slices may hold at once "
                    "(default: the quota `pathways up --quota` set, else none)")
    ta.add_argument("--budget", action="append", default=[], metavar="NAME=VALUE",
                    help="a per-tenant budget other than the default, e.g. host_bytes=4294967296 (repeatable)")
    ta.add_argument("--job-user", metavar="USER", help="the OS user its jobs run as, dedicated to them (default: "
                    "one the runtime makes, where it runs as root)")
    ta.set_defaults(run=cmd_tenants_add, action="add")
    tl = tsub.add_parser("list", parents=[common, admin], help="tenants: weight, quota, clients, devices held")
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(run=cmd_tenants_list, action="list")
    ts = tsub.add_parser("set", parents=[common, admin], help="change a tenant's weight, quota, budgets or "
                         "credential")
    ts.add_argument("name")
    ts.add_argument("--weight", type=float)
    quota = ts.add_mutually_exclusive_group()
    quota.add_argument("--quota", type=int, metavar="DEVICES")
    quota.add_argument("--no-quota", action="store_true", help="no device quota")
    ts.add_argument("--budget", action="append", default=[], metavar="NAME=VALUE", help="change a budget")
    ts.add_argument("--job-user", metavar="USER", help="the OS user its next jobs run as, dedicated to them")
    ts.add_argument("--new-credential", action="store_true",
                    help="issue a new credential (printed once); the old one, its sessions and its jobs' unused "
                    "tickets stop working at once")
    ts.set_defaults(run=cmd_tenants_set, action="set")
    tr = tsub.add_parser("remove", parents=[common, admin], help="remove a tenant; its sessions and jobs end and "
                         "what it held is reclaimed")
    tr.add_argument("name")
    tr.set_defaults(run=cmd_tenants_remove, action="remove")

    sm = sub.add_parser("submit", parents=[common, tenant], help="run `-- COMMAND...` as a job of your tenant")
    sm.add_argument("--working-dir", default=".", help="shipped with the job; its cwd (default: .)")
    sm.add_argument("--name", help="the job's id (default: TENANT-TIME-RANDOM)")
    sm.add_argument("--wait", action="store_true", help="follow the log; exit 0 only if the job succeeds")
    sm.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- python script.py ...")
    sm.set_defaults(run=cmd_submit)

    st = sub.add_parser("status", parents=[common, admin, tenant], help="islands, hosts, slices, queues, shares: "
                        "the whole cluster with the admin credential, else your tenant's view")
    st.add_argument("--json", action="store_true", help="print the whole ClusterStatus as JSON")
    st.add_argument("--timeout", type=float, default=30.0)
    st.set_defaults(run=cmd_status)

    jb = sub.add_parser("jobs", parents=[common, admin, tenant], help="list jobs: id, tenant, status, start, end")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(run=cmd_jobs)
    lg = sub.add_parser("logs", parents=[common, admin, tenant], help="print one of your jobs' logs")
    lg.add_argument("job")
    lg.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    lg.set_defaults(run=cmd_logs)
    sp = sub.add_parser("stop", parents=[common, admin, tenant], help="stop one of your jobs")
    sp.add_argument("job")
    sp.set_defaults(run=cmd_stop)

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


# -- where the runtime is ----------------------------------------------------------------------------

def resolve_address(arg: str | None) -> str:
    """``--address``, else ``PATHWAYS_ADDRESS``, else the saved login's, else the cluster ``pathways up``
    recorded or started on this machine; CliError saying how to get one otherwise."""
    if arg or os.environ.get(ADDRESS_ENV):
        return arg or os.environ[ADDRESS_ENV]
    try:
        saved = load_login()
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    if saved is not None:
        return saved.address
    state = head.load_state()
    if state is not None and state.address:
        return state.address
    running = machine_runtime()
    if running is not None:
        return running
    raise CliError("no cluster: pass --address pathways://HOST:PORT, set PATHWAYS_ADDRESS, run `pathways login` "
                   "with what your admin gave you, or start one here with `pathways up`")


def _launch(mode: str, options: dict, timeout: float) -> dict:
    """Run ``python -m resource_manager.launch MODE`` (the runtime's only Ray driver) with ``options``."""
    env = {k: v for k, v in os.environ.items() if k not in head.PRIVATE_ENV}
    try:
        proc = subprocess.run([sys.executable, "-m", "resource_manager.launch", mode], input=json.dumps(options) + "\n",
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CliError(f"the runtime did not answer `{mode}` within {timeout:.0f}s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if "error" in answer or not answer:
        text = answer.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CliError(text)
    return answer


# -- up / down -------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    """``pathways up``: start a Ray head (or use ``--ray-address``) and the runtime on it; create the admin
    credential; print the runtime's address and how tenants attach."""
    import pathways as pw

    t0 = time.monotonic()
    try:
        topology = pw.Topology(islands=args.islands, hosts_per_island=args.hosts_per_island,
                               devices_per_host=args.devices_per_host, platform=args.platform)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.quota is not None and args.quota < 1:
        raise CliError(f"--quota must be a positive number of devices, got {args.quota}")
    if not (math.isfinite(args.session_grace) and args.session_grace > 0):
        raise CliError(f"--session-grace must be a positive number of seconds, got {args.session_grace}")
    if args.job_user is not None:
        raise CliError("`pathways up --job-user` is gone: every tenant's jobs shared that one user, so one tenant's "
                       "job could read another's. Each tenant's jobs now run as an OS user of the tenant's own, which "
                       "`pathways tenants add` makes where the runtime runs as root; to name one, `pathways tenants "
                       "add|set NAME --job-user USER`")
    _leftovers()
    registry = args.registry or str((home() / "registry.json").resolve())
    token, created = secrets.ensure_admin_credential()
    _check_registry(registry, token, args.quota)
    if not args.ray_address:
        head.check_port_free(args.client_port, "the runtime's client")
    started: dict[str, Any] = {"pid": None, "dir": None}  # the head, the moment its process exists
    try:
        if args.ray_address:
            ray_address = args.ray_address
        else:
            def record(pid: int, folder: str) -> None:
                started.update(pid=pid, dir=folder)
                head.save_state(ClusterState(None, None, pid, folder, topology.to_wire(), time.time(), "starting"))

            ray_address, _, _ = head.start_head(args.port, args.num_cpus, args.timeout, record,
                                                    frozenset({args.client_port}))
            say(f"Ray head started at {ray_address} (logs {started['dir']}) in {time.monotonic() - t0:.1f}s")
        head.save_state(ClusterState(None, ray_address, started["pid"], started["dir"], topology.to_wire(),
                                     time.time(), "starting"))
        timeouts = Timeouts(start=args.timeout, grace=args.session_grace)
        info = _launch("up", {"ray_address": ray_address, "topology": topology.to_wire(), "admin_credential": token,
                              "registry": registry, "default_quota": args.quota, "jobs_dir": _jobs_dir(args.jobs_dir),
                              "unsafe_jobs_as_runtime_user": args.unsafe_jobs_as_runtime_user,
                              "client_ports": [args.client_port, args.client_port], "op_timeout": timeouts.op,
                              "gap_timeout": timeouts.gap, "start_timeout": timeouts.start, "grace": timeouts.grace,
                              "suspend_dir": _location(args.suspend_dir)},
                       args.timeout + 60)
    except BaseException:  # Ctrl-C, a kill, a failure: take down what this `up` started, and forget it
        if started["pid"] is not None:
            head.stop_head(started["pid"], started["dir"], timeout=5.0)
        head.clear_state()
        raise
    head_pid, temp_dir = started["pid"], started["dir"]
    address = info["address"]
    head.save_state(ClusterState(address, ray_address, head_pid, temp_dir, topology.to_wire(), time.time()))
    head.publish(address)
    attach = _own_tenant(address, token)
    say(f"pathways cluster up in {time.monotonic() - t0:.1f}s: {topology}\n"
          f"  address:             {address}   (tenants attach here; no Ray address or token needed)\n"
          f"  admin credential:    {secrets.admin_path()} ({'created now, ' if created else ''}readable by you "
          f"only: it manages tenants; keep it secret)\n"
          f"  tenant registry:     {registry} (kept across `pathways down` / `up`)\n"
          f"  jobs run as:         {_jobs_run_as(args)}\n"
          f"  add a tenant:        pathways tenants add NAME --weight W [--quota DEVICES]   (prints its login)\n"
          f"  submit a job:        pathways submit --tenant NAME -- python script.py\n"
          f"  attach from Python:  {attach}\n"
          f"  watch / stop:        pathways status | pathways tenants list | pathways jobs | pathways down\n"
          f"  suspend / resume:    pathways suspend {args.suspend_dir or 'DIR'} | pathways resume"
          + (f"   (SIGTERM to the runtime suspends into {args.suspend_dir})" if args.suspend_dir else ""))
    return 0


def _own_tenant(address: str, token: str) -> str:
    """Make tenant ``default`` the admin's own: registered (weight 1, unless the registry keeps it already) with a
    credential that works, saved readable by this user only where a bare ``pw.init()`` of this user on this machine
    finds it (another user has another home, and could not read it). Returns how to attach from Python, for
    ``up``'s summary: what works, and what to do instead where registering failed."""
    from client.admin import Admin

    path = secrets.credential_path(DEFAULT_TENANT)
    saved = secrets.read_secret(path)
    try:
        if saved is None or not _proves(address, DEFAULT_TENANT, saved):
            admin = Admin.connect(address, token)
            try:
                known = any(t["name"] == DEFAULT_TENANT for t in admin.tenants())
                secret = (admin.set_tenant(DEFAULT_TENANT, new_credential=True) if known
                          else admin.add_tenant(DEFAULT_TENANT, 1.0))
            finally:
                admin.close()
            secrets.write_secret(path, secret)
    except PathwaysError as exc:
        return (f"not as you yet: registering tenant {DEFAULT_TENANT} failed ({exc}); `pathways tenants add NAME "
                "--weight W`, then pw.init(tenant=NAME)")
    return (f"pw.init()   (you, on this machine: tenant {DEFAULT_TENANT}, its credential in {path}, readable by you "
            "only)\n                       anyone else: `pathways tenants add NAME --weight W`, then the `pathways "
            "login` it prints")


def _proves(address: str, tenant: str, credential: str) -> bool:
    """Whether ``credential`` is ``tenant``'s at the runtime at ``address``."""
    link = Link(address, 0, None, expect_role(None, "rm"), "the resource manager")
    try:
        return link.call(lambda rid: WhoAmI(rid, tenant, credential), 30).get("tenant") == tenant
    except TenantAccessError:
        return False
    finally:
        link.close()


def _jobs_dir(directory: str | None) -> str | None:
    """``--jobs-dir`` as the runtime on this machine reads it: absolute."""
    return os.path.abspath(os.path.expanduser(directory)) if directory else None


def _jobs_run_as(args: argparse.Namespace) -> str:
    """Who tenants' jobs run as, for ``up``'s summary."""
    if args.unsafe_jobs_as_runtime_user:
        return ("the runtime's own user (--unsafe-jobs-as-runtime-user: any job can read the runtime's files, Ray's "
                "token and every other job)")
    if args.ray_address:
        return ("an OS user of each tenant's own where the Ray cluster runs as root (`pathways tenants add` makes "
                "it); elsewhere `pathways submit` is refused")
    if os.geteuid() == 0:
        return "an OS user of each tenant's own (`pathways tenants add` makes it, or --job-user USER there)"
    return ("no one: the runtime is not root, so it cannot give each tenant's jobs a user of their own, and "
            "`pathways submit` is refused; run `pathways up` as root")


def _location(directory: str | None) -> str | None:
    """A suspend directory as the runtime on this machine reads it: absolute, or an fsspec URL as given."""
    if not directory or "://" in directory:
        return directory
    return os.path.abspath(os.path.expanduser(directory))


def _suspend_or_resume(args: argparse.Namespace, op: str) -> dict:
    from client.admin import Admin

    if not (math.isfinite(args.timeout) and 0 < args.timeout <= 86400):
        raise CliError(f"--timeout must be a number of seconds between 0 and 86400, got {args.timeout}")
    credential = secrets.need_admin_credential(args.admin_credential_file, f"`pathways {op}`")
    try:
        admin = Admin.connect(resolve_address(args.address), credential)
        return getattr(admin, op)(_location(args.dir), args.timeout)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def cmd_suspend(args: argparse.Namespace) -> int:
    """``pathways suspend``: save the cluster into a directory and stop its islands."""
    done = _suspend_or_resume(args, "suspend")
    say(f"suspended into {done['suspended']} in {done['seconds']:.1f}s: {done['buffers']} buffers "
        f"({done['bytes'] / 2**30:.3f} GiB) of {done['sessions']} sessions. The islands are stopped; attached "
        f"clients wait. Resume with `pathways resume` (here, or after `pathways down` and `pathways up` with the same "
        f"topology: `pathways resume {done['suspended']}`)")
    if done.get("clients_silent"):
        say(f"  clients {done['clients_silent']} did not say they stopped sending: messages they send meanwhile go "
            "after the resume")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """``pathways resume``: restore a suspended cluster from its directory."""
    done = _suspend_or_resume(args, "resume")
    dropped = done.get("sessions_dropped") or []
    say(f"resumed from {done['resumed']} in {done['seconds']:.1f}s: {done['buffers']} buffers "
        f"({done['bytes'] / 2**30:.3f} GiB) of {done['sessions']} sessions; attached clients go on"
        + (f". Left out {len(dropped)} sessions (closed meanwhile, or their tenant was removed)" if dropped else ""))
    return 0


def _leftovers() -> None:
    """Refuse a second ``up`` while one runs; stop what an interrupted ``up`` of this machine left."""
    state = head.load_state()
    if state is None:
        return
    if state.phase == "starting":
        if head.head_alive(state) or (state.temp_dir and head.processes_of(state.temp_dir)):
            took = head.stop_head(state.head_pid, state.temp_dir, timeout=5.0)
            print(f"stopped the Ray head an interrupted `pathways up` left (pid {state.head_pid}, {took:.1f}s)",
                  flush=True)
        head.clear_state()
        return
    from client.runtime import reachable

    if state.address and reachable(state.address, 2.0):
        raise CliError(f"`pathways up` already runs a cluster at {state.address}; `pathways down` first")
    if head.head_alive(state):
        head.stop_head(state.head_pid, state.temp_dir)
        print("stopped the Ray head of a runtime that no longer answers", flush=True)
    head.unpublish(state.address)
    head.clear_state()


def _check_registry(path: str, token: str, quota: int | None = None) -> None:
    """Refuse a registry file on this machine that another admin credential wrote: the runtime would keep that
    one, and this admin would be locked out of it. Say so when it keeps another default quota than --quota."""
    from pathways.auth import digest

    try:
        data = json.loads(open(path).read())
        owner, kept = data.get("admin"), data.get("default_quota")
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError) as exc:
        raise CliError(f"the tenant registry {path} is unreadable ({exc}); fix or move it") from None
    if owner and owner != digest(token):
        raise CliError(f"the tenant registry {path} belongs to another admin credential than {secrets.admin_path()}: "
                       "put that admin.token back, or move the registry away to start with no tenants")
    if quota is not None and kept != quota:
        print(f"note: the tenant registry {path} keeps the default quota it was created with "
              f"({'none' if kept is None else kept}); --quota applies to a new registry", flush=True)


def cmd_down(args: argparse.Namespace) -> int:
    """``pathways down``: stop the runtime's jobs and actors, and the Ray head if ``pathways up`` started it."""
    state = head.load_state()
    if state is None:
        say(f"nothing to stop: no cluster that `pathways up` started is recorded in {head.state_path()} (a cluster "
            "started elsewhere is stopped where it was started)")
        return 0
    if state.phase == "starting":
        took = head.stop_head(state.head_pid, state.temp_dir, timeout=5.0) if state.head_pid else 0.0
        head.clear_state()
        print(f"stopped what an interrupted `pathways up` left (the Ray head, pid {state.head_pid}, {took:.1f}s)"
              if state.head_pid else "forgot an interrupted `pathways up` that had started nothing")
        return 0
    alive = head.head_alive(state) or not state.owns_head
    if alive:
        credential = secrets.need_admin_credential(args.admin_credential_file, "`pathways down`")
        try:
            _launch("down", {"ray_address": state.ray_address, "admin_credential": credential}, args.timeout + 60)
            print("stopped the runtime's jobs and removed the resource manager and its islands")
        except CliError as exc:
            if not state.owns_head:
                raise
            print(f"the runtime did not stop cleanly ({exc}); stopping its Ray head")
    if state.owns_head:
        took = head.stop_head(state.head_pid, state.temp_dir, args.timeout)
        print(f"stopped the Ray head that `pathways up` started ({took:.1f}s)")
    else:
        print(f"left the Ray cluster at {state.ray_address} running: `pathways up` did not start it")
    head.unpublish(state.address)
    head.clear_state()
    registry = home() / "registry.json"
    if registry.exists():
        print(f"the tenant registry stays in {registry}: the next `pathways up` keeps its tenants")
    return 0


# -- a tenant's own machine --------------------------------------------------------------------------

def cmd_login(args: argparse.Namespace) -> int:
    """``pathways login``: check the credential against the runtime, then save address, tenant and credential."""
    secrets.check_tenant(args.tenant)
    credential = args.credential or secrets.read_secret(args.credential_file)
    if not credential:
        raise CliError(f"--credential-file {args.credential_file}: no such file (or it is empty)")
    try:
        link = Link(args.login_address, 0, None, expect_role(None, "rm"), "the resource manager")
        who = link.call(lambda rid: WhoAmI(rid, args.tenant, credential), 30)
        link.close()
    except PathwaysError as exc:
        raise CliError(f"login to {args.login_address} as {args.tenant} failed: {exc}") from None
    if who.get("tenant") != args.tenant:
        raise CliError("that is the admin credential; log in with a tenant's credential (`pathways tenants add`)")
    path = save_login(Login(args.login_address, args.tenant, credential))
    print(f"logged in to {args.login_address} as {args.tenant}; saved in {path} (readable by you only).\n"
          f"  pw.init() and `pathways status | submit | jobs | logs | stop` use it from now on.")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    """``pathways logout``: forget the saved login."""
    path = login_path()
    if path.exists():
        path.unlink()
        print(f"forgot the login in {path}")
    else:
        print("not logged in")
    return 0


# -- tenants (the admin's) -------------------------------------------------------------------------

def _admin(args: argparse.Namespace) -> Any:
    from client.admin import Admin

    credential = secrets.need_admin_credential(args.admin_credential_file, f"`pathways tenants {args.action}`")
    try:
        return Admin.connect(resolve_address(args.address), credential)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def _as_admin(fn: Any, *a: Any, **kw: Any) -> Any:
    """Run one admin operation; what the resource manager refuses becomes a one-line error."""
    try:
        return fn(*a, **kw)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None


def _budgets(pairs: list[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
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
          f"    pathways login {address} --tenant {name} --credential {secret}\n")


def cmd_tenants_add(args: argparse.Namespace) -> int:
    """``pathways tenants add``: register a tenant and print its login command once."""
    secrets.check_tenant(args.name)
    _check_weight(args.weight)
    _check_quota(args.quota)
    budgets = _budgets(args.budget)
    admin = _admin(args)
    secret = _as_admin(admin.add_tenant, args.name, args.weight, args.quota, budgets, args.job_user)
    (record,) = [t for t in _as_admin(admin.tenants) if t["name"] == args.name]
    print(f"added {_tenant_line(record)}\n{_job_user_line(record)}")
    _show_credential(args.name, secret, resolve_address(args.address))
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    """``pathways tenants list``: every tenant with its weight, quota, clients and devices held."""
    rows = _as_admin(_admin(args).tenants)
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
    secret = _as_admin(admin.set_tenant, args.name, **change)
    (record,) = [t for t in _as_admin(admin.tenants) if t["name"] == args.name]
    print(f"changed {_tenant_line(record)}" + (f"\n{_job_user_line(record)}" if args.job_user else ""))
    if secret:
        print("  the old credential, its sessions and its jobs' unused tickets no longer work")
        _show_credential(args.name, secret, resolve_address(args.address))
    return 0


def cmd_tenants_remove(args: argparse.Namespace) -> int:
    """``pathways tenants remove``: remove a tenant (its sessions and jobs end) and delete its saved credential."""
    admin = _admin(args)
    record = next((t for t in _as_admin(admin.tenants) if t["name"] == args.name), {})
    _as_admin(admin.remove_tenant, args.name)
    print(f"removed tenant {args.name}: its sessions ended, its jobs stop, and its slices and buffers were reclaimed")
    if record.get("job_user_made"):
        print(f"  its OS user {record['job_user']} stays, unused, so that its uid is given to no one else (who would "
              f"own what its jobs left in /tmp); `userdel {record['job_user']}` once nothing of it is left")
    path = secrets.credential_path(args.name)
    if path.exists():
        path.unlink()
        print(f"  deleted its credential {path}")
    return 0


# -- status and jobs -------------------------------------------------------------------------------

def _identity(args: argparse.Namespace, what: str) -> tuple[str, str, bool]:
    """(tenant, credential, is_admin) to act with: the admin credential unless a tenant was named, else the
    tenant's; CliError saying how to get one otherwise."""
    if not getattr(args, "tenant", None) and not getattr(args, "credential_file", None):
        admin = secrets.admin_credential(getattr(args, "admin_credential_file", None))
        if admin is not None:
            return "", admin, True
    found = secrets.tenant_identity(getattr(args, "tenant", None), getattr(args, "credential_file", None))
    if found is None:
        raise CliError(f"`pathways {what}` needs a tenant's credential (`pathways login ADDRESS --tenant NAME "
                       f"--credential ...`, or --tenant with --credential-file) or the admin's "
                       f"({secrets.admin_path()})")
    return found[0], found[1], False


def cmd_status(args: argparse.Namespace) -> int:
    """``pathways status``: the whole cluster with the admin credential, else one tenant's view."""
    tenant, credential, is_admin = _identity(args, "status")
    address = resolve_address(args.address)
    if is_admin:
        from client.admin import Admin
        from client.status import admin_status

        try:
            admin = Admin.connect(address, credential, timeout=args.timeout)
            snapshot, refusals = _as_admin(admin_status, admin), _as_admin(admin.state).get("refusals", [])
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


def _jobs(args: argparse.Namespace, what: str) -> Jobs:
    tenant, credential, _ = _identity(args, what)
    return Jobs(resolve_address(args.address), tenant, credential)


def cmd_submit(args: argparse.Namespace) -> int:
    """``pathways submit``: run a command as a job of a tenant, in a copy of the working directory."""
    entrypoint = entrypoint_of(args.entrypoint)
    working_dir = working_dir_of(args.working_dir)
    found = secrets.tenant_identity(args.tenant, args.credential_file)
    if found is None:
        raise CliError("`pathways submit` needs your tenant's credential: `pathways login ADDRESS --tenant NAME "
                       "--credential ...` (what `pathways tenants add` printed), or --tenant NAME with its "
                       "credential file")
    tenant, credential = found
    address = resolve_address(args.address)
    runner = Jobs(address, tenant, credential)
    row = runner.submit(entrypoint, pack(working_dir), args.name)
    job = row["id"]
    print(f"submitted {job} (tenant {tenant}) to {address}", flush=True)
    if not args.wait:
        print(f"  follow it: pathways logs {job} --follow")
        return 0
    status = runner.follow(job, lambda s: print(s, end="", flush=True))
    print(f"job {job} {status}")
    return 0 if status == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    """``pathways jobs``: the jobs you may see (your tenant's, or every job with the admin credential)."""
    rows = _jobs(args, "jobs").list()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"],
                [[r["id"], r["tenant"], r["status"], clock(r["start"]), clock(r["end"]), short(r["entrypoint"], 48)]
                 for r in rows]) if rows else "no jobs")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """``pathways logs``: print (or follow) the log of a job you may act on."""
    runner = _jobs(args, "logs")
    if args.follow:
        runner.follow(args.job, lambda s: print(s, end="", flush=True))
        return 0
    offset = 0
    while True:
        chunk = runner.logs(args.job, offset)
        print(chunk["text"], end="")
        offset = chunk["offset"]
        if not chunk["text"]:
            return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """``pathways stop``: stop a job you may act on, and wait until it ends."""
    print(f"job {args.job} {_jobs(args, 'stop').stop(args.job)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
