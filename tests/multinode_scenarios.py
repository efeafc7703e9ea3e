"""Run by test_multinode.py in its own process: a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``: separate raylets and object stores), the runtime attached to it, and
scenarios whose islands sit on different nodes. Prints one JSON line per scenario, then ``{"done": ...}``.

Scenarios, in order (the last one removes a node):
  readme     Topology(2, 1, 4), default placement: the README's two-island program.
  palm       the same cluster: PaLM's tiny two-pod step (fingerprints of both pods' parameters).
  multihost  Topology(2, 2, 2), island 0 pinned to the worker by a custom resource, island 1 to the head by a
             node label: the multi-host checks of multihost_client.spmd.
  node_loss  the worker node (island 0) is removed while island 0 has work pending.

Before Ray loads, the script sets ``RAY_TMPDIR`` to a private folder, so the cluster's address file does not
replace ``/tmp/ray/ray_current_cluster`` (which a plain ``ray.init()`` elsewhere on this machine would follow),
and ``RAY_AUTH_MODE=token``, so every process of the cluster uses token authentication, as after `ray start`:
``Cluster()`` alone starts its nodes without it, and a client that attaches with a token is then refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

if __name__ == "__main__":
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="pwmn-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as `ray start` turns it on; Cluster() alone does not

import numpy as np

import pathways as pw

NODE_LABEL = "pathways-test/node"
WORKER_SLOT = "pathways_test_worker"
TIMEOUTS = dict(fetch=180.0, op=180.0, start=300.0, poll=0.5)
PALM_STEPS = 2


# -- scenarios shared with the single-node runs in test_multinode.py ------------------------------------------

def readme_example(s1: pw.VirtualSlice, s2: pw.VirtualSlice) -> tuple[list, list]:
    a = pw.jit(lambda v: v * 2.0, slice=s1)
    b = pw.jit(lambda v: v + 1.0, slice=s2)
    c = pw.jit(lambda v: v / 2.0, slice=s1)

    @pw.program
    def f(v):
        x = a(v)
        y = b(x)
        z = a(c(x))
        return y, z

    y, z = f(pw.put(np.array([1.0, 2.0], np.float32), s1))
    return np.asarray(y).tolist(), np.asarray(z).tolist()


def palm_fingerprint(pods: Sequence[pw.VirtualSlice], steps: int = PALM_STEPS) -> dict:
    """PaLM's tiny two-pod step ``steps`` times: losses, and a sha256 of each pod's parameters and state."""
    import jax

    from examples.palm import data, model, optim
    from examples.palm.config import CONFIGS
    from examples.palm.step import TrainStep
    from examples.palm.train import fetch_tree

    config, opt = CONFIGS["tiny"], optim.OptimConfig()
    params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
    step = TrainStep(config, opt, pods, overlap=True)
    state, losses = step.put_state(params, optim.init_opt_state(params, opt)), []
    for i in range(steps):
        state, metrics, _ = step(state, data.batch(i, 0, 8, config.seq_len))
        losses.append([float(m.fetch()[0]) for m in metrics])

    def digest(tree) -> str:
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(fetch_tree(tree)):
            h.update(np.ascontiguousarray(leaf).tobytes())
        return h.hexdigest()

    return {"losses": losses, "params": [digest(p) for p in state.params],
            "opt_state": [digest(o) for o in state.opt_state]}


# -- the cluster -------------------------------------------------------------------------------------------

def placement() -> list[list[str]]:
    """The Ray node of every host, by island, from the cluster state."""
    return [[h.node for h in isl.hosts] for isl in pw.status().islands]


def start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "labels": {NODE_LABEL: "head"}})
    worker = cluster.add_node(num_cpus=1, labels={NODE_LABEL: "worker"}, resources={WORKER_SLOT: 8})
    cluster.wait_for_nodes()
    return cluster, worker


def start_runtime(topology: pw.Topology, address: str) -> None:
    """pw.init on the cluster: the resource manager goes on the head, which outlives the workers."""
    pw.init(topology=topology, address=address, timeouts=pw.Timeouts(**TIMEOUTS))


def client_on(node: str):
    """pw.init; the session's lease actor sits on this process's node (asserted), so losing another node
    never reclaims this live client."""
    session = pw.init(timeouts=pw.Timeouts(**TIMEOUTS))
    assert _actor_node(session.lease) == node, "the client's lease is not on the client's node"
    return session


def stop_runtime(timeout: float = 60.0) -> None:
    """Disconnect, then kill the resource manager and islands (what `pathways down` does) and wait for their
    names to be free, so the next pw.init starts a runtime of another topology."""
    import ray

    from pathways.names import NAMESPACE

    pw.shutdown()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:  # already gone
            pass
    deadline = time.monotonic() + timeout
    while any(a["namespace"] == NAMESPACE for a in ray.util.list_named_actors(all_namespaces=True)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the runtime's actors did not go away within {timeout:.0f}s")
        time.sleep(0.2)


def emit(scenario: str, fn: Callable[[], dict]) -> None:
    start = time.monotonic()
    out = fn()
    print(json.dumps({"scenario": scenario, "seconds": round(time.monotonic() - start, 1), **out}), flush=True)


# -- the scenarios -------------------------------------------------------------------------------------------

def readme(address: str) -> dict:
    start_runtime(pw.Topology(2, 1, 4), address)
    s1, s2 = pw.slice((2,), ("x",), island=0), pw.slice((2,), ("x",), island=1)
    y, z = readme_example(s1, s2)
    s1.release()
    s2.release()
    return {"y": y, "z": z, "nodes": placement()}


def palm() -> dict:
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    out = palm_fingerprint(pods)
    for s in pods:
        s.release()
    return {**out, "nodes": placement()}


def multihost(address: str) -> dict:
    import multihost_client

    stop_runtime()
    topology = pw.Topology(2, 2, 2, host_resources={0: {WORKER_SLOT: 1}}, node_labels={1: {NODE_LABEL: "head"}})
    start_runtime(topology, address)
    nodes = placement()
    checks = multihost_client.spmd()  # attaches to this runtime, runs, disconnects
    return {"checks": checks, "nodes": nodes}


def node_loss(cluster, worker) -> dict:
    import jax
    import jax.numpy as jnp

    session = client_on(cluster.head_node.node_id)
    s0, s1 = pw.slice((2,), ("x",), island=0), pw.slice((2,), ("x",), island=1)
    slow = pw.jit(lambda m: jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ m), m), slice=s0)
    after = pw.jit(lambda v: v.sum(), slice=s1)
    ok = pw.jit(lambda v: v * 2.0, slice=s1)

    @pw.program
    def cross(m):
        y = slow(m)
        return y, after(y)

    m = pw.put(np.eye(1024, dtype=np.float32), s0)
    m.block_until_ready()
    y, z = cross(m)
    time.sleep(0.5)
    removed = time.monotonic()
    cluster.remove_node(worker)
    out: dict = {"remove_node_s": time.monotonic() - removed, "worker": worker.node_id}
    for name, arr in (("y_on_island0", y), ("z_on_island1", z)):
        start = time.monotonic()
        try:
            np.asarray(arr)
            out[name] = "no error"
        except pw.IslandFailedError as exc:
            out[name] = f"IslandFailedError: {exc}"
        out[name + "_s"] = time.monotonic() - start
    out["after_removal_s"] = time.monotonic() - removed
    out["island1_still_works"] = float(np.asarray(ok(pw.put(np.ones(2, np.float32), s1))).sum())
    st = pw.status()
    out["healthy"] = [i.healthy for i in st.islands]
    out["reason"] = st.islands[0].reason
    out["dead_island"] = sorted(session.dead)
    return out


def main(argv: Sequence[str]) -> None:
    import ray

    from pathways.names import NAMESPACE, RESOURCE_MANAGER

    wanted = set(argv) or {"readme", "palm", "multihost", "node_loss"}
    start = time.monotonic()
    cluster, worker = start_cluster()
    try:
        head = cluster.head_node.node_id
        emit("cluster", lambda: {"head": head, "worker": worker.node_id,
                                 "start_s": round(time.monotonic() - start, 1)})
        emit("readme", lambda: readme(cluster.address))
        rm = ray.get_actor(RESOURCE_MANAGER, namespace=NAMESPACE)
        driver = ray.get_runtime_context().get_node_id()
        emit("where", lambda: {"driver": driver, "resource_manager": _actor_node(rm)})
        if "palm" in wanted:
            emit("palm", palm)
        if "multihost" in wanted or "node_loss" in wanted:
            emit("multihost", lambda: multihost(cluster.address))
        if "node_loss" in wanted:
            emit("node_loss", lambda: node_loss(cluster, worker))
    finally:
        pw.shutdown()  # before ray.shutdown: a client thread calling Ray afterwards would reconnect
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps({"done": round(time.monotonic() - start, 1)}), flush=True)


def _actor_node(actor) -> str:
    import ray

    return ray._private.state.actors(actor._actor_id.hex())["Address"]["NodeID"]


if __name__ == "__main__":
    main(sys.argv[1:])
