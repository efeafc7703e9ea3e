"""A client of a multi-host cluster (2 islands x 2 hosts x 2 devices) for test_multihost.py (and, attached to a
two-node cluster, for multinode_scenarios.py). Each mode prints one JSON line of what it computed, with what
numpy computes for the same inputs, for the test to compare."""

from __future__ import annotations

import json
import sys
import time

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.lowering import lower
from pathways.graph import Compute


def pair(got, want) -> dict:
    """A result and what numpy computes for it, as lists."""
    return {"got": np.asarray(got).tolist(), "want": np.asarray(want).tolist()}


def spmd() -> dict:
    pw.init(timeouts=pw.Timeouts(fetch=60.0, op=60.0))
    out: dict = {}
    small, wide = pw.slice((2,), ("x",), island=0), pw.slice((2, 2), ("data", "model"), island=0)
    out["small_hosts"], out["wide_hosts"] = list(small.hosts), list(wide.hosts)
    a = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    x = pw.put(a, wide, P("data", "model"))
    out["roundtrip"] = pair(x, a)
    f = pw.jit(lambda v: jnp.tanh(v) @ v.T, slice=wide, in_specs=(P("data", "model"),), out_specs=P("data"))
    out["spmd"] = pair(f(x), np.tanh(a) @ a.T)
    other = pw.slice((2, 2), ("data", "model"), island=1)
    g = pw.jit(lambda v: v * 2.0, slice=other, in_specs=(P("data", "model"),), out_specs=P("data", "model"))
    same = pw.program(lambda v: g(v))
    out["matching_transfer"] = pair(same(x), 2 * a)
    graph = same.last_graph
    exes = {n.exe: b"" for n in graph.nodes if isinstance(n, Compute)}  # the ops are what is read here
    send = next(op for op in lower(graph, exes).fragments[0].ops if op.KIND == "send")
    out["routes"] = [[r.host, r.to] for r in send.routes]
    h = pw.jit(lambda v: v + 1.0, slice=other, in_specs=(P(None, "data"),), out_specs=P())
    out["reshard_transfer"] = pair(pw.program(lambda v: h(v))(x), a + 1)
    # Within the 2-host island: f's output, sharded over both hosts, read whole by a computation on the same
    # slice, and by one on a slice of one host (the hosts exchange their shards).
    whole = pw.jit(lambda v: v * 3.0, slice=wide, in_specs=(P(),), out_specs=P())
    out["within_island"] = pair(pw.program(lambda v: whole(f(v)))(x), 3 * (np.tanh(a) @ a.T))
    one = pw.jit(lambda v: v - 1.0, slice=small, in_specs=(P(),), out_specs=P())
    out["to_one_host"] = pair(pw.program(lambda v: one(f(v)))(x), np.tanh(a) @ a.T - 1)
    y = pw.put(a, small, P("x"))
    out["single_host_slice"] = pair(pw.jit(lambda v: v.sum(), slice=small, in_specs=(P("x"),))(y), a.sum())
    pw.shutdown()
    return out


def gang(n: int) -> dict:
    tenant = pw.init(timeouts=pw.Timeouts(fetch=120.0, op=120.0)).tenant
    s = pw.slice((4,), ("x",), island=0)
    scale = 0.5 if tenant == "a" else 0.75
    # every program runs cross-host collectives: a sharded reduction and an all-gather
    f = pw.jit(lambda v: v * scale + jnp.sum(v) / 16, slice=s, in_specs=(P("x"),), out_specs=P())
    g = pw.jit(lambda v: jnp.sin(v - jnp.mean(v)) + 0.5, slice=s, in_specs=(P(),), out_specs=P("x"))
    step = pw.program(lambda v: g(f(v)))
    x0 = np.arange(16, dtype=np.float32) / 16
    v, ref = pw.put(x0, s, P("x")), x0
    outs = []
    for _ in range(n):
        v = step(v)
        r = ref * scale + ref.sum() / 16
        ref = np.sin(r - r.mean()) + 0.5
        outs.append(v)
        if len(outs) > 32:
            outs.pop(0).block_until_ready()
    final = pair(v, ref)
    pw.shutdown()
    return {"tenant": tenant, "programs": n, "final": final}


def long(n: int, path: str) -> dict:
    """A program of ``n`` computations on the 2-host island, each with a cross-host reduction, run three times under
    ``pw.trace``: longer than the scheduler lets one fragment run at once, so it runs in parts, each in a place of
    its own in the island's order, while another client's collectives take places between them. Returns the
    results and each host's order of this program's parts."""
    pw.init(timeouts=pw.Timeouts(fetch=120.0, op=120.0))
    s = pw.slice((4,), ("x",), island=0)
    f = pw.jit(lambda v: v * 0.5 + jnp.sum(v) / 32, slice=s, in_specs=(P("x"),), out_specs=P("x"))

    def chain(v):
        for _ in range(n):
            v = f(v)
        return v

    x0 = np.arange(16, dtype=np.float32) / 16
    program = pw.program(chain)
    x = pw.put(x0, s, P("x"))
    with pw.trace(path):
        outs = [program(x) for _ in range(3)]
        outs[-1].block_until_ready()
        # a host records a part's span as the part ends, which may follow the output's readiness: a program after
        # them in the island's order, done on both hosts, means both recorded every part
        pw.jit(lambda v: v, slice=s, in_specs=(P("x"),), out_specs=P("x"))(outs[-1]).block_until_ready()
    ref = x0
    for _ in range(n):
        ref = ref * 0.5 + ref.sum() / 32
    got = [np.asarray(out).tolist() for out in outs]
    parts: dict = {}
    events = json.load(open(path))["traceEvents"]
    for e in sorted((e for e in events if e.get("cat") == "fragment" and e["pid"] == 100
                     and e["args"].get("program") == "chain"), key=lambda e: e["ts"]):
        parts.setdefault(e["tid"], []).append(e["args"]["seq"])
    pw.shutdown()
    return {"programs": len(outs), "got": got, "want": ref.tolist(), "parts": [parts.get(0, []), parts.get(1, [])]}


def traced(path: str) -> dict:
    """Two programs interleaved on the 2-host island under pw.trace: each host's fragment order."""
    pw.init(timeouts=pw.Timeouts(fetch=60.0, op=60.0))
    s = pw.slice((4,), ("x",), island=0)
    def half(v):
        return v * 0.5 + jnp.sum(v)

    def wave(v):
        return jnp.cos(v) - jnp.mean(v)

    f, g = (pw.jit(fn, slice=s, in_specs=(P("x"),), out_specs=P("x")) for fn in (half, wave))
    v = pw.put(np.arange(16, dtype=np.float32), s, P("x"))
    v.block_until_ready()  # nothing in flight when the trace starts: the hosts start tracing one after the other
    with pw.trace(path):
        outs = [fn(v) for _ in range(10) for fn in (f, g)]
        # a host records a span as its fragment ends, which may follow the output's readiness: a program after
        # them in the island's order, done on both hosts, means both recorded all twenty
        pw.jit(lambda v: v, slice=s, in_specs=(P("x"),), out_specs=P("x"))(outs[-1]).block_until_ready()
    events = json.load(open(path))["traceEvents"]
    order = {}
    for e in sorted((e for e in events if e.get("cat") == "fragment" and e["pid"] == 100
                     and e["args"].get("program") in ("half", "wave")), key=lambda e: e["ts"]):
        order.setdefault(e["tid"], []).append(e["args"]["seq"])
    pw.shutdown()
    return {"orders": [order.get(0, []), order.get(1, [])]}


def exchange(direction: str, n: int, timeout: float) -> dict:
    """``n`` programs, one every 50 ms from the instant the test sends on standard input once both clients said
    READY (the other client starts at the same instant), each moving a value from one island to the other and
    back with a cross-host collective on each side. Each client sends a program's messages to the island it
    starts from first, so the two clients' messages reach each island in opposite orders: the islands' orders
    disagree."""
    pw.init(timeouts=pw.Timeouts(fetch=timeout, op=timeout))
    src, dst = (0, 1) if direction == "forward" else (1, 0)
    a, b = pw.slice((4,), ("x",), island=src), pw.slice((4,), ("x",), island=dst)
    f = pw.jit(lambda v: v * 0.5 + jnp.sum(v) / 16, slice=a, in_specs=(P("x"),), out_specs=P("x"))
    g = pw.jit(lambda v: jnp.sin(v) + jnp.mean(v), slice=b, in_specs=(P("x"),), out_specs=P("x"))
    step = pw.program(lambda v: g(f(v)))  # v lives on the other island: a transfer each way
    x0 = np.arange(16, dtype=np.float32) / 16
    step(pw.put(x0, b, P("x"))).block_until_ready()  # compiled everywhere before the race starts
    print("READY", flush=True)
    start_at = float(sys.stdin.readline())
    outs = []
    for k in range(n):
        time.sleep(max(0.0, start_at + 0.05 * k - time.time()))
        outs.append(step(pw.put(x0 + k, b, P("x"))))
    got, want = [], []
    for k, out in enumerate(outs):
        r = (x0 + k) * 0.5 + (x0 + k).sum() / 16
        got.append(np.asarray(out).tolist())
        want.append((np.sin(r) + r.mean()).tolist())
    pw.shutdown()
    return {"direction": direction, "programs": n, "got": got, "want": want}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "spmd":
        result = spmd()
    elif mode == "trace":
        result = traced(sys.argv[2])
    elif mode == "long":
        result = long(int(sys.argv[2]), sys.argv[3])
    elif mode == "exchange":
        result = exchange(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        result = gang(int(sys.argv[2]))
    print(json.dumps(result), flush=True)
