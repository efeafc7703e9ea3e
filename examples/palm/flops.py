"""Model and hardware FLOPs utilization, and the peak FLOP/s they are measured against.

MFU counts only the model's FLOPs (PaLM's 6N + 12·L·H·Q·T per token). HFU also
counts work done twice: the staged backward (``model.stage_backward``) reruns
each layer group's forward, 2·N_layers + 4·L·H·Q·T per token. Without
rematerialization HFU equals MFU.

CPUs have no honest datasheet number, so their peak is measured with a jitted
matmul; GPUs use the vendor's dense (non-sparse) datasheet figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.palm.config import PalmConfig

# Dense peak FLOP/s per GPU by (model, dtype). "tf32" is what float32 matmuls at JAX's
# default precision run as on Ampere and newer GPUs.
_DATASHEET: dict[str, dict[str, float]] = {
    "H100 SXM": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12},
    "H100 PCIe": {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12},
    "A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
}


def mfu(tokens_per_s: float, config: PalmConfig, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over peak."""
    return tokens_per_s * config.flops_per_token() / peak_flops


def recompute_flops_per_token(config: PalmConfig) -> float:
    """FLOPs per token of one extra forward through the layers (what ``stage_backward`` recomputes)."""
    layer_params = config.n_layers * config.params_per_layer()
    return 2.0 * layer_params + 4.0 * config.n_layers * config.n_heads * config.head_dim * config.seq_len


def hfu(tokens_per_s: float, config: PalmConfig, peak_flops: float, recompute: bool = False) -> float:
    """Hardware FLOPs utilization; ``recompute=True`` when the staged backward reran the layer forwards."""
    per_token = config.flops_per_token() + (recompute_flops_per_token(config) if recompute else 0.0)
    return tokens_per_s * per_token / peak_flops


def measure_cpu_peak_flops(devices: Sequence[jax.Device] | None = None, n: int = 1024,
                           dtype: jax.typing.DTypeLike = jnp.float32, repeats: int = 7) -> float:
    """Aggregate matmul FLOP/s of ``devices`` (default: all CPU devices), median of ``repeats`` timed runs.

    Every device multiplies its own n×n matrices at the same time, so simulated
    CPU devices that share cores report the cores' total, not a multiple of it.
    """
    devices = list(devices) if devices is not None else jax.devices("cpu")
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
    shape = (len(devices), n, n)
    a = jax.device_put(jnp.ones(shape, dtype), sharding)
    b = jax.device_put(jnp.full(shape, 0.5, dtype), sharding)
    matmul = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), out_shardings=sharding)
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 * len(devices) / float(np.median(times))


def gpu_datasheet_peak(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Dense datasheet peak FLOP/s of one GPU from its ``device_kind``; None if unknown.

    An H200 has the H100 SXM's compute (only its memory differs). ``dtype`` is
    "bfloat16", "tf32" or "float32".
    """
    kind = device_kind.upper()
    if "H200" in kind or ("H100" in kind and "PCIE" not in kind):
        model = "H100 SXM"
    elif "H100" in kind:
        model = "H100 PCIe"
    elif "A100" in kind:
        model = "A100"
    else:
        return None
    return _DATASHEET[model].get(dtype)


def peak_flops(devices: Sequence[jax.Device], dtype: str = "bfloat16") -> tuple[float | None, str]:
    """(total peak FLOP/s of ``devices``, where the number came from).

    Measured for CPU devices (``dtype`` is ignored: the model runs float32 there);
    datasheet times device count for GPUs, None when the GPU is not in the table.
    """
    devices = list(devices)
    platform = devices[0].platform
    if platform == "cpu":
        value = measure_cpu_peak_flops(devices)
        return value, f"measured: jitted 1024x1024 float32 matmul on {len(devices)} cpu device(s)"
    kind = devices[0].device_kind
    per_device = gpu_datasheet_peak(kind, dtype)
    if per_device is None:
        return None, f"unknown: no datasheet entry for {kind!r} ({dtype})"
    return per_device * len(devices), f"datasheet: {kind} {dtype} dense x {len(devices)}"
