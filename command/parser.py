"""The ``pathways`` command's arguments: one subcommand per action, each with the function that runs it.

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

Every command talks to the runtime's address (``command.address``). ``up`` creates the cluster's admin
credential (``$PATHWAYS_HOME/admin.token``, readable by its owner only); the ``tenants`` commands need it. A
tenant proves itself with the credential the admin issued it. The command never imports Ray: ``up`` and
``down`` run ``python -m resource_manager.launch``, the only Ray driver, for the runtime (``command.launcher``).
"""

from __future__ import annotations

import argparse

from client.runtime import Timeouts
from command.down import cmd_down
from command.graphs import cmd_graph
from command.jobs import cmd_jobs, cmd_logs, cmd_stop, cmd_submit
from command.login import cmd_login, cmd_logout
from command.status import cmd_status
from command.suspend import cmd_resume, cmd_suspend
from command.tenants import cmd_tenants_add, cmd_tenants_list, cmd_tenants_remove, cmd_tenants_set
from command.up import CLIENT_PORT, cmd_up


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
    dn.add_argument("--timeout", type=float, default=30.0,
                    help="seconds the runtime may take to stop, besides a minute to reach it (default 30)")
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
    st.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for the runtime's answers (default 30)")
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
