"""What losing a pod costs PaLM's two-pod training through ``pw.elastic``, and whether the run stays the same.

Four runs of the same steps on the same two pods (config small by default), each a pipelined loop
(step n+1 is dispatched before step n is read), one after another in one cluster:

- ``donating``: the ordinary two-pod step (``TrainStep``, donating its state): what elastic costs with no
  failure at all.
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
    """SIGKILL the process of host ``host`` of ``island``, as a machine failure would; returns its pid."""
    import ray

    from client.session import current

    pid = ray.get(current().islands[island].hosts[host].stats.remote(), timeout=30)["pid"]
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


def run(name: str, make_step: Callable[[Run], Any], host_state: tuple, steps: int, batch: int, seq_len: int,
        kill: Callable[[Run, Any, int], int | None] = lambda run, step, n: None) -> Run:
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
        runs = [run("donating", donating, host_state, a.steps, a.batch, config.seq_len),
                run("no kills", elastic, host_state, a.steps, a.batch, config.seq_len),
                run("one kill", elastic, host_state, a.steps, a.batch, config.seq_len, once),
                run(f"kill every {a.kill_every}", elastic, host_state, a.steps, a.batch, config.seq_len, every)]
        for pod in pods:
            pod.release()
    finally:
        pw.shutdown()
    return report(a, runs)


def report(a: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    donating, clean, once, every = runs
    table = Table(["run", "steps", "kills", "wall s", "steps/s", "vs no kills"])
    for r in runs:
        table.add(r.name, len(r.losses), len(r.kills), f"{r.wall_s:.1f}", f"{r.steps_per_s:.2f}",
                  ratio_text(ratio(r.steps_per_s, clean.steps_per_s)))
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
    print(f"elastic without failures: {ratio_text(ratio(clean.steps_per_s, donating.steps_per_s))} the donating "
          f"step's steps/s; its losses are bitwise the donating step's: {'yes' if same_as_donating else 'no'}")
    print(f"goodput with a kill every {a.kill_every} steps ({len(every.kills)} kills): "
          f"{every.steps_per_s:.2f} against {clean.steps_per_s:.2f} steps/s with none, "
          f"{ratio_text(ratio(every.steps_per_s, clean.steps_per_s))}")
    payload = {"config": a.config, "batch": a.batch, "steps": a.steps, "kill_at": k, "kill_every": a.kill_every,
               "lost_steps": lost, "resumed_s": resumed_s, "rejoined_at": rejoined[0].step if rejoined else None,
               "identical": identical, "same_as_donating": same_as_donating,
               "runs": {r.name: {"steps": len(r.losses), "kills": len(r.kills), "wall_s": r.wall_s,
                                 "steps_per_s": r.steps_per_s, "kill_steps": [k[0] for k in r.kills],
                                 "step_s": np.diff(r.landed).round(3).tolist()} for r in runs},
               "goodput": ratio(every.steps_per_s, clean.steps_per_s),
               "events": [{"t": at - killed_at, "kind": e.kind, "pod": e.pod, "step": e.step, "detail": e.detail}
                          for at, e in once.events]}
    write_json(a.out, payload)
    print(f"elastic: killed pod at step {k}, lost {lost} steps, resumed in {resumed_s:.1f} s, rejoined at step "
          f"{rejoined[0].step if rejoined else 'never'}, loss curve identical: {'yes' if identical else 'no'}")
    return payload


if __name__ == "__main__":
    main()
