"""Run by test_failures.py in its own process and cluster: kill an island's host mid-program.

Prints one JSON line with what happened, so the test can assert on it.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import ray

import pathways as pw


def main() -> None:
    hosts = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=hosts, devices_per_host=2),
                      timeouts=pw.Timeouts(fetch=60.0, op=60.0, poll=0.5))
    s0 = pw.slice((2,), ("x",), island=0)
    s1 = pw.slice((2 * hosts,), ("x",), island=1)
    slow = pw.jit(lambda m: jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ m), m), slice=s1)
    after = pw.jit(lambda v: v.sum(), slice=s0)
    ok = pw.jit(lambda v: v * 2.0, slice=s0)

    @pw.program
    def cross(m):
        y = slow(m)
        return y, after(y)

    m = pw.put(np.eye(1024, dtype=np.float32), s1)
    y, z = cross(m)
    time.sleep(0.5)
    ray.kill(session.islands[1].hosts[-1])
    result = {}
    for name, arr in (("z_on_island0", z), ("y_on_island1", y)):
        start = time.monotonic()
        try:
            np.asarray(arr)
            result[name] = "no error"
        except pw.IslandFailedError as exc:
            result[name] = f"IslandFailedError: {exc}"
        result[name + "_s"] = time.monotonic() - start
    result["island0_still_works"] = float(np.asarray(ok(pw.put(np.ones(2), s0))).sum())
    st = pw.status()
    result["healthy"] = [i.healthy for i in st.islands]
    result["reason"] = st.islands[1].reason
    print(json.dumps(result))
    pw.shutdown()


if __name__ == "__main__":
    main()
