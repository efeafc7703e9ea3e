"""Run by test_first_steps.py in its own process: a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``), the runtime `pathways up --ray-address` would start on it, and two clients that
know the cluster only from ``RAY_ADDRESS``, as a script run by ``ray job submit`` does. Each client's
``pw.init(topology=...)`` starts a runtime of its own there; client A is killed, client B ends normally, and the
script waits for their runtimes' actors and placement groups to go while `up`'s runtime stays. Prints one JSON
line of what it saw.

As in multinode_scenarios.py, ``RAY_TMPDIR`` goes to a private folder before Ray loads (the cluster's address file
must not replace ``/tmp/ray/ray_current_cluster``) and ``RAY_AUTH_MODE=token`` makes the cluster use Ray's token,
as after `ray start`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

if __name__ == "__main__":
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="pwrj-", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import pathways as pw

TIMEOUTS = {"start": 240.0, "op": 120.0, "fetch": 120.0}
GONE_WITHIN_S = 60.0
CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import pathways as pw

    islands = int(sys.argv[1])
    session = pw.init(topology=pw.Topology(islands, 1, 2), timeouts=pw.Timeouts(**json.loads(sys.argv[2])))
    first, last = pw.slice((2,), ("x",), island=0), pw.slice((2,), ("x",), island=islands - 1)
    y = pw.jit(lambda v: v * 2.0, slice=first)(pw.put(np.arange(4.0, dtype=np.float32), first))
    z = pw.jit(lambda v: v + 1.0, slice=last)(pw.transfer(y, last))
    print(json.dumps({"nodes": [[h.node for h in i.hosts] for i in pw.status().islands], "z": z.fetch().tolist(),
                      "actor": session.embedded.actor, "tenant": session.tenant, "launcher": session.embedded.proc.pid,
                      "ray_imported": sorted(m for m in sys.modules if m.split(".")[0] == "ray")}), flush=True)
    sys.stdin.readline()  # until the scenario ends this client
""")


def client(islands: int, home: str) -> subprocess.Popen:
    """A client that knows the cluster from RAY_ADDRESS alone: no pathways address, login or machine runtime."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATHWAYS_")}
    env.update(PATHWAYS_HOME=os.path.join(home, "home"), PATHWAYS_TMPDIR=os.path.join(home, "tmp"))
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(islands), json.dumps(TIMEOUTS)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a client ended before it reported (exit {proc.wait(30)})")
    return json.loads(line)


def alive_runtime() -> dict:
    """The runtime's actors alive on the cluster, by class, and its placement groups not removed."""
    import ray

    actors: dict[str, int] = {}
    for info in ray._private.state.actors().values():
        name = info["ActorClassName"].rsplit(".", 1)[-1]
        if info["State"] != "DEAD" and name in ("ManagerActor", "HostActor"):
            actors[name] = actors.get(name, 0) + 1
    groups = sum(1 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")
    return {"actors": actors, "groups": groups}


def running(pids: list[int], timeout: float) -> list[int]:
    """Which of ``pids`` still run (zombies count as ended) after waiting at most ``timeout`` for them to end."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def names() -> list[str]:
    import ray

    from pathways.names import NAMESPACE

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


def not_a_runtime(address: str, **kw) -> dict:
    """What pw.init says, and how soon, when given the Ray cluster's own address."""
    t0 = time.monotonic()
    try:
        pw.init(address=address, **kw)
        pw.shutdown()
        return {"error": None}
    except pw.PathwaysError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from pathways.names import NAMESPACE
    from resource_manager.launch import start_with_credentials, stop_runtime

    out: dict = {}
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    home = tempfile.mkdtemp(prefix="pwrj-clients-")
    clients: list[subprocess.Popen] = []
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
        nodes = ray.nodes()
        out["cluster"] = {"head": next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"]),
                          "nodes": sorted(n["NodeID"] for n in nodes), "address": cluster.address,
                          "seconds": round(time.monotonic() - t0, 1)}
        shared = start_with_credentials(pw.Topology(1, 1, 1).to_wire(), TIMEOUTS)  # what `pathways up` starts
        out["shared"] = {"actor": shared["actor"], "before": alive_runtime()}
        os.environ["RAY_ADDRESS"] = cluster.address  # what Ray sets for a job's entrypoint
        t1 = time.monotonic()
        clients = [client(2, os.path.join(home, "a")), client(1, os.path.join(home, "b"))]
        out["a"], out["b"] = report(clients[0]), report(clients[1])
        out["started_s"] = round(time.monotonic() - t1, 1)
        out["names_while_running"] = names()
        out["while_running"] = alive_runtime()
        del os.environ["RAY_ADDRESS"]
        out["ray_address_given"] = not_a_runtime(cluster.address)
        out["ray_address_given_with_credential"] = not_a_runtime(cluster.address, credential="x")

        t2 = time.monotonic()
        clients[0].send_signal(signal.SIGKILL)  # A dies: its launcher's stdin closes
        clients[0].wait(30)
        clients[1].stdin.close()  # B ends as a script does
        out["b_exit"] = clients[1].wait(60)
        while time.monotonic() - t2 < GONE_WITHIN_S and alive_runtime() != out["shared"]["before"]:
            time.sleep(0.2)
        out["after"] = alive_runtime()
        out["gone_s"] = round(time.monotonic() - t2, 1)
        out["names_after"] = names()
        out["launchers_left"] = running([out["a"]["launcher"], out["b"]["launcher"]], 30.0)
        stop_runtime(shared["admin_credential"])
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
