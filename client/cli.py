"""The ``pathways`` console command: start a shared cluster, submit tenants' jobs to it, watch it, stop it.

    pathways up [--islands N --hosts-per-island H --devices-per-host D] [--port P] [--address ADDR]
    pathways status [--json]
    pathways submit --tenant NAME [--weight W] -- python script.py ...
    pathways jobs | pathways logs JOB [--follow] | pathways stop JOB
    pathways down
    pathways graph script.py:function [--out graph.svg]

Every command talks to ``--address``, else ``RAY_ADDRESS``, else the cluster ``pathways up``
recorded. Jobs go through Ray's job submission API; the runtime (resource manager and islands)
lives in detached Ray actors, so it outlives the command that started it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from client import jobs
from client.jobs import CliError, ClusterState

CLI_TENANT = "pathways-cli"  # the tenant this command registers as while it reads the cluster's state


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    jobs.enable_token_auth()  # before Ray is imported
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


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", help="Ray address host:port (default: RAY_ADDRESS, else `pathways up`'s)")
    p = argparse.ArgumentParser(prog="pathways", description="Start a shared Pathways cluster on Ray, submit "
                                "tenants' jobs to it, watch it, stop it.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    up = sub.add_parser("up", parents=[common], help="start a Ray head (or join --address) and the islands")
    up.add_argument("--islands", type=int, default=2)
    up.add_argument("--hosts-per-island", type=int, default=1)
    up.add_argument("--devices-per-host", type=int, default=4)
    up.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    up.add_argument("--port", type=int, default=6379, help="GCS port of the head this starts (default 6379)")
    up.add_argument("--dashboard-port", type=int, default=None, help="default: 8265 if free, else any free port")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers Ray (default: all)")
    up.add_argument("--quota", type=int, default=None, metavar="DEVICES",
                    help="default per-tenant device quota (default: no quota)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the cluster to start")
    up.set_defaults(run=cmd_up)

    st = sub.add_parser("status", parents=[common], help="islands, hosts, tenants' slices, queues and time share")
    st.add_argument("--json", action="store_true", help="print the whole ClusterStatus as JSON")
    st.add_argument("--timeout", type=float, default=30.0)
    st.set_defaults(run=cmd_status)

    sm = sub.add_parser("submit", parents=[common], help="submit `-- COMMAND...` as a Ray job of a tenant")
    sm.add_argument("--tenant", required=True)
    sm.add_argument("--weight", type=float, default=1.0, help="the tenant's share of island time (default 1)")
    sm.add_argument("--working-dir", default=".", help="shipped with the job; its cwd (default: .)")
    sm.add_argument("--wait", action="store_true", help="follow the logs; exit 0 only if the job succeeds")
    sm.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- python script.py ...")
    sm.set_defaults(run=cmd_submit)

    jb = sub.add_parser("jobs", parents=[common], help="list jobs: id, tenant, status, start, end")
    jb.add_argument("--tenant", help="only this tenant's jobs")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(run=cmd_jobs)

    lg = sub.add_parser("logs", parents=[common], help="print a job's logs")
    lg.add_argument("job")
    lg.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    lg.set_defaults(run=cmd_logs)

    sp = sub.add_parser("stop", parents=[common], help="stop a job")
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
    from client.graphs import program_graph

    dot = program_graph(args.target, args.out)
    print(f"wrote {args.out}" if args.out else dot, end="\n" if args.out else "")
    return 0


# -- up / down -------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    import pathways as pw

    t0 = time.monotonic()
    try:
        topology = pw.Topology(islands=args.islands, hosts_per_island=args.hosts_per_island,
                               devices_per_host=args.devices_per_host, platform=args.platform)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _quota_kwargs(args.quota)  # refuse a bad --quota before starting anything
    previous = jobs.load_state()
    if previous and jobs.head_alive(previous):
        raise CliError(f"`pathways up` already runs a cluster at {previous.address}; `pathways down` first")
    head_pid = temp_dir = dashboard = None
    if args.address:
        address = jobs.resolve_address(args.address)
    else:
        dport = args.dashboard_port or (8265 if _port_free(8265) else jobs.free_port())
        address, head_pid, temp_dir = jobs.start_head(args.port, dport, args.num_cpus, args.timeout)
        dashboard = f"http://127.0.0.1:{dport}"
        os.environ["RAY_ADDRESS"] = address
        print(f"Ray head started at {address} (dashboard {dashboard}, logs {temp_dir}) "
              f"in {time.monotonic() - t0:.1f}s", flush=True)
    try:
        _start_runtime(address, topology, args.quota, args.timeout)
    except BaseException:
        if head_pid is not None:
            jobs.stop_head(head_pid, temp_dir)
        raise
    jobs.save_state(ClusterState(address, dashboard, head_pid, temp_dir, topology.to_wire(), time.time()))
    auth = " RAY_AUTH_MODE=token" if os.environ.get("RAY_AUTH_MODE") == "token" else ""
    print(f"pathways cluster up in {time.monotonic() - t0:.1f}s: {topology}\n"
          f"  attach from Python:  pw.init(address=\"{address}\")\n"
          f"  attach from a shell: export RAY_ADDRESS={address}{auth}\n"
          f"  submit a job:        pathways submit --tenant NAME [--weight W] -- python script.py\n"
          f"  watch / stop:        pathways status | pathways jobs | pathways down")
    return 0


def _start_runtime(address: str, topology: Any, quota: int | None, timeout: float) -> None:
    """pw.init creates the detached resource manager, which starts and owns the islands; they outlive us."""
    import pathways as pw

    try:
        pw.init(topology=topology, address=address, tenant=CLI_TENANT,
                timeouts=pw.Timeouts(start=timeout), **_quota_kwargs(quota))
    except pw.PathwaysError as exc:
        raise CliError(str(exc)) from None
    pw.shutdown()  # only disconnects: this process did not start Ray


def _quota_kwargs(quota: int | None) -> dict[str, Any]:
    import pathways as pw

    if quota is None:
        return {}
    if quota < 1:
        raise CliError(f"--quota must be a positive number of devices, got {quota}")
    if "default_quota" not in inspect.signature(pw.init).parameters:
        raise CliError("this runtime cannot set a default quota at start yet (pw.init has no default_quota)")
    return {"default_quota": quota}


def _port_free(port: int) -> bool:
    try:
        jobs.check_port_free(port, "dashboard")
    except CliError:
        return False
    return True


def cmd_down(args: argparse.Namespace) -> int:
    address = jobs.resolve_address(args.address)
    state = jobs.load_state()
    ours = state if state and state.address == address and state.owns_head else None
    if ours and not jobs.head_alive(ours):
        print(f"the Ray head at {address} is already gone")
    else:
        removed = _remove_runtime(address, stop_jobs=ours is None)
        print(f"removed the resource manager and islands ({len(removed)} actors)" if removed
              else f"no pathways runtime was running at {address}")
    if ours:
        took = jobs.stop_head(ours.head_pid, ours.temp_dir, args.timeout)
        print(f"stopped the Ray head at {address} that `pathways up` started ({took:.1f}s)")
    else:
        print(f"left the Ray head at {address} running: `pathways up` did not start it")
    if state and state.address == address:
        jobs.clear_state()
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
    import ray

    from pathways.names import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)


# -- status ----------------------------------------------------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    address = jobs.resolve_address(args.address)
    import ray

    import pathways as pw
    from pathways.names import NAMESPACE, RESOURCE_MANAGER

    _connect(address)
    try:
        ray.get_actor(RESOURCE_MANAGER, namespace=NAMESPACE)
    except ValueError:
        raise CliError(f"no pathways runtime at {address}: run `pathways up`") from None
    try:
        pw.init(address=address, tenant=CLI_TENANT)
        snapshot = pw.status(timeout=args.timeout)
    except pw.PathwaysError as exc:
        raise CliError(str(exc)) from None
    finally:
        pw.shutdown()
    if args.json:
        print(json.dumps(asdict(snapshot), indent=2, default=str))
    else:
        print(render_status(snapshot, address))
    return 0


def render_status(st: Any, address: str) -> str:
    """Islands, hosts, tenants as tables. Fields the runtime does not report yet show as '-'."""
    out = [f"cluster {address}: {st.topology}", ""]
    rows = []
    for isl in st.islands:
        times = getattr(isl, "tenant_time_s", None) or {}
        total = sum(times.values())
        share = ", ".join(f"{t} {100 * s / total:.0f}% ({s:.1f}s)" for t, s in sorted(times.items())) if total else "-"
        alive = sum(h.alive for h in isl.hosts)
        rows.append([isl.index, "healthy" if isl.healthy else f"FAILED: {isl.reason}", f"{alive}/{len(isl.hosts)}",
                     sum(len(h.devices) for h in isl.hosts), getattr(isl, "queue_depth", "-"), share])
    out += [table(["ISLAND", "HEALTH", "HOSTS", "DEVICES", "QUEUE", "SHARE OF ISLAND TIME"], rows), ""]
    rows = [[f"{isl.index}/{h.host}", h.node[:12], len(h.devices), "yes" if h.alive else "NO",
             f"{h.buffers} ({_bytes(h.buffer_bytes)})", h.compiles, h.cache_hits, h.queue_depth, h.completed,
             f"{h.busy_s:.1f}s ({100 * getattr(h, 'busy_fraction', 0.0):.0f}%)"]
            for isl in st.islands for h in isl.hosts]
    out += [table(["HOST", "NODE", "DEVICES", "ALIVE", "BUFFERS", "COMPILES", "HITS", "QUEUE", "DONE", "BUSY"],
                  rows), ""]
    slices = _slices_by_tenant(st)
    rows = [[name, info.get("weight", "-"), info.get("quota") or "-", info.get("clients", "-"),
             info.get("devices", "-"), ", ".join(slices.get(name, [])) or "-"]
            for name, info in sorted(tenants(st).items()) if name != CLI_TENANT]
    out.append(table(["TENANT", "WEIGHT", "QUOTA", "CLIENTS", "DEVICES", "SLICES"], rows) if rows else "no tenants")
    return "\n".join(out)


def tenants(st: Any) -> dict[str, dict]:
    """``ClusterStatus.tenants`` when the runtime reports it; else rebuilt from clients and allocations."""
    reported = getattr(st, "tenants", None)
    if reported:
        return reported
    out: dict[str, dict] = {}
    for c in (getattr(st, "clients", None) or {}).values():
        t = out.setdefault(c["tenant"], {"weight": c.get("weight", 1.0), "clients": 0, "devices": 0})
        t["clients"] += 1
    for a in st.allocations:
        out.setdefault(a["tenant"], {"clients": 0, "devices": 0})["devices"] += len(a["devices"])
    return out


def _slices_by_tenant(st: Any) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in st.allocations:
        out.setdefault(a["tenant"], []).append(f"{a['key']}{tuple(a['shape'])}@island{a['island']}")
    return out


# -- jobs ------------------------------------------------------------------------------------------

def cmd_submit(args: argparse.Namespace) -> int:
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    jobs.check_tenant(args.tenant, args.weight)
    if not entrypoint:
        raise CliError("nothing to run: put the command after `--`, e.g. pathways submit --tenant a -- python x.py")
    address = jobs.resolve_address(args.address)
    client = jobs.job_client()
    job_id = jobs.submit(client, args.tenant, args.weight, entrypoint, os.path.abspath(args.working_dir))
    print(f"submitted {job_id} (tenant {args.tenant}, weight {args.weight:g}) to {address}", flush=True)
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
    jobs.resolve_address(args.address)
    rows = [r for r in jobs.job_rows(jobs.job_client()) if not args.tenant or r["tenant"] == args.tenant]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["ID", "TENANT", "WEIGHT", "STATUS", "START", "END", "ENTRYPOINT"],
                [[r["id"], r["tenant"], r["weight"], r["status"], _clock(r["start"]), _clock(r["end"]),
                  _short(r["entrypoint"], 48)] for r in rows]) if rows else "no jobs")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    jobs.resolve_address(args.address)
    client = jobs.job_client()
    jobs.known_job(client, args.job)
    if args.follow:
        jobs.follow_logs(client, args.job, lambda s: print(s, end="", flush=True))
    else:
        print(client.get_job_logs(args.job), end="")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    jobs.resolve_address(args.address)
    client = jobs.job_client()
    jobs.known_job(client, args.job)
    client.stop_job(args.job)
    print(f"job {args.job} {jobs.wait_job(client, args.job, args.timeout)}")
    return 0


# -- formatting ------------------------------------------------------------------------------------

def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
