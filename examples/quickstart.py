"""Quickstart: compiled functions on virtual slices, then one program across two islands.

    python examples/quickstart.py
    python examples/quickstart.py --gpu    # the same on one GPU, shared by both islands
    pathways graph examples/quickstart.py:two_islands --out two_islands.svg   # its graph, rendered

Starts an embedded local Ray cluster (2 islands x 1 host x 4 simulated CPU devices), runs a sharded
computation on a (2, 2) slice, then a @pw.program whose values cross islands host to host, and shows
its dataflow graph. With ``--gpu`` each island is one device, half of one GPU (``GPU`` below), and the
slices are as large as an island allows.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw

GPU = pw.Topology(islands=2, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=0.5)


def main(topology: pw.Topology | None = None) -> None:
    pw.init(topology)  # embedded local cluster when no Ray is running
    per_island = 4 if topology is None else topology.devices_per_island
    shape = (2, 2) if per_island >= 4 else (1, per_island)
    s = pw.slice(shape, ("data", "model"))  # a virtual slice; the resource manager places it
    print(s)
    x = pw.put(np.arange(16.0, dtype=np.float32).reshape(4, 4), s, P("data", None))
    f = pw.jit(lambda a: jnp.tanh(a) @ a.T, slice=s, in_specs=(P("data", None),), out_specs=P())
    y = f(x)  # returns a pw.Array at once; runs on the island
    print("tanh(a) @ a.T =\n", np.asarray(y))  # fetch blocks, with a timeout

    s1 = pw.slice((min(per_island, 2),), ("x",), island=0)
    s2 = pw.slice((min(per_island, 2),), ("x",), island=1)
    a = pw.jit(lambda v: v * 2.0, slice=s1, name="a")
    b = pw.jit(lambda v: v + 1.0, slice=s2, name="b")
    c = pw.jit(lambda v: v / 2.0, slice=s1, name="c")

    @pw.program
    def two_islands(v):
        x = a(v)
        y = b(x)  # crosses islands: a transfer is inserted
        z = a(c(x))
        return y, z

    v = pw.put(np.array([1.0, 2.0], np.float32), s1)
    y, z = two_islands(v)  # one message per island, sent at once; both are futures
    print("y =", np.asarray(y), "on island", y.slice.island, "| z =", np.asarray(z), "on island", z.slice.island)
    print(two_islands.graph(v))
    print(two_islands.graph(v).to_dot())
    print(pw.status())
    pw.shutdown()


if __name__ == "__main__":
    main(GPU if "--gpu" in sys.argv[1:] else None)
