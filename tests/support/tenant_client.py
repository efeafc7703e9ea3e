"""A client process for the multi-tenancy tests: `hold`, `attack` or `load`, as one tenant.

Run as ``python tests/support/tenant_client.py MODE [args]`` with PATHWAYS_ADDRESS, PATHWAYS_TENANT and
PATHWAYS_CREDENTIAL set (``conftest.tenant_env``); prints JSON lines.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.array import Array
from client.slices import VirtualSlice


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def hold() -> None:
    session = pw.init()
    s = pw.slice((2,), ("x",), island=0)
    arrays = [pw.put(np.full(8, i, np.float32), s) for i in range(5)]
    arrays[-1].block_until_ready()
    emit(client=session.client_id, slice=s.key, ids=[a.id for a in arrays])
    time.sleep(600)  # until the test kills this process


def attack(victim_id: int, victim_slice: dict) -> None:
    """Try to read, use and write another tenant's buffer and slice (whose id and devices it guessed)."""
    session = pw.init(timeouts=pw.Timeouts(fetch=20.0))
    mine = pw.slice((2,), ("x",), island=0)
    forged = Array(session, victim_id, (4,), np.float32, mine, P(), frozenset({0}))
    outcome = {}

    def attempt(name, fn):
        try:
            outcome[name] = f"no error: {fn()!r}"
        except pw.PathwaysError as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"

    attempt("fetch", lambda: forged.fetch().tolist())
    double = pw.jit(lambda v: v * 2.0, slice=mine)
    attempt("compute", lambda: double(forged).fetch().tolist())
    stolen = VirtualSlice(session, {**victim_slice, "tenant": session.tenant})
    attempt("put_on_slice", lambda: pw.put(np.zeros(4, np.float32), stolen).fetch().tolist())
    attempt("run_on_slice", lambda: pw.jit(lambda: np.float32(1.0), slice=stolen)().fetch().tolist())
    forged = None  # dropping the handle frees its id, which must not touch the victim's buffer
    session.frees.flush()
    emit(**outcome)
    pw.shutdown()


def load(seconds: float) -> None:
    """Keep island 0 backlogged for ``seconds`` from the instant (a ``time.time()``) the test sends on standard
    input once every client said READY (compiled)."""
    session = pw.init()
    s = pw.slice((2,), ("x",), island=0)
    f = pw.jit(lambda m: jax.lax.fori_loop(0, 8, lambda i, a: jnp.tanh(a @ m), m), slice=s,
               in_specs=(P("x"),), out_specs=P("x"))  # ~10 ms of island time: the island is the bottleneck
    m = pw.put(np.eye(384, dtype=np.float32), s, P("x"))
    f(m).block_until_ready()
    print("READY", flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.time()))
    previous, calls = None, 0
    while time.time() < start_at + seconds:  # 32 to 64 programs in flight: always backlogged
        batch = [f(m) for _ in range(32)]
        calls += len(batch)
        if previous is not None:
            previous.block_until_ready()
        previous = batch[-1]
    emit(tenant=session.tenant, calls=calls)
    pw.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "hold":
        hold()
    elif mode == "attack":
        attack(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        load(float(sys.argv[2]))
