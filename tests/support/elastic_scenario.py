"""Run by test_elastic.py in its own process and cluster (its hosts get killed): PaLM's tiny step through
``pw.elastic`` while pods fail and come back, in a process that cannot import Ray (a tenant's client speaks
only the runtime's protocol). Prints one JSON line per case, then ``{"done": seconds, "ray_loaded": False}``.

Cases, in order, on one cluster of 2 islands x 1 host x 4 CPU devices:
  reference     the ordinary two-pod step (``TrainStep``, donating), no failure: losses and final state.
  global_batch  the elastic step; pod 1's host is killed while step 3 runs. When the restarted pod is
                receiving the state, its new host is killed too; the island restarts again and the pod
                rejoins. Every step's losses and both pods' final states, against ``reference``.
  pod_batch     the elastic step with the per-pod batch policy: pod 1's host is killed; two steps run on
                pod 0 alone. Then pod 0's host is killed too (the survivor dies): the next step fails.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


class NoRay:
    """A tenant's process needs no Ray: here it cannot import it, and still trains through failures."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not installed in this client")


sys.meta_path.insert(0, NoRay())

import jax  # noqa: E402 - after the guard that keeps Ray out
import numpy as np  # noqa: E402 - after the guard

import pathways as pw  # noqa: E402 - after the guard
from benchmarks.elastic import digest, kill_host  # noqa: E402 - after the guard
from examples.palm import data, model, optim  # noqa: E402 - after the guard
from examples.palm.config import CONFIGS  # noqa: E402 - after the guard
from examples.palm.step import ElasticTrainStep, TrainStep  # noqa: E402 - after the guard

CONFIG, OPT, BATCH = CONFIGS["tiny"], optim.OptimConfig(), 8
STEPS = 8
TIMEOUTS = dict(fetch=60.0, op=60.0, poll=0.5)


def batch(n: int) -> dict:
    return data.batch(n, 0, BATCH, CONFIG.seq_len)


def bits(metrics: np.ndarray) -> list[str]:
    """Each share's loss, exactly (float.hex)."""
    return [float(x).hex() for x in metrics[:, 0]]


def reference(pods: list, host_state: tuple) -> dict:
    step = TrainStep(CONFIG, OPT, pods)
    state, losses = step.put_state(*host_state), []
    for n in range(STEPS):
        state, metrics, norms = step(state, batch(n))
        losses.append(bits(step.read(state, metrics, norms)[0]))
    return {"losses": losses, "digests": [digest((p, o)) for p, o in zip(state.params, state.opt_state)]}


class Recorder:
    """The runner's events with their time since a clock starts; kills the new pod 1 the first time it is
    receiving the state when ``kill_rejoining`` is set."""

    def __init__(self, kill_rejoining: bool = False) -> None:
        self.events: list[dict] = []
        self.start = time.monotonic()
        self.kill_rejoining = kill_rejoining
        self.rejoining_killed_at: float | None = None

    def __call__(self, event: Any) -> None:
        self.events.append({"kind": event.kind, "pod": event.pod, "step": event.step, "pods": list(event.pods),
                            "detail": event.detail, "t": time.monotonic() - self.start})
        if event.kind == "rejoining" and self.kill_rejoining and self.rejoining_killed_at is None:
            self.rejoining_killed_at = time.monotonic() - self.start
            kill_host(1)  # the session already talks to the restarted island's new host


def global_batch(pods: list, host_state: tuple) -> dict:
    """Pipelined like examples.palm.train: step n+1 is dispatched before step n is read."""
    recorder = Recorder(kill_rejoining=True)
    step = ElasticTrainStep(CONFIG, OPT, pods, on_event=recorder)
    state = step.put_state(*host_state)
    out: dict = {"losses": [], "pods": [], "attempts": []}
    pending = None
    for n in range(STEPS + 1):
        current = step(state, batch(n)) if n < STEPS else None
        if pending is not None:
            metrics, _ = step.read(*pending)
            result = pending[1].result
            out["losses"].append(bits(metrics))
            out["pods"].append(list(result.pods))
            out["attempts"].append(result.attempts)
            landed = len(out["losses"])
            if landed == 2:  # step 3 is running
                recorder.start = time.monotonic()
                kill_host(1)
            elif landed == 3:
                out["resumed_s"] = time.monotonic() - recorder.start
            elif landed == 5:  # wait for the pod to come back (twice: its first return is killed)
                out["rejoined_all"] = step.runner.wait_for_pods(timeout=180)
                out["rejoined_s"] = time.monotonic() - recorder.start
        if current is not None:
            state = current[0]
        pending = current
    out["digests"] = [digest(step.runner.state(p)[1]) for p in (0, 1)]
    out["events"] = recorder.events
    out["rejoining_killed_at"] = recorder.rejoining_killed_at
    return out


def pod_batch(pods: list, host_state: tuple) -> dict:
    recorder = Recorder()
    step = ElasticTrainStep(CONFIG, OPT, pods, policy=pw.elastic.POD_BATCH, on_event=recorder)
    state = step.put_state(*host_state)
    out: dict = {"losses": [], "shares": [], "lr_scale": []}

    def one(n: int) -> None:
        nonlocal state
        state, pending, _ = step(state, batch(n))
        metrics, _ = step.read(state, pending, None)
        out["losses"].append(bits(metrics))
        out["shares"].append(list(pending.result.shares))
        out["lr_scale"].append(pending.result.lr_scale)

    one(0)
    recorder.start = time.monotonic()
    kill_host(1)
    one(1)
    one(2)
    killed = time.monotonic()
    kill_host(0)  # the survivor dies too
    try:
        one(3)
        out["survivor_died"] = "no error"
    except pw.IslandFailedError as exc:
        out["survivor_died"] = f"IslandFailedError: {exc}"
    out["survivor_died_s"] = time.monotonic() - killed
    out["pods_after"] = list(step.runner.pods)
    try:
        step(state, batch(4))
        out["submit_after"] = "no error"
    except pw.IslandFailedError as exc:
        out["submit_after"] = f"IslandFailedError: {exc}"
    out["events"] = recorder.events
    return out


def emit(case: str, out: dict, started: float) -> None:
    print(json.dumps({"case": case, "seconds": round(time.monotonic() - started, 1), **out}), flush=True)


def main() -> None:
    started = time.monotonic()
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4), timeouts=pw.Timeouts(**TIMEOUTS))
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    params = jax.jit(model.init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    host_state = (params, optim.init_opt_state(params, OPT))
    for case, fn in (("reference", reference), ("global_batch", global_batch), ("pod_batch", pod_batch)):
        start = time.monotonic()
        emit(case, fn(pods, host_state), start)
    pw.shutdown()
    ray_loaded = any(m.split(".")[0] == "ray" for m in sys.modules)
    print(json.dumps({"done": round(time.monotonic() - started, 1), "ray_loaded": ray_loaded}), flush=True)


if __name__ == "__main__":
    main()
