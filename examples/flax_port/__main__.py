"""Run the Flax NNX loop with plain JAX and through pathways; print the changed lines and both losses.

    python -m examples.flax_port [--steps 20]
"""

from __future__ import annotations

import argparse

import numpy as np

import pathways as pw
from examples.flax_port import changed_lines, jax_train, pw_train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.flax_port", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    changed, diff = changed_lines()
    print("\n".join(diff))
    print(f"\n{changed} code lines changed")
    # The cluster starts first, as in a real port: Ray forks its daemons, and forking a process in which JAX
    # already runs threads (the plain loop below) is what JAX warns about.
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    try:
        plain = jax_train.train(a.steps)
        ported = pw_train.train(a.steps)
    finally:
        pw.shutdown()
    for step in sorted({0, a.steps // 2, a.steps - 1}):
        print(f"step {step + 1:3d}: loss {plain[step]:.6f} (jax.jit)  {ported[step]:.6f} (pw.jit)")
    gap = float(np.max(np.abs(np.subtract(plain, ported)) / np.abs(plain)))
    print(f"largest relative difference over {a.steps} steps: {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
