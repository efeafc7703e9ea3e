"""What losing a pod costs PaLM's two-pod training through ``pw.elastic``, and whether the run stays the same.

Runs of the same steps on the same two pods (config small by default), each a pipelined loop (step n+1
is dispatched before step n is read), one after another in one cluster, in this order: no kills,
donating, one kill, donating, no kills, kill every N. The pairs alternate so that a busy spell on the
machine hits both kinds alike; their steps per second are averaged.

- ``donating``: the ordinary two-pod step (``TrainStep``, donating its state): what elastic costs with no
  failure at all (median seconds per step against ``no kills``').
- ``no kills``: the elastic step, no failure: the baseline of the next two.
- ``one kill``: the elastic step; once step K-1 has landed, with step K running, pod 1's host process is
  killed (SIGKILL, as a machine failure would). The resource manager restarts the island; the pod warms
  up, receives the state from pod 0 and rejoins. Measured: the steps lost (the interrupted step minus the
  step the survivor continued from), the seconds from the kill until the interrupted step had landed on
  the survivor, the step the pod rejoined at, and whether every step's loss and both pods' final state
  are bitwise those of ``no kills``.
- ``kill every N``: a pod's host (pod 0, then pod 1, ...) is killed N steps after the previous kill, or
  as soon after as both pods are in: goodput (steps per second) against ``no kills``.

    python -m benchmarks.elastic --config small --steps 60 --kill-at 10 --kill-every 20

It ends with one line:
``elastic: killed pod at step K, lost L steps, resumed in R s, rejoined at step J, loss curve identical: yes|no``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

import pathways as pw
from benchmarks.common import Table, default_out, ratio, ratio_text, write_json
from examples.palm import data, model, optim
from examples.palm.config import CONFIGS
from examples.palm.step import ElasticTrainStep, TrainStep
from examples.palm.train import fetch_tree

WARMUP_STEPS = 3  # compile every pod's executables before anything is timed


def kill_host(island: int, host: int = 0) -> int:
    """SIGKILL the process of host ``host`` of ``island``, as a machine failure would; returns its pid (the
    host names it in its counters, asked over the client protocol)."""
    from client.session import current

    pid = current().host_stats(island, host)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def digest(tree: Any) -> str:
    """sha256 of a pytree of pw.Arrays' bytes (fetched)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(fetch_tree(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


@dataclass
class Run:
    """One run: each landed step's metrics [shares x METRICS] and when it landed, the kills, the events."""

    name: str
    losses: list[np.ndarray] = field(default_factory=list)
    landed: list[float] = field(default_factory=list)
    kills: list[tuple[int, int, float]] = field(default_factory=list)  # (step running, pod, when)
    events: list[Any] = field(default_factory=list)
    wall_s: float = 0.0
    digests: list[str] = field(default_factory=list)  # each pod's final state

    @property
    def steps_per_s(self) -> float:
        return len(self.losses) / self.wall_s if self.wall_s else float("nan")

    @property
    def step_s(self) -> list[float]:
        """Seconds between one step's landing and the next's."""
        return np.diff(self.landed).tolist()

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s) if len(self.landed) > 1 else float("nan")


def never(record: Run, step: Any, landed: int) -> None:
    """No kill."""
    return None


def run(name: str, make_step: Callable[[Run], Any], host_state: tuple, steps: int, batch: int, seq_len: int,
        kill: Callable[[Run, Any, int], int | None] = never) -> Run:
    """``steps`` pipelined steps from ``host_state`` (batches 0, 1, ...); once step n has landed, ``kill(run,
    step, n)`` may name a pod whose host is then killed while step n+1 runs."""
    record = Run(name)
    step = make_step(record)
    state = step.put_state(*host_state)
    pending = None
    started = time.perf_counter()
    for n in range(steps + 1):
        current = step(state, data.batch(n, 0, batch, seq_len)) if n < steps else None
        if pending is not None:
            metrics, _ = step.read(*pending)
            record.losses.append(metrics[:, 0])
            record.landed.append(time.perf_counter())
            pod = kill(record, step, n)
            if pod is not None:
                record.kills.append((n + 1, pod, time.perf_counter()))
                kill_host(step.slices[pod].island)
        if current is not None:
            state = current[0]
        pending = current
    record.wall_s = time.perf_counter() - started
    if hasattr(step, "runner"):
        record.digests = [digest(step.runner.state(p)[1]) for p in step.runner.pods]
    else:
        record.digests = [digest((p, o)) for p, o in zip(state.params, state.opt_state)]
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--steps", type=int, default=60, help="steps in each run")
    p.add_argument("--kill-at", type=int, default=10, help="K: the step running when pod 1 is killed once")
    p.add_argument("--kill-every", type=int, default=20, help="N: a kill every N steps in the goodput run")
    p.add_argument("--out", default=str(default_out("elastic")))
    a = p.parse_args(argv)
    if not 1 < a.kill_at < a.steps:
        p.error("--kill-at must lie between 2 and --steps - 1")
    config, opt = CONFIGS[a.config], optim.OptimConfig()
    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
            timeouts=pw.Timeouts(fetch=120.0, op=60.0, poll=0.5))
    try:
        pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
        params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
        host_state = (params, optim.init_opt_state(params, opt))

        def elastic(record: Run) -> ElasticTrainStep:
            def note(event: Any) -> None:
                record.events.append((time.perf_counter(), event))

            return ElasticTrainStep(config, opt, pods, on_event=note)

        def donating(record: Run) -> TrainStep:
            return TrainStep(config, opt, pods)

        def once(record: Run, step: Any, landed: int) -> int | None:
            return 1 if landed == a.kill_at - 1 and not record.kills else None

        def every(record: Run, step: Any, landed: int) -> int | None:
            due = landed + 1 >= (record.kills[-1][0] if record.kills else 0) + a.kill_every
            return len(record.kills) % 2 if due and len(step.runner.pods) == 2 else None

        shape = (a.batch, config.seq_len)
        print(f"PaLM {a.config}, global batch {shape[0]} x {shape[1]} tokens, {a.steps} steps per run", flush=True)
        for make in (elastic, donating):
            run("warm-up", make, host_state, WARMUP_STEPS, a.batch, config.seq_len)
        plan = [("no kills", elastic, never), ("donating", donating, never), ("one kill", elastic, once),
                ("donating", donating, never), ("no kills", elastic, never),
                (f"kill every {a.kill_every}", elastic, every)]
        runs = [run(name, make, host_state, a.steps, a.batch, config.seq_len, kill) for name, make, kill in plan]
        for pod in pods:
            pod.release()
    finally:
        pw.shutdown()
    return report(a, runs)


def report(a: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    cleans, donatings = [r for r in runs if r.name == "no kills"], [r for r in runs if r.name == "donating"]
    clean, donating, once, every = cleans[0], donatings[0], runs[2], runs[-1]
    clean_rate = statistics.mean(r.steps_per_s for r in cleans)
    table = Table(["run", "steps", "kills", "wall s", "steps/s", "median step s", "vs no kills"])
    for r in runs:
        table.add(r.name, len(r.losses), len(r.kills), f"{r.wall_s:.1f}", f"{r.steps_per_s:.2f}",
                  f"{r.median_step_s:.3f}", ratio_text(ratio(r.steps_per_s, clean_rate)))
    print(table.render())
    (k, _, killed_at), = once.kills
    resumed = [e for _, e in once.events if e.kind == "resumed"]
    rejoined = [e for _, e in once.events if e.kind == "rejoined"]
    lost = k - resumed[0].step if resumed else None
    resumed_s = once.landed[k - 1] - killed_at
    identical = (len(once.losses) == len(clean.losses)
                 and all(x.tobytes() == y.tobytes() for x, y in zip(once.losses, clean.losses))
                 and len(set(clean.digests + once.digests)) == 1)  # every pod's final state, in both runs
    same_as_donating = all(x.tobytes() == y.tobytes() for x, y in zip(clean.losses, donating.losses))
    for at, e in once.events:
        print(f"  {at - killed_at:+7.2f} s  {e.kind}: {e.detail}")
    step_clean = statistics.median(s for r in cleans for s in r.step_s)
    step_donating = statistics.median(s for r in donatings for s in r.step_s)
    print(f"without failures, a step takes {step_clean:.3f} s elastic and {step_donating:.3f} s donating (medians), "
          f"{ratio_text(ratio(step_clean, step_donating))}; the losses are bitwise the donating step's: "
          f"{'yes' if same_as_donating else 'no'}")
    goodput = ratio(every.steps_per_s, clean_rate)
    print(f"goodput with a kill every {a.kill_every} steps ({len(every.kills)} kills): {every.steps_per_s:.2f} "
          f"against {clean_rate:.2f} steps/s with none, {ratio_text(goodput)}")
    payload = {"config": a.config, "batch": a.batch, "steps": a.steps, "kill_at": k, "kill_every": a.kill_every,
               "lost_steps": lost, "resumed_s": resumed_s, "rejoined_at": rejoined[0].step if rejoined else None,
               "identical": identical, "same_as_donating": same_as_donating,
               "median_step_s": {"elastic": step_clean, "donating": step_donating},
               "runs": [{"name": r.name, "steps": len(r.losses), "kills": len(r.kills), "wall_s": r.wall_s,
                         "steps_per_s": r.steps_per_s, "kill_steps": [k[0] for k in r.kills],
                         "step_s": [round(s, 4) for s in r.step_s]} for r in runs],
               "goodput": goodput,
               "events": [{"t": at - killed_at, "kind": e.kind, "pod": e.pod, "step": e.step, "detail": e.detail}
                          for at, e in once.events]}
    write_json(a.out, payload)
    print(f"elastic: killed pod at step {k}, lost {lost} steps, resumed in {resumed_s:.1f} s, rejoined at step "
          f"{rejoined[0].step if rejoined else 'never'}, loss curve identical: {'yes' if identical else 'no'}")
    return payload


if __name__ == "__main__":
    main()
