"""One tenant's training job: linear regression by full-batch gradient descent on a data-parallel
slice, one ``pw.jit`` step per iteration, dispatched ahead of the losses it prints.

Run it as a job (``pathways submit --tenant NAME -- python train.py``: the job proves its tenant with a
one-time ticket), or directly against a running cluster after ``pathways login`` (or with
``PATHWAYS_ADDRESS``, ``PATHWAYS_TENANT`` and the tenant's credential at hand). It prints the weight the
cluster's registry gives its tenant.
"""

from __future__ import annotations

import argparse
import time
import zlib

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


def report(tenant: str, step: int, loss: pw.Array, t0: float) -> None:
    value = float(loss.fetch())
    print(f"[{tenant}] step {step} loss {value:.6f} ({(time.monotonic() - t0) / step * 1e3:.1f} ms/step)", flush=True)


def train(steps: int, seconds: float, devices: int, island: int, batch: int, features: int, lr: float,
          print_every: int) -> float:
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
        t0, i, pending = time.monotonic(), 0, None
        for i in range(1, steps + 1):
            w = sgd(w, xs, ys)  # a future: dispatch returns at once and the island queues the step
            out_of_time = time.monotonic() - t0 > seconds
            if i % print_every == 0 or i == steps or out_of_time:
                # Print the loss asked for ``print_every`` steps ago: waiting for it never drains our queue,
                # so the island always has our work and the scheduler's weights decide the split.
                if pending is not None:
                    report(tenant, *pending, t0)
                pending = (i, loss(w, xs, ys))
            if out_of_time:
                break
        report(tenant, *pending, t0)
        error = float(np.linalg.norm(w.fetch() - true_w))
    print(f"[{tenant}] done: {i} steps in {time.monotonic() - t0:.1f}s, |w - w_true| = {error:.4f}", flush=True)
    pw.shutdown()
    return error


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this long even if steps remain")
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
