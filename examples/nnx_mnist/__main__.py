"""Run Flax's NNX MNIST tutorial with nnx.jit and through pathways; print the changed lines and both results.

    python -m examples.nnx_mnist [--steps 120]
"""

from __future__ import annotations

import argparse

import pathways as pw
from examples.nnx_mnist import changed_lines, jax_train, pw_train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.nnx_mnist", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120)
    a = p.parse_args(argv)
    changed, diff = changed_lines()
    print("\n".join(diff))
    print(f"\n{changed} code lines changed\n\nnnx.jit:")
    plain = jax_train.train(a.steps, eval_every=a.steps // 3)
    print("pw.nnx.jit:")
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    try:
        ported = pw_train.train(a.steps, eval_every=a.steps // 3)
    finally:
        pw.shutdown()
    for name in plain:
        gap = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(plain[name], ported[name]))
        print(f"{name:15s} nnx.jit {plain[name][-1]:.6f}  pw.nnx.jit {ported[name][-1]:.6f}  "
              f"largest relative difference {gap:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
