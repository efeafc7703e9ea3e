"""Run by test_multinode.py in its own process: a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``: separate raylets and object stores), the runtime attached to it, and
scenarios whose islands sit on different nodes. Prints one JSON line per scenario, then ``{"done": ...}``.

Scenarios, in order (the last one removes a node):
  readme     Topology(2, 1, 4), default placement: the README's two-island program.
  network    the same cluster: transfers across the nodes go over the network data path (host counters say
             so), and a connection without the runtime's secret is refused.
  palm       the same cluster: PaLM's tiny two-pod step (fingerprints of both pods' parameters).
  elastic    the same cluster: PaLM's tiny step through pw.elastic; pod 1's host (on the worker) is killed
             after step 1, pod 0 redoes step 2 alone, the island restarts on the worker and the pod rejoins,
             receiving the state over the network path; fingerprints of both pods after step 4.
  multihost  Topology(2, 2, 2), island 0 pinned to the worker by a custom resource, island 1 to the head by a
             node label: the multi-host checks of multihost_client.spmd.
  node_loss  the worker node (island 0) is removed while island 0 has work pending and while a transfer from
             it streams to island 1 (the worker's hosts send at most ``WORKER_RATE`` bytes/s, so it is still
             streaming when the node goes).

Before Ray loads, the script sets ``RAY_TMPDIR`` to a private folder (inside the given ``RAY_TMPDIR``, if
any), so the cluster's address file does not replace ``/tmp/ray/ray_current_cluster`` (which a plain
``ray.init()`` elsewhere on this machine would follow), and ``RAY_AUTH_MODE=token``, so every process of the
cluster uses token authentication, as after `ray start`: ``Cluster()`` alone starts its nodes without it, and
a client that attaches with a token is then refused.
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
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="pwmn-", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as `ray start` turns it on; Cluster() alone does not

import numpy as np

import pathways as pw

NODE_LABEL = "pathways-test/node"
WORKER_SLOT = "pathways_test_worker"
TIMEOUTS = dict(fetch=180.0, op=180.0, start=300.0, poll=0.5)
PALM_STEPS = 2
ELASTIC_STEPS = 4
WORKER_RATE = 16e6  # bytes/s the worker node's hosts send at most over the network path
SHIP_BYTES = 48 << 20  # the transfer that streams when the worker node goes: 3 s at WORKER_RATE
RUNTIME: dict = {}  # the runtime this script started last: its address and credentials


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
    os.environ["PATHWAYS_NETWORK_MAX_RATE"] = str(WORKER_RATE)  # the worker's raylet, so its hosts, inherit it
    try:
        worker = cluster.add_node(num_cpus=1, labels={NODE_LABEL: "worker"}, resources={WORKER_SLOT: 8})
    finally:
        del os.environ["PATHWAYS_NETWORK_MAX_RATE"]
    cluster.wait_for_nodes()
    return cluster, worker


def start_runtime(topology: pw.Topology, address: str) -> None:
    """The runtime on the cluster (its resource manager on the head, which outlives the workers), then this
    process attached to it as a client, through the runtime's address."""
    import ray

    from pathways.names import NAMESPACE
    from resource_manager.launch import start_with_credentials

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING")
    RUNTIME.update(start_with_credentials(topology.to_wire(), TIMEOUTS))
    attach()


def attach():
    """This process's session on the runtime ``start_runtime`` started last."""
    return pw.init(address=RUNTIME["address"], tenant=RUNTIME["tenant"], credential=RUNTIME["credential"],
                   timeouts=pw.Timeouts(**TIMEOUTS))


def stop_runtime(timeout: float = 60.0) -> None:
    """Disconnect, then kill the resource manager and islands (what `pathways down` does) and wait for their
    names to be free, so the next start_runtime starts a runtime of another topology."""
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


def difference(got, want) -> dict:
    """How a result differs from what it should be, small enough to print: element counts, the largest
    difference, and the first element that differs (index, got, want)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return {"shape": list(got.shape), "want_shape": list(want.shape)}
    unequal = np.argwhere(got != want)
    first = None if not len(unequal) else [unequal[0].tolist(), float(got[tuple(unequal[0])]),
                                            float(want[tuple(unequal[0])])]
    return {"elements": int(got.size), "unequal": len(unequal),
            "max_abs_diff": float(np.max(np.abs(got - want))) if got.size else 0.0, "first": first}


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


def _stats(island: int, host: int = 0) -> dict:
    from client.session import current

    return current().host_stats(island, host)


def network() -> dict:
    """Island 0 -> island 1 across the nodes, matching and resharded: the bytes arrive over the network path
    (the receiver's counters), none through the object store; a connection without the secret is refused."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from resource_manager.host.transport.network.frames import ProtocolError
    from resource_manager.host.transport.network.links import connect

    s0, s1 = pw.slice((4,), ("x",), island=0), pw.slice((4,), ("x",), island=1)
    a = np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
    x = pw.put(a, s0, P("x", None))
    before = [_stats(0), _stats(1)]
    out: dict = {"addresses": [h.data for isl in pw.status().islands for h in isl.hosts]}
    for name, spec in (("matching", P("x", None)), ("reshard", P(None, "x"))):
        f = pw.jit(lambda v: v * 2.0 + jnp.float32(1.0), slice=s1, in_specs=spec, out_specs=spec)
        out[name] = difference(pw.program(lambda v, f=f: f(v))(x), a * 2.0 + 1.0)
    after = [_stats(0), _stats(1)]
    out["moved"] = 2 * a.nbytes
    out["net_bytes_in"] = after[1]["net_bytes_in"] - before[1]["net_bytes_in"]
    out["bytes_in"] = after[1]["bytes_in"] - before[1]["bytes_in"]
    out["net_bytes_out"] = after[0]["net_bytes_out"] - before[0]["net_bytes_out"]
    out["fallbacks"] = after[0]["net_fallbacks"]
    refused = []
    for secret in (b"not the runtime's secret".ljust(32), b""):
        try:
            connect(out["addresses"][1], (0, 0), (1, 0), secret or b"x" * 32, timeout=10.0).close()
            refused.append(False)
        except (ProtocolError, OSError):
            refused.append(True)
    deadline = time.monotonic() + 10
    while _stats(1)["net_auth_refused"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    out["refused"] = refused
    out["auth_refused"] = _stats(1)["net_auth_refused"] - before[1]["net_auth_refused"]
    out["still_works"] = difference(pw.program(lambda v: f(v))(x), a * 2.0 + 1.0)

    # overlap: island 1 (the worker, which sends at WORKER_RATE) ships 32 MiB to island 0 and computes meanwhile
    corner = pw.jit(lambda v: v[:1, :1], slice=s0, in_specs=P("x", None), out_specs=P())
    work = pw.jit(lambda v: jnp.tanh(v[:8]).sum(), slice=s1, in_specs=P("x", None), out_specs=P())

    @pw.program
    def ship_and_work(v):
        return corner(v), work(v)

    big = pw.put(np.ones((8192, 1024), np.float32), s1, P("x", None))
    big.block_until_ready()
    for warm in ship_and_work(big):  # trace, export and compile for this shape first
        warm.block_until_ready()
    start = time.monotonic()
    moved, local = ship_and_work(big)
    local.block_until_ready()
    out["overlap_local_s"] = time.monotonic() - start
    moved.block_until_ready()
    out["overlap_moved_s"] = time.monotonic() - start
    s0.release()
    s1.release()
    return out


def palm() -> dict:
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    out = palm_fingerprint(pods)
    for s in pods:
        s.release()
    return {**out, "nodes": placement()}


def elastic() -> dict:
    import jax

    from benchmarks.elastic import digest, kill_host
    from examples.palm import data, model, optim
    from examples.palm.config import CONFIGS
    from examples.palm.step import ElasticTrainStep

    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    config, opt = CONFIGS["tiny"], optim.OptimConfig()
    params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
    events: list = []
    step = ElasticTrainStep(config, opt, pods, on_event=events.append)
    state = step.put_state(params, optim.init_opt_state(params, opt))
    out: dict = {"losses": [], "pods": []}
    for i in range(ELASTIC_STEPS):
        state, pending, _ = step(state, data.batch(i, 0, 8, config.seq_len))
        metrics, _ = step.read(state, pending, None)
        out["losses"].append([float(x) for x in metrics[:, 0]])
        out["pods"].append(list(pending.result.pods))
        if i == 0:
            kill_host(1)
        elif i == 1:
            out["rejoined"] = step.runner.wait_for_pods(timeout=180)
    finals = [step.runner.state(p)[1] for p in (0, 1)]
    out["params"], out["opt_state"] = [digest(f[0]) for f in finals], [digest(f[1]) for f in finals]
    out["events"] = [(e.kind, e.pod) for e in events]
    out["nodes"] = placement()
    out["net_bytes_in"] = _stats(1)["net_bytes_in"]  # since the restart
    out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(finals[1]))
    for s in pods:
        s.release()
    return out


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

    session = attach()  # this process's session: on the head's node, whose loss it never sees
    s0, s1 = pw.slice((2,), ("x",), island=0), pw.slice((2,), ("x",), island=1)
    slow = pw.jit(lambda m: jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ m), m), slice=s0)
    after = pw.jit(lambda v: v.sum(), slice=s1)
    ok = pw.jit(lambda v: v * 2.0, slice=s1)

    @pw.program
    def cross(m):
        y = slow(m)
        return y, after(y)

    corner = pw.jit(lambda v: v[:1, :1], slice=s1)
    ship = pw.program(lambda v: corner(v))

    m = pw.put(np.eye(1024, dtype=np.float32), s0)
    big = pw.put(np.ones((SHIP_BYTES // 4096, 1024), np.float32), s0)
    for arr in (m, big):
        arr.block_until_ready()
    receiver = s1.hosts[0]  # the host of island 1 that lands the shipped array
    before = _stats(1, receiver)
    shipped = ship(big)  # streams at WORKER_RATE: still on the wire when the node goes
    y, z = cross(m)
    deadline = time.monotonic() + 30
    while _stats(1, receiver)["net_bytes_in"] == before["net_bytes_in"] and time.monotonic() < deadline:
        time.sleep(0.05)
    landing = _stats(1, receiver)
    removed = time.monotonic()
    cluster.remove_node(worker)
    out: dict = {"remove_node_s": time.monotonic() - removed, "worker": worker.node_id,
                 "landed_before_removal": landing["net_bytes_in"] - before["net_bytes_in"],
                 "partial_before_removal": landing["net_partial_bytes"]}
    for name, arr in (("y_on_island0", y), ("z_on_island1", z), ("shipped_to_island1", shipped)):
        start = time.monotonic()
        try:
            np.asarray(arr)
            out[name] = "no error"
        except pw.IslandFailedError as exc:
            out[name] = f"IslandFailedError: {exc}"
        out[name + "_s"] = time.monotonic() - start
    out["after_removal_s"] = time.monotonic() - removed
    out["island1_still_works"] = float(np.asarray(ok(pw.put(np.ones(2, np.float32), s1))).sum())
    released = _stats(1, receiver)
    out["partial_after"] = released["net_partial_bytes"]
    out["released"] = released["net_released_bytes"] - before["net_released_bytes"]
    st = pw.status()
    out["healthy"] = [i.healthy for i in st.islands]
    out["reason"] = st.islands[0].reason
    out["dead_island"] = sorted(session.islands.dead)
    return out


def main(argv: Sequence[str]) -> None:
    import ray

    from pathways.names import NAMESPACE, RESOURCE_MANAGER

    wanted = set(argv) or {"readme", "network", "palm", "elastic", "multihost", "node_loss"}
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
        if "network" in wanted:
            emit("network", network)
        if "palm" in wanted:
            emit("palm", palm)
        if "elastic" in wanted:
            emit("elastic", elastic)
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
