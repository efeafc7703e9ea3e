"""One tenant's training job: linear regression by full-batch gradient descent on a data-parallel
slice, one ``pw.jit`` step per iteration, dispatched ahead of the losses it prints.

Run it as a job (``pathways submit --tenant NAME -- python train.py``: the job proves its tenant with a
one-time ticket), or directly against a running cluster after ``pathways login`` (or with
``PATHWAYS_ADDRESS``, ``PATHWAYS_TENANT`` and the tenant's credential at hand). It prints the weight the
cluster's registry gives its tenant.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import zlib
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw


def make_problem(tenant: str, batch: int, features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A noisy linear problem of its own per tenant (seeded by the name)."""
    rng = np.random.default_rng(zlib.crc32(tenant.encode()))
    true_w = rng.normal(size=features).astype(np.float32)
    x = rng.normal(size=(batch, features)).astype(np.float32)
    y = (x @ true_w + 0.01 * rng.normal(size=batch)).astype(np.float32)
    return x, y, true_w


LOOKAHEAD_S = 0.5  # work kept queued on the island: enough that it never waits for ours


def report(tenant: str, step: int, loss: pw.Array, started: float) -> None:
    value = float(loss.fetch())
    rate = f" ({(time.monotonic() - started) / step * 1e3:.1f} ms/step)" if step else ""
    print(f"[{tenant}] step {step} loss {value:.6f}{rate}", flush=True)


class Pacer:
    """Dispatch ahead of the island by about LOOKAHEAD_S of work, and stop early enough that everything queued,
    and the closing report, lands before ``deadline``.

    Dispatch returns at once, so a loop that only watched the clock while dispatching would leave a long queue
    to drain after its time was up. The pacer watches steps land instead: once about LOOKAHEAD_S of steps are
    queued, it waits until half of them have landed (steps land in order), and it measures the step time from
    those landings, which counts other tenants' share of the island in."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.queue: deque[tuple[float, pw.Array]] = deque()  # (dispatched at, the step's output), oldest first
        self.per_step: deque[float] = deque(maxlen=8)
        self.landed_at: float | None = None

    @property
    def step_s(self) -> float | None:
        """The recent median time per step, once a step landed after the first (which includes compilation)."""
        return statistics.median(self.per_step) if self.per_step else None

    def sent(self, out: pw.Array) -> None:
        self.queue.append((time.monotonic(), out))

    def _wait(self, keep: int) -> None:
        """Wait until all but the newest ``keep`` queued steps have landed."""
        done = [self.queue.popleft() for _ in range(len(self.queue) - keep)]
        done[-1][1].block_until_ready()
        now = time.monotonic()
        if self.landed_at is not None:
            self.per_step.append((now - max(self.landed_at, done[0][0])) / len(done))
        self.landed_at = now

    def may_send(self) -> bool:
        """Whether one more step, after those queued and before the closing report, still ends by the deadline."""
        step_s = self.step_s
        if step_s is None:  # no step time yet: one step at a time
            if self.queue:
                self._wait(keep=0)
        else:
            most = max(2, math.ceil(LOOKAHEAD_S / step_s))
            if len(self.queue) >= most:
                self._wait(keep=most // 2)
        # what is queued, this step, and the closing report (a loss and two fetches: about a step)
        return time.monotonic() + (len(self.queue) + 2) * (self.step_s or 0.0) < self.deadline


def train(steps: int, seconds: float, devices: int, island: int, batch: int, features: int, lr: float,
          print_every: int) -> float:
    """Train until ``steps`` updates or ``seconds`` (connecting, compiling and the last result included)."""
    started = time.monotonic()
    pacer = Pacer(started + seconds)
    session = pw.init()  # attaches to the runtime's address; proves its tenant with the job's ticket (or login)
    tenant = session.tenant
    x, y, true_w = make_problem(tenant, batch, features)
    with pw.slice((devices,), ("data",), island=island) as s:
        print(f"[{tenant}] weight {session.weight:g} (from the registry): slice {s.key} {s.shape} on island "
              f"{s.island}", flush=True)
        xs, ys = pw.put(x, s, P("data", None)), pw.put(y, s, P("data"))
        w = pw.put(np.zeros(features, np.float32), s, P())

        def mse(w, x, y):
            return jnp.mean((x @ w - y) ** 2)

        specs = (P(), P("data", None), P("data"))
        sgd = pw.jit(lambda w, x, y: w - lr * jax.grad(mse)(w, x, y), slice=s, in_specs=specs, out_specs=P())
        loss = pw.jit(mse, slice=s, in_specs=specs, out_specs=P())
        done, pending = 0, (0, loss(w, xs, ys))  # compiles the loss now, not in the closing report
        while done < steps and pacer.may_send():
            w = sgd(w, xs, ys)  # a future: dispatch returns at once and the island queues the step
            pacer.sent(w)
            done += 1
            if done % print_every == 0:
                # Print the loss asked for ``print_every`` steps ago: waiting for it never drains our queue,
                # so the island always has our work and the scheduler's weights decide the split.
                report(tenant, *pending, started)
                pending = (done, loss(w, xs, ys))
        report(tenant, done, loss(w, xs, ys), started)
        error = float(np.linalg.norm(w.fetch() - true_w))
    pw.shutdown()
    print(f"[{tenant}] done: {done} steps in {time.monotonic() - started:.1f} s (budget {seconds:g} s), "
          f"|w - w_true| = {error:.4f}", flush=True)
    return error


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=60.0,
                   help="the run's time budget, from connecting to the last result (compilation included): it "
                        "stops dispatching early enough that what it queued lands in time, even if steps remain")
    p.add_argument("--devices", type=int, default=2, help="devices in the slice (the data axis)")
    p.add_argument("--island", type=int, default=0)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--print-every", type=int, default=100)
    a = p.parse_args(argv)
    train(a.steps, a.seconds, a.devices, a.island, a.batch, a.features, a.lr, a.print_every)


if __name__ == "__main__":
    main()
