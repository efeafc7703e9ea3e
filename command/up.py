"""``pathways up``: start a Ray head (or use a running Ray cluster) and the runtime on it, make the admin's own
tenant, and say how tenants attach; refuse a second ``up``, and clean up what an interrupted one left."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

from client.link import Link, expect_role
from client.runtime import DEFAULT_TENANT, Timeouts, home
from command import head, secrets
from command.head import ClusterState
from command.launcher import launch
from command.output import CliError, say
from command.suspend import location
from pathways.errors import PathwaysError, TenantAccessError
from pathways.requests import WhoAmI

CLIENT_PORT = 7100  # where `pathways up` serves the runtime's address by default


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
        info = launch("up", {"ray_address": ray_address, "topology": topology.to_wire(), "admin_credential": token,
                              "registry": registry, "default_quota": args.quota, "jobs_dir": _jobs_dir(args.jobs_dir),
                              "unsafe_jobs_as_runtime_user": args.unsafe_jobs_as_runtime_user,
                              "client_ports": [args.client_port, args.client_port], "op_timeout": timeouts.op,
                              "gap_timeout": timeouts.gap, "start_timeout": timeouts.start, "grace": timeouts.grace,
                              "suspend_dir": location(args.suspend_dir)},
                       args.timeout + 60)
    except BaseException:  # Ctrl-C, a kill, a failure: take down what this `up` started, and forget it
        if started["pid"] is not None:
            head.stop_head(started["pid"], started["dir"])
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


def _leftovers() -> None:
    """Refuse a second ``up`` while one runs; stop what an interrupted ``up`` of this machine left."""
    state = head.load_state()
    if state is None:
        return
    if state.phase == "starting":
        if head.head_alive(state) or (state.temp_dir and head.processes_of(state.temp_dir)):
            took = head.stop_head(state.head_pid, state.temp_dir)
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
