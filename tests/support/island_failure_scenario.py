"""Run by test_failures.py in its own process and cluster: kill an island's host mid-program, then watch the
resource manager restart the island. Prints one JSON line with what happened, so the test can assert on it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw


def attempt(arr: pw.Array) -> tuple[str, float]:
    start = time.monotonic()
    try:
        np.asarray(arr)
        return "no error", time.monotonic() - start
    except pw.IslandFailedError as exc:
        return f"IslandFailedError: {exc}", time.monotonic() - start


def counted(session: Any, hosts: int, timeout: float = 60.0) -> None:
    """Wait until the resource manager has kept a census of island 1 taken after this point: three more health
    checks answered by each of its hosts (the second began after now; the manager stores one check's answers
    before it sends the next)."""
    def checks() -> int:
        return min(session.host_stats(1, k)["health_checks"] for k in range(hosts))

    want, deadline = checks() + 3, time.monotonic() + timeout
    while checks() < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"island 1's hosts answered no 3 health checks in {timeout:.0f} s")
        time.sleep(0.1)


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

    kept = pw.put(np.arange(4, dtype=np.float32), s1)
    kept.block_until_ready()
    counted(session, hosts)
    victim_pid = session.host_stats(1, hosts - 1)["pid"]
    m = pw.put(np.eye(1024, dtype=np.float32), s1)
    y, z = cross(m)
    time.sleep(0.5)
    os.kill(victim_pid, signal.SIGKILL)  # the host's process dies, as when its machine goes
    result: dict = {}
    result["z_on_island0"], result["z_on_island0_s"] = attempt(z)
    result["y_on_island1"], result["y_on_island1_s"] = attempt(y)
    result["island0_still_works"] = float(np.asarray(ok(pw.put(np.ones(2), s0))).sum())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the resource manager restarts the island's hosts
        st = pw.status()
        if st.islands[1].healthy and st.islands[1].epoch >= 1:
            break
        time.sleep(0.2)  # the restart is seen within 0.2 s of it
    result["restarted_after_s"] = round(time.monotonic() - deadline + 180, 1)
    result["healthy"] = [i.healthy for i in st.islands]
    result["epoch"] = st.islands[1].epoch
    result["restarts"] = st.islands[1].restarts
    result["kept_after_restart"], _ = attempt(kept)
    inc = pw.jit(lambda v: v + 1.0, slice=s1)
    result["island1_works_again"] = np.asarray(inc(pw.put(np.ones(2 * hosts, np.float32), s1))).tolist()
    print(json.dumps(result))
    pw.shutdown()


if __name__ == "__main__":
    main()
