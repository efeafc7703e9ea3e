"""Where an object-store transfer's time goes: the stages of the runtime's send and recv, timed one by one.

This is the path between hosts on different nodes (hosts on one node copy lent shards directly, see
``resource_manager/direct.py``; ``benchmarks/transfer.py`` measures that). Two plain Ray actors with 4 CPU
devices each (like two single-host islands) run the operations of ``Executor._deliver_all`` and
``Executor._recv`` on the object-store path: ``local_pieces`` and ``np.asarray`` on the producer, one
``deliver`` actor call carrying every piece with the msgpack ``deliver`` message, then on the consumer
``region`` per device, ``jax.device_put`` per device and ``make_array_from_single_device_arrays``. Each
stage is stamped with the wall clock (both actors share this machine's clock).

Variants, each a concrete change to try in ``resource_manager`` (none is applied there):
  as-is      the runtime's path.
  parallel   one ``deliver`` call per piece, issued from a thread pool, the consumer assembling when the
             last piece lands: the pieces are written into the object store concurrently.
  on-device  resharding: the pieces are adopted zero-copy in the source sharding and XLA reshards them.

    python -m benchmarks.transfer_breakdown [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.common import Table, default_out, median, timed, write_json  # noqa: E402
from pathways import wire  # noqa: E402
from pathways.sharding import device_indices, index_from_wire, plan_transfer, spec_from_wire, spec_to_wire  # noqa: E402
from resource_manager.buffer_pool import aligned_empty  # noqa: E402
from resource_manager.transfer import local_pieces, region  # noqa: E402

MIB = 2**20
DEVICES = 4
CASES = {"P(x)->P(x)": (P("x", None), P("x", None)), "P(x)->P(None,x)": (P("x", None), P(None, "x"))}
VARIANTS = {"P(x)->P(x)": ("as-is", "parallel"), "P(x)->P(None,x)": ("as-is", "parallel", "on-device")}
STAGES = ("asarray", "serialize", "ray call", "region", "device_put", "total")
TIMEOUT_S = 120.0
WARM_BYTES = 2**30  # untimed traffic first: Ray's object store is slow on pages a process touches the first time


def slice_desc() -> dict:
    return {"shape": [DEVICES], "axes": ["x"], "devices": [[0, d] for d in range(DEVICES)]}


def local_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:DEVICES]), ("x",))


class Producer:
    """Island 0's host: holds the sharded array and sends its pieces the way ``_deliver_all`` does."""

    def __init__(self) -> None:
        self.x: jax.Array | None = None
        self.pool = ThreadPoolExecutor(max_workers=DEVICES)

    def hold(self, shape: tuple[int, int], spec: list) -> None:
        value = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
        self.x = jax.device_put(value, NamedSharding(local_mesh(), spec_from_wire(spec)))
        self.x.block_until_ready()

    def send(self, consumer: Any, routes: list[dict], variant: str) -> dict:
        t0 = time.time()
        pieces = local_pieces(self.x)
        shards = [s for r in routes for s in r["shards"]]
        datas = [np.asarray(pieces[index_from_wire(s)]) for s in shards]
        t1 = time.time()
        if variant == "parallel":
            def one(k: int) -> Any:
                meta = wire.encode("deliver", {"key": 1, "src": 0, "shards": [shards[k]]})
                return consumer.deliver.remote(meta, datas[k])

            refs = list(self.pool.map(one, range(len(datas))))
        else:
            meta = wire.encode("deliver", {"key": 1, "src": 0, "shards": shards})
            refs = [consumer.deliver.remote(meta, *datas)]
        t2 = time.time()
        done = [r for r in ray.get(refs, timeout=TIMEOUT_S) if r is not None]
        return {"t0": t0, "t1": t1, "t2": t2, **done[0]}


class Consumer:
    """Island 1's host: files delivered pieces, and assembles them once all are in (``_recv``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pieces: dict = {}
        self.first = 0.0
        self.expect = 0
        self.plan: dict = {}

    def arm(self, shape: tuple[int, int], src_spec: list, dst_spec: list, expect: int, variant: str) -> None:
        dst = spec_from_wire(dst_spec)
        self.pieces, self.expect, self.first = {}, expect, 0.0
        self.plan = {"shape": shape, "variant": variant, "src": spec_from_wire(src_spec), "dst": dst,
                     "wanted": list(zip(jax.devices()[:DEVICES], device_indices(shape, slice_desc(), dst)))}

    def deliver(self, meta: bytes, *datas: np.ndarray) -> dict | None:
        arrived = time.time()
        msg = wire.decode(meta, "deliver")
        with self.lock:
            self.first = self.first or arrived
            for shard, data in zip(msg["shards"], datas):
                self.pieces[index_from_wire(shard)] = data
            if len(self.pieces) < self.expect:
                return None
        return self.assemble(arrived)

    def assemble(self, arrived: float) -> dict:
        plan, pieces = self.plan, self.pieces
        shape, variant = plan["shape"], plan["variant"]
        mesh = local_mesh()
        if variant == "on-device":
            src_idx = device_indices(shape, slice_desc(), plan["src"])
            t3 = time.time()
            parts = [jax.device_put(pieces[idx], dev) for dev, idx in zip(mesh.devices.flat, src_idx)]
            t4 = time.time()
            rows = jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, plan["src"]), parts)
            array = jax.device_put(rows, NamedSharding(mesh, plan["dst"]))
            aliased = [p.unsafe_buffer_pointer() == pieces[idx].ctypes.data for p, idx in zip(parts, src_idx)]
        else:
            t3 = time.time()  # region gathers into 64-byte-aligned buffers, so device_put can alias them
            regions = [region(pieces, idx, np.dtype(np.float32)) for _, idx in plan["wanted"]]
            t4 = time.time()
            parts = [jax.device_put(r, dev) for r, (dev, _) in zip(regions, plan["wanted"])]
            array = jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, plan["dst"]), parts)
            aliased = [p.unsafe_buffer_pointer() == r.ctypes.data for p, r in zip(parts, regions)]
        array.block_until_ready()
        t5 = time.time()
        return {"first": self.first, "last": arrived, "t3": t3, "t4": t4, "t5": t5, "aliased": all(aliased)}


def stage_times(stamps: dict) -> dict[str, float]:
    return {"asarray": stamps["t1"] - stamps["t0"], "serialize": stamps["t2"] - stamps["t1"],
            "ray call": stamps["t3"] - stamps["t2"], "region": stamps["t4"] - stamps["t3"],
            "device_put": stamps["t5"] - stamps["t4"], "total": stamps["t5"] - stamps["t0"]}


def measure(producer: Any, consumer: Any, nbytes: int, case: str, variant: str, reps: int) -> dict:
    src, dst = CASES[case]
    shape = (nbytes // (4 * 1024), 1024)
    routes, expect = plan_transfer(shape, slice_desc(), src, slice_desc(), dst)
    ray.get(producer.hold.remote(shape, spec_to_wire(src)), timeout=TIMEOUT_S)
    runs = []
    warm = min(64, max(1, -(-WARM_BYTES // nbytes)))
    for k in range(warm + reps):
        ray.get(consumer.arm.remote(shape, spec_to_wire(src), spec_to_wire(dst), expect[0][1], variant),
                timeout=TIMEOUT_S)
        stamps = ray.get(producer.send.remote(consumer, routes, variant), timeout=TIMEOUT_S)
        if k >= warm:
            runs.append(stamps)
    stages = {s: median([stage_times(r)[s] for r in runs]) for s in STAGES}
    return {"bytes": nbytes, "case": case, "variant": variant, "stages_s": stages,
            "gbps": nbytes / stages["total"] / 1e9, "device_put_aliased": all(r["aliased"] for r in runs),
            "pieces": sum(len(r["shards"]) for r in routes)}


def reference(nbytes: int, reps: int) -> dict[str, float]:
    """Single-process numbers the stages compare with: memcpy, and writing the array into the object store."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    out = {"memcpy": median([timed(lambda: np.copyto(dst, src)) for _ in range(reps)])}
    out["fresh copy (alloc + memcpy)"] = median([timed(lambda: np.array(src)) for _ in range(reps)])
    out["ray.put"] = median([timed(lambda: ray.put(src)) for _ in range(reps)])
    unaligned = np.ones(nbytes // 4, np.float32)
    out["jax.device_put (unaligned numpy: copies)"] = median(
        [timed(lambda: jax.device_put(unaligned).block_until_ready()) for _ in range(reps)])
    aligned = aligned_empty(src.shape, src.dtype)
    aligned[...] = 1
    out["jax.device_put (64-byte aligned: aliases)"] = median(
        [timed(lambda: jax.device_put(aligned).block_until_ready()) for _ in range(reps)])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB only, fewer repetitions")
    parser.add_argument("--sizes-mib", type=float, nargs="+", help="array sizes in MiB (default 64 256)")
    parser.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    parser.add_argument("--out", type=Path, default=default_out("transfer_breakdown"), help="JSON output path")
    args = parser.parse_args(argv)
    sizes = args.sizes_mib or ((64,) if args.quick else (64, 256))
    load_at_start = os.getloadavg()
    reps = args.reps or (5 if args.quick else 7)

    ray.init(include_dashboard=False, logging_level=logging.WARNING)
    env = {"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}}
    producer = ray.remote(Producer).options(num_cpus=0, runtime_env=env).remote()
    consumer = ray.remote(Consumer).options(num_cpus=0, runtime_env=env, max_concurrency=2 * DEVICES).remote()
    results, references = [], {}
    try:
        for mib in sizes:
            nbytes = int(mib * MIB)
            references[f"{mib:g} MiB"] = reference(nbytes, reps)
            for case, variants in VARIANTS.items():
                for variant in variants:
                    results.append(measure(producer, consumer, nbytes, case, variant, reps))
                    print(f"  {mib:g} MiB {case} {variant}: {results[-1]['gbps']:.2f} GB/s", flush=True)
    finally:
        ray.shutdown()

    table = Table(["size", "sharding", "variant", *(f"{s} ms" for s in STAGES), "GB/s", "x memcpy", "aliased"])
    for r in results:
        label = f"{r['bytes'] / MIB:g} MiB"
        memcpy = references[label]["memcpy"]
        table.add(label, r["case"], r["variant"], *(f"{r['stages_s'][s] * 1e3:.1f}" for s in STAGES),
                  f"{r['gbps']:.2f}", f"{memcpy / r['stages_s']['total']:.2f}",
                  "yes" if r["device_put_aliased"] else "no")
    print()
    print(f"Stages of one transfer between two 4-device actors (medians of {reps}); 'aliased' = device_put "
          f"adopted the received buffers without a copy; load average {load_at_start[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end on {os.cpu_count()} cores")
    print(table.render())
    print("Single-process references:")
    for label, refs in references.items():
        nbytes = int(float(label.split()[0]) * MIB)
        print("  " + label + ": " + "; ".join(f"{k} {v * 1e3:.1f} ms ({nbytes / v / 1e9:.2f} GB/s)"
                                               for k, v in refs.items()))
    out = write_json(args.out, {"benchmark": "transfer_breakdown", "reps": reps, "results": results,
                                "load_average_at_start": load_at_start,
                                "references_s": references})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
