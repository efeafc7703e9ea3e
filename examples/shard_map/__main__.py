"""Run the "Neural networks" section of JAX's shard_map tutorial with jax.jit on this process's simulated CPU
devices and through pathways on an island of as many; print the changed lines and both runs' results.

    python -m examples.shard_map [--devices 8]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.shard_map", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="devices of the meshes (the tutorial's 8; even)")
    a = p.parse_args(argv)
    if a.devices < 2 or a.devices % 2:
        p.error("--devices must be an even number of at least 2")
    if "jax" not in sys.modules:  # the reference runs on this process's own CPU devices, set before JAX loads
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"

    import jax
    import numpy as np

    import pathways as pw
    from examples.shard_map import changed_lines, jax_train, pw_train

    changed, diff = changed_lines()
    print("\n".join(diff))
    print(f"\n{changed} code lines changed\n\njax.jit:")
    plain = jax_train.main(a.devices)
    print("\npw.jit:")
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=a.devices))
    try:
        ported = pw_train.main(a.devices)
    finally:
        pw.shutdown()
    print(f"\n{'':22s}{'jax.jit':>22s}{'pw.jit':>22s}")
    for (name, want), (_, got) in zip(plain, ported):
        if isinstance(want, float):
            print(f"{name:22s}{want:22.9g}{got:22.9g}   relative difference {abs(got - want) / abs(want):.1e}")
        elif isinstance(want, bool):
            print(f"{name:22s}{want!s:>22s}{got!s:>22s}")
        else:  # the pipeline's gradients: NaN where the tutorial's pipeline leaves them so, in both runs
            gap = max(float(np.nanmax(np.abs(np.subtract(w, g)), initial=0.0))
                      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
            print(f"{name:22s}{'':22s}{'':22s}   largest difference {gap:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
