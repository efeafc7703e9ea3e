"""Run by test_rl_failures.py in its own process and cluster: an asynchronous RL loop (the tiny policy of
rl_policy.py) whose sampler island's host is killed (SIGKILL) with steps in flight goes on after the island's
restart and ends with the metrics and parameters of a run without the kill; then the trainer island's host is
killed, and the loop fails with an error naming the trainer. Prints one JSON line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np
import rl_policy as policy

import pathways as pw

STEPS = 8
KILL_AFTER = 3  # steps dispatched when the sampler's host dies


def run(session, kill: int | None = None) -> tuple[list[dict], bytes, pw.rl.Loop]:
    loop = pw.rl.Loop(pw.rl.asynchronous(k=1), **policy.loop_args())
    params, opt_state = policy.init()
    loop.start(params, opt_state, key=jax.random.key(1))
    results = []
    for n in range(STEPS):
        results.append(loop.step())
        if n + 1 == KILL_AFTER and kill is not None:
            os.kill(session.host_stats(kill)["pid"], signal.SIGKILL)
    metrics = [r.read() for r in results]
    return metrics, np.asarray(loop.params()["logits"]).tobytes(), loop


def main() -> None:
    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=60.0, op=60.0, poll=0.5))
    straight, straight_params, loop = run(session)
    loop.close()
    started = time.monotonic()
    killed, killed_params, loop = run(session, kill=1)
    result = {"recovered_s": time.monotonic() - started, "same_metrics": killed == straight,
              "same_params": killed_params == straight_params, "events": [e.kind for e in loop.events],
              "detail": [e.detail for e in loop.events]}
    victim = session.host_stats(0)["pid"]
    for _ in range(3):
        loop.step()
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    try:
        loop.finish()
        for _ in range(3):
            loop.step().read()
        result["trainer_error"] = "no error"
    except pw.IslandFailedError as exc:
        result["trainer_error"] = str(exc)
    result["trainer_error_s"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    pw.shutdown()


if __name__ == "__main__":
    sys.exit(main())
