"""The peak FLOP/s that MFU divides by, measured on the pods' own devices.

On CPU there is no honest datasheet number, so the pods measure it: a batched
float32 matmul sharded over every device of every pod's slice, all pods at once
(simulated CPU devices share the machine's cores, and the pods share them too,
so measuring one pod and multiplying would overcount), dispatched as one
``@pw.program`` and timed from the client. Each run is sized to take a few
hundred milliseconds, so the client's round trip (a few ms) costs about 1%.
The fastest of several runs is kept: other work on the machine can only slow
a run down, and the peak is what the devices can do, not what they did.
For GPUs the vendor's dense datasheet peak of the device kind the pods'
hosts report is used (``dtype`` "bfloat16" for a bfloat16 model: PaLM's MFU
is against the bf16 peak).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pathways as pw
from examples.palm import flops


def _device(island: int) -> tuple[str, str]:
    """(platform, device kind) of the first device of ``island``'s first host, as its host reports it
    ('gpu:0 NVIDIA H200' reads ('gpu', 'NVIDIA H200'); a CPU device's kind is its platform)."""
    for status in pw.status().islands:
        if status.index == island and status.hosts and status.hosts[0].devices:
            name, _, kind = status.hosts[0].devices[0].partition(" ")
            platform = name.split(":")[0]
            return platform, kind or platform
    return "cpu", "cpu"


def measure_pods_peak(slices: Sequence[pw.VirtualSlice], n: int = 1024, chain: int = 2,
                      repeats: int = 7) -> float:
    """Best aggregate matmul FLOP/s of every device of ``slices``, all busy at once, over ``repeats`` runs."""
    spec = P(tuple(slices[0].axis_names))  # the batch of matrices split over every mesh axis

    def matmuls(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, chain, lambda _, x: jnp.einsum("bij,bjk->bik", x, b), a)

    bench = pw.jit(matmuls, in_specs=(spec, spec), out_specs=spec, name="peak_matmul")
    inputs = []
    for s in slices:
        a = np.ones((s.size, n, n), np.float32)
        inputs.append((pw.put(a, s, spec), pw.put(a / n, s, spec)))

    @pw.program
    def all_pods(pairs: list) -> list:
        return [bench(a, b) for a, b in pairs]

    def run() -> float:
        start = time.perf_counter()
        for out in all_pods(inputs):
            out.block_until_ready()
        return time.perf_counter() - start

    run()  # compile
    seconds = min(run() for _ in range(repeats))
    devices = sum(s.size for s in slices)
    return 2.0 * n**3 * chain * devices / seconds


def pods_peak(slices: Sequence[pw.VirtualSlice], dtype: str = "float32") -> tuple[float | None, str]:
    """(peak FLOP/s of all pods together, where the number came from)."""
    devices = sum(s.size for s in slices)
    platform, kind = _device(slices[0].island)
    if platform == "cpu":
        value = measure_pods_peak(slices)
        return value, (f"measured: 1024x1024 float32 matmuls on all {devices} pod devices at once, "
                       "through the runtime, timed from the client (best of 7)")
    per_device = flops.gpu_datasheet_peak(kind, dtype)
    if per_device is None:
        return None, f"unknown: no datasheet entry for {kind!r} ({dtype})"
    return per_device * devices, f"datasheet: {kind} {dtype} dense x {devices}"
