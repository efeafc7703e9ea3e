"""Every check of the project on a GPU machine, in one call: what runs, and how fast.

    python -m benchmarks.gpu_check [--platform gpu|cpu] [--out DIR] [--only NAME ...]

Each check runs in a process of its own (a fresh runtime, its own time limit) and writes one JSON record;
``gpu_check.jsonl`` in ``--out`` (default ``$OUT``, else ``benchmarks/results/gpu_check``) gathers them as they
finish, so a check that fails or runs out of time loses only itself. The checks, in order:

- ``env``: Python, JAX and Ray versions, the GPU (``nvidia-smi``) and JAX's devices.
- ``jax_matmul``: plain JAX's bfloat16 matmul on the GPU in a process of its own: what the device gives a
  large matmul, next to its datasheet peak.
- ``quickstart``: ``examples/quickstart.py --gpu``: two islands of one device each, sharing the GPU.
- ``shared_gpu``: two islands sharing one GPU (Ray's fractional GPUs, each host's XLA client at its share of
  the memory): both compute at once, an array moves island to island (GB/s), op-by-op dispatch (calls/s),
  and each host's memory on the GPU (``nvidia-smi``).
- ``palm``: the PaLM example (bfloat16, one pod on the whole GPU) at a size that fills its memory: tokens/s
  and MFU against the GPU's bf16 datasheet peak (PaLM reached 46.2%).
- ``palm_jax``: the same model, batch and optimizer as one ``jax.jit`` step in plain JAX on the GPU (each layer
  group rematerialized, as the runtime's step does): what the runtime's PaLM step is measured against.
- ``dispatch``, ``transfer``: ``benchmarks.dispatch --quick`` and ``benchmarks.transfer --quick`` as written
  (CPU islands on this machine's cores), their JSON next to the others.

``--platform cpu`` runs the same checks with CPU devices (a dry run where there is no GPU; ``jax_matmul``
then measures float32 on the CPU). The client process itself never touches the GPU: its JAX runs on CPU
(``JAX_PLATFORMS=cpu``, set here before JAX loads), so the islands' hosts get the whole device.

On a machine without Ray installed, Ray's wheel unpacked into a folder on ``PYTHONPATH`` does (the checks need
Ray, flatbuffers for ``jax.export`` and tqdm for the PaLM example importable; nothing from the network).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform as platform_module
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHECKS = ("env", "jax_matmul", "quickstart", "shared_gpu", "palm", "palm_jax", "dispatch", "transfer")
LIMITS_S = {"env": 30, "jax_matmul": 60, "quickstart": 90, "shared_gpu": 100, "palm": 240, "palm_jax": 150,
            "dispatch": 120, "transfer": 120}  # each check's own limit; all of them together get --budget
OWN_GPU = ("jax_matmul", "palm_jax")  # checks whose own process runs JAX on the GPU (plain JAX baselines)
BUDGET_S = 420  # all checks together, so that a run that goes wrong still ends within ten minutes
MIB = 2**20


def _record(out: Path, name: str, payload: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))


def _nvidia_smi(query: str) -> list[list[str]]:
    """Rows of ``nvidia-smi --query-...=query --format=csv,noheader`` (empty where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    kind = "--query-compute-apps" if query.startswith("pid") else "--query-gpu"
    try:
        text = subprocess.run(["nvidia-smi", f"{kind}={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


# -- the checks (each in its own process) ------------------------------------------------------------


def check_env(platform: str) -> dict:
    import jax
    import ray

    probe = subprocess.run([sys.executable, "-c", "import jax; print([(d.platform, d.device_kind) for d in "
                            "jax.devices()])"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "JAX_PLATFORMS": "cuda" if platform == "gpu" else "cpu",
                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    needed = ("flatbuffers", "msgpack", "optax", "tqdm", "jsonschema")  # jax.export, the wire, the examples, Ray
    return {"python": platform_module.python_version(), "jax": jax.__version__, "ray": ray.__version__,
            "missing_modules": [m for m in needed if importlib.util.find_spec(m) is None],
            "gpus": _nvidia_smi("name,memory.total,driver_version"), "jax_devices": probe.stdout.strip(),
            "jax_devices_error": probe.stderr.strip()[-2000:] if probe.returncode else "", "cpus": os.cpu_count()}


def check_jax_matmul(platform: str) -> dict:
    import jax
    import jax.numpy as jnp

    n, dtype = (8192, jnp.bfloat16) if platform == "gpu" else (1024, jnp.float32)
    a = jnp.ones((n, n), dtype) / n
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        out = mm(a)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / reps
    device = jax.devices()[0]
    result = {"device": device.device_kind, "n": n, "dtype": jnp.dtype(dtype).name, "seconds": seconds,
              "tflops": 2 * n**3 / seconds / 1e12}
    if platform == "gpu":
        from examples.palm import flops

        peak = flops.gpu_datasheet_peak(device.device_kind, "bfloat16")
        result.update(datasheet_tflops=peak / 1e12 if peak else None,
                      of_datasheet=2 * n**3 / seconds / peak if peak else None)
    return result


def check_quickstart(platform: str) -> dict:
    args = [sys.executable, "examples/quickstart.py"] + (["--gpu"] if platform == "gpu" else [])
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=LIMITS_S["quickstart"] - 5)
    text = proc.stdout
    ok = proc.returncode == 0 and "y = [3. 5.]" in text and "z = [2. 4.]" in text
    return {"ok": ok, "returncode": proc.returncode, "seconds": time.perf_counter() - start,
            "stdout": text[-4000:], "stderr": proc.stderr[-4000:]}


def _topology(platform: str, islands: int, share: float, fraction: float | None = None) -> Any:
    import pathways as pw

    if platform == "gpu":
        return pw.Topology(islands=islands, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=share,
                           gpu_memory_fraction=fraction)
    return pw.Topology(islands=islands, hosts_per_island=1, devices_per_host=1)


def check_shared_gpu(platform: str) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import pathways as pw

    topology = _topology(platform, 2, 0.5)
    pw.init(topology=topology)
    try:
        hosts = [h.devices for island in pw.status().islands for h in island.hosts]
        memory = _nvidia_smi("pid,used_memory")  # each host process's share, preallocated at start
        s0, s1 = (pw.slice((1,), ("x",), island=i) for i in (0, 1))
        n = 4096
        dtype = np.float32
        square = pw.jit(lambda a: (a.astype(jnp.bfloat16) @ a.astype(jnp.bfloat16)).astype(jnp.float32) / n,
                        name="square")
        base = np.ones((n, n), dtype)
        a0, a1 = pw.put(base, s0), pw.put(base, s1)

        @pw.program
        def both(x: Any, y: Any) -> tuple:
            return square(x), square(y)

        r0, r1 = both(a0, a1)
        same = bool(np.allclose(np.asarray(r0), 1.0) and np.allclose(np.asarray(r1), 1.0))
        reps = 10
        start = time.perf_counter()
        for _ in range(reps):
            outs = both(a0, a1)
        for o in outs:
            o.block_until_ready()
        both_s = (time.perf_counter() - start) / reps

        corner = pw.jit(lambda v: v[:1, :1], name="corner")  # reads one element: the time is the move's

        @pw.program
        def move(x: Any) -> Any:
            return corner(pw.transfer(x, s1))

        big = pw.put(np.ones((256 * MIB // 4 // 1024, 1024), dtype), s0, P("x"))
        move(big).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            move(big).block_until_ready()
            times.append(time.perf_counter() - start)
        move_s = float(np.median(times))

        add = pw.jit(lambda v: v + 1.0, name="add")
        v = pw.put(np.zeros((8,), dtype), s0)
        for _ in range(200):
            v = add(v)
        v.block_until_ready()
        calls = 2000
        start = time.perf_counter()
        for _ in range(calls):
            v = add(v)
        v.block_until_ready()
        dispatch_s = time.perf_counter() - start
        return {"topology": str(topology), "hosts_devices": hosts, "host_gpu_memory_mib": memory,
                "both_islands_matmul_ok": same, "both_islands_bf16_matmul_s": both_s,
                "tflops_both": 2 * 2 * n**3 / both_s / 1e12, "transfer_256mib_s": move_s,
                "transfer_gbps": 256 * MIB / move_s / 1e9, "op_by_op_calls_per_s": calls / dispatch_s,
                "final_value_ok": bool(np.asarray(v)[0] == 2200.0)}
    finally:
        pw.shutdown()


GIB_PER_SEQUENCE = 1.7  # the 350m config's layer-group backward, bfloat16, 1024 tokens (XLA's CPU memory analysis)


def palm_batch(platform: str, given: int | None) -> int:
    """Sequences per step: as given, else (GPU) the largest power of two whose activations should fit in what
    the pod's host takes of the GPU (0.9 of it, less 4 GiB for parameters, optimizer state and gradients), else
    4."""
    if given:
        return given
    gpus = _nvidia_smi("memory.total")
    if platform != "gpu" or not gpus:
        return 4
    room = 0.9 * float(gpus[0][0]) / 1024 - 4
    batch = 1
    while 2 * batch * GIB_PER_SEQUENCE <= room:
        batch *= 2
    return batch


def check_palm(platform: str, config_name: str, batch: int | None, steps: int) -> dict:
    """The PaLM step on one pod that holds the whole GPU; where a batch does not fit, half of it is tried."""
    batch = palm_batch(platform, batch)
    tried = []
    while True:
        try:
            return {**_palm(platform, config_name, batch, steps), "batches_that_did_not_fit": tried}
        except Exception as exc:  # out of device memory: the island says so in the error it delivers
            words = str(exc)
            if batch == 1 or not any(w in words for w in ("RESOURCE_EXHAUSTED", "out of memory", "GiB on a host")):
                raise
            tried.append({"batch": batch, "error": words[:300]})
            batch //= 2


def _palm(platform: str, config_name: str, batch: int, steps: int) -> dict:
    import dataclasses

    import jax
    import numpy as np

    import pathways as pw
    from examples.palm import data, flops, model, optim
    from examples.palm.config import CONFIGS
    from examples.palm.peak import pods_peak
    from examples.palm.step import TrainStep

    dtype = "bfloat16" if platform == "gpu" else "float32"
    config = dataclasses.replace(CONFIGS[config_name], dtype=dtype)
    optim_config = optim.OptimConfig()
    pw.init(topology=_topology(platform, 1, 1.0, 0.9 if platform == "gpu" else None))
    try:
        s = pw.slice((1, 1), ("data", "model"))
        step = TrainStep(config, optim_config, [s], overlap=False, donate=True)
        params = model.init_params(config, jax.random.key(0))
        state = step.put_state(params, optim.init_opt_state(params, optim_config))
        del params
        tokens = data.batch(0, 0, batch, config.seq_len)
        start = time.perf_counter()
        state, metrics, norms = step(state, tokens)
        first_loss = float(np.asarray(metrics[0])[0])
        first_s = time.perf_counter() - start
        for _ in range(2):  # warm
            state, metrics, norms = step(state, tokens)
        metrics[0].block_until_ready()
        start = time.perf_counter()
        for _ in range(steps):  # dispatched back to back, as training does; the last loss is read at the end
            state, metrics, norms = step(state, tokens)
        last_loss = float(np.asarray(metrics[0])[0])
        step_s = (time.perf_counter() - start) / steps
        tokens_per_s = batch * config.seq_len / step_s
        peak, source = pods_peak([s], dtype)
        return {"config": config_name, "dtype": dtype, "params": config.n_params(), "batch": batch,
                "seq_len": config.seq_len, "first_step_s": first_s, "step_s": step_s, "tokens_per_s": tokens_per_s,
                "model_tflops": tokens_per_s * config.flops_per_token() / 1e12,
                "peak_tflops": peak / 1e12 if peak else None, "peak_source": source,
                "mfu": flops.mfu(tokens_per_s, config, peak) if peak else None,
                "hfu": flops.hfu(tokens_per_s, config, peak, recompute=True) if peak else None,
                "first_loss": first_loss, "last_loss": last_loss, "loss_falls": last_loss < first_loss,
                "palm_mfu": 0.462}
    finally:
        pw.shutdown()


def check_palm_jax(platform: str, config_name: str, batch: int | None, steps: int) -> dict:
    """The PaLM step in plain JAX on this process's device, at the batch the runtime's check used (or what fits)."""
    import dataclasses

    import jax
    import numpy as np

    from examples.palm import data, model, optim
    from examples.palm.config import CONFIGS

    dtype = "bfloat16" if platform == "gpu" else "float32"
    config = dataclasses.replace(CONFIGS[config_name], dtype=dtype)
    optim_config = optim.OptimConfig()

    def loss(params: Any, tokens: dict) -> tuple:
        x = model.embed_forward(params["embed"], tokens["inputs"], config)
        for group in model.split_groups(params["layers"], config):
            x = jax.checkpoint(lambda g, h: model.stage_forward(g, h, config))(group, x)
        logits = model.logits_from_hidden(model.head_params(params), x, config)
        return model.loss_from_logits(logits, tokens["targets"], config)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, tokens: dict) -> tuple:
        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens)
        params, opt_state = optim.apply_update(params, opt_state, grads, optim_config)
        return params, opt_state, value

    batch = palm_batch(platform, batch)
    tried = []
    while True:
        try:
            params = model.init_params(config, jax.random.key(0))
            opt_state = optim.init_opt_state(params, optim_config)
            tokens = jax.device_put(data.batch(0, 0, batch, config.seq_len))
            params, opt_state, first = step(params, opt_state, tokens)
            first_loss = float(first)
            break
        except Exception as exc:  # out of device memory: half the batch
            if batch == 1 or "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            tried.append(batch)
            batch //= 2
    for _ in range(2):  # warm
        params, opt_state, value = step(params, opt_state, tokens)
    value.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, value = step(params, opt_state, tokens)
    last_loss = float(value)
    step_s = (time.perf_counter() - start) / steps
    return {"config": config_name, "dtype": dtype, "batch": batch, "batches_that_did_not_fit": tried,
            "step_s": step_s, "tokens_per_s": batch * config.seq_len / step_s, "first_loss": first_loss,
            "last_loss": last_loss, "device": jax.devices()[0].device_kind,
            "finite": bool(np.isfinite(last_loss))}


def check_benchmark(name: str, out: Path) -> dict:
    path = out / f"bench_{name}.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(path)]
                          + (["--no-plot"] if name == "dispatch" else []),
                          capture_output=True, text=True, timeout=LIMITS_S[name] - 5)
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - start, "json": str(path),
            "stdout": proc.stdout[-6000:], "stderr": proc.stderr[-3000:]}


def run_one(name: str, args: argparse.Namespace) -> dict:
    out = Path(args.out)
    if name == "env":
        return check_env(args.platform)
    if name == "jax_matmul":
        return check_jax_matmul(args.platform)
    if name == "quickstart":
        return check_quickstart(args.platform)
    if name == "shared_gpu":
        return check_shared_gpu(args.platform)
    if name == "palm":
        return check_palm(args.platform, args.palm_config, args.palm_batch, args.palm_steps)
    if name == "palm_jax":
        return check_palm_jax(args.platform, args.palm_config, args.palm_batch, args.palm_steps)
    return check_benchmark(name, out)


# -- the driver ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="where the islands' devices are")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu_check",
                   help="folder for the records (default: $OUT)")
    p.add_argument("--only", nargs="+", choices=CHECKS, help="run these checks only")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks together; a check "
                   "that would start with under 20 s left is skipped")
    p.add_argument("--palm-config", default=None, help="PaLM size (default: 350m on GPU, tiny on CPU)")
    p.add_argument("--palm-batch", type=int, default=None,
                   help="sequences per step (default: what the GPU's memory should hold, 4 on CPU)")
    p.add_argument("--palm-steps", type=int, default=None, help="timed steps (default: 10 on GPU, 3 on CPU)")
    p.add_argument("--run", choices=CHECKS, help=argparse.SUPPRESS)  # one check, in this process
    args = p.parse_args(argv)
    gpu = args.platform == "gpu"
    args.palm_config = args.palm_config or ("350m" if gpu else "tiny")
    args.palm_steps = args.palm_steps or (10 if gpu else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:
        _record(out, args.run, run_one(args.run, args))
        return 0
    records = out / "gpu_check.jsonl"
    records.write_text("")
    names = args.only or CHECKS
    deadline = time.monotonic() + args.budget
    ran = 0
    for name in names:
        start = time.perf_counter()
        left = deadline - time.monotonic()
        if left < 20:
            row = {"check": name, "platform": args.platform, "ok": False, "skipped": "out of time (--budget)"}
        else:
            row = _run_check(name, args, out, min(LIMITS_S[name], left))
            row["seconds"] = round(time.perf_counter() - start, 1)
            ran += row["ok"]
        with records.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        brief = {k: v for k, v in row.items() if k not in ("stdout", "stderr", "error") and not isinstance(v, list)}
        print(json.dumps(brief, default=str)[:1500], flush=True)
        if not row["ok"] and "error" in row:
            print(f"  {name} failed:\n{row['error']}", flush=True)
    print(f"{ran} of {len(names)} checks ran; records in {records}")
    return 0 if ran == len(names) else 1


def _run_check(name: str, args: argparse.Namespace, out: Path, limit: float) -> dict:
    """One check in a process of its own, within ``limit`` seconds: its record, or what it printed when it
    failed. Only the plain-JAX baselines give their process the GPU; every other client runs JAX on CPU."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--run", name, "--platform", args.platform,
           "--out", str(out), "--palm-config", args.palm_config, "--palm-steps", str(args.palm_steps)]
    cmd += ["--palm-batch", str(args.palm_batch)] if args.palm_batch else []
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if name in OWN_GPU and args.platform == "gpu" else "cpu",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}  # what the runtime's one pod takes of the GPU in ``palm``
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        code, tail = f"timed out after {limit:.0f} s", (_text(exc.stdout) + _text(exc.stderr))[-3000:]
    if code == 0 and result_file.exists():
        return {"check": name, "platform": args.platform, "ok": True, **json.loads(result_file.read_text())}
    return {"check": name, "platform": args.platform, "ok": False, "exit": code, "error": tail}


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the driver and the clients leave the GPU to the islands
    raise SystemExit(main())
