"""Run Equinox's "Train RNN" example with eqx.filter_jit and through pathways; print the changed lines and
both results.

    python -m examples.eqx_rnn [--steps 200]
"""

from __future__ import annotations

import argparse

import numpy as np

import pathways as pw
from examples.eqx_rnn import changed_lines, jax_train, pw_train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.eqx_rnn", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    changed, diff = changed_lines()
    print("\n".join(diff))
    print(f"\n{changed} code lines changed\n\neqx.filter_jit:")
    plain, plain_accuracy = jax_train.main(steps=a.steps)
    print("pw.filter_jit:")
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    try:
        ported, ported_accuracy = pw_train.main(steps=a.steps)
    finally:
        pw.shutdown()
    gap = float(np.max(np.abs(np.subtract(plain, ported)) / np.abs(plain)))
    print(f"final loss: {plain[-1]:.6f} (eqx.filter_jit)  {ported[-1]:.6f} (pw.filter_jit); largest relative "
          f"difference over {a.steps} steps {gap:.1e}")
    print(f"final accuracy: {plain_accuracy:.4f} (eqx.filter_jit)  {ported_accuracy:.4f} (pw.filter_jit)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
