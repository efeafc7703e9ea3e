"""Suspending a cluster into a directory and resuming it, per GiB of arrays, against writing and reading the
same bytes with numpy (each file synced to disk, as a suspend does).

An embedded cluster (2 islands x 1 host x 4 CPU devices) holds float32 arrays of each size, spread over both
islands; the admin suspends it into a fresh directory on local disk and resumes it in place, ``--runs``
times per size, and the arrays are compared bitwise with what the islands held before. A resume restarts the
islands (a fixed cost, measured with almost nothing saved) and then reads every byte back with checksums.
The last line:

    suspend: S s/GiB (numpy write W s/GiB, Rx), resume: T s/GiB + F s to restart islands
    (numpy read Q s/GiB, Rx), arrays bitwise identical: yes      (one line)

    python -m benchmarks.suspend [--quick] [--runs N] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Table, default_out, median, ratio_text, write_json

GIB = 1 << 30


def numpy_baseline(arrays: list[np.ndarray], folder: Path) -> tuple[float, float]:
    """Seconds to write ``arrays`` to files (synced) and to read them back."""
    folder.mkdir()
    t0 = time.perf_counter()
    for k, a in enumerate(arrays):
        with open(folder / f"{k}.bin", "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    wrote = time.perf_counter() - t0
    os.system("sync")
    t0 = time.perf_counter()
    back = [np.fromfile(folder / f"{k}.bin", dtype=a.dtype) for k, a in enumerate(arrays)]
    read = time.perf_counter() - t0
    assert all(np.array_equal(b, a.ravel()) for a, b in zip(arrays, back))
    shutil.rmtree(folder)
    return wrote, read


def one_size(nbytes: int, runs: int, scratch: Path) -> dict:
    """Suspend and resume with ``nbytes`` of arrays on the islands, ``runs`` times; medians, and the baseline."""
    from jax.sharding import PartitionSpec as P

    import pathways as pw

    def on_island(a: pw.Array) -> np.ndarray:  # what the island holds now (a fetch of ``a`` itself is kept)
        return pw.jit(lambda v: v, slice=a.slice, in_specs=a.spec)(a).fetch(timeout=300)

    rows = 1024
    cols = max(4, nbytes // 2 // 4 // rows)  # half on each island
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((rows, cols), dtype=np.float32) for _ in range(2)]
    slices = [pw.slice((4,), ("x",), island=i) for i in range(2)]
    arrays = [pw.put(v, s, P("x")) for v, s in zip(values, slices)]
    held = [on_island(a) for a in arrays]
    admin = pw.admin()
    suspend_s, resume_s, identical = [], [], True
    for run in range(runs):
        folder = scratch / f"snap-{nbytes}-{run}"
        t0 = time.perf_counter()
        done = admin.suspend(str(folder), timeout=300)
        suspend_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        admin.resume(str(folder), timeout=300)
        resume_s.append(time.perf_counter() - t0)
        identical &= all(np.array_equal(on_island(a), h) for a, h in zip(arrays, held))
        shutil.rmtree(folder)
    write_s, read_s = zip(*(numpy_baseline(values, scratch / f"np-{nbytes}-{k}") for k in range(runs)))
    for s in slices:
        s.release()
    return {"bytes": done["bytes"], "suspend_s": median(suspend_s), "resume_s": median(resume_s),
            "numpy_write_s": median(write_s), "numpy_read_s": median(read_s), "identical": identical,
            "runs": {"suspend": suspend_s, "resume": resume_s, "write": list(write_s), "read": list(read_s)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="sizes 1 MiB and 128 MiB, 2 runs")
    p.add_argument("--runs", type=int, default=None, help="suspend/resume cycles per size (default 3)")
    p.add_argument("--out", type=Path, default=default_out("suspend"))
    args = p.parse_args()
    sizes = [1 << 20, 128 << 20] if args.quick else [1 << 20, 256 << 20, 1 << 30]
    runs = args.runs or (2 if args.quick else 3)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    import pathways as pw

    pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4))
    scratch = Path(tempfile.mkdtemp(prefix="pathways-suspend-bench-"))
    try:
        results = [one_size(n, runs, scratch) for n in sizes]
    finally:
        pw.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    table = Table(["arrays", "suspend s", "numpy write s", "resume s", "numpy read s", "bitwise"])
    for r in results:
        table.add(f"{r['bytes'] / 2**20:.0f} MiB", f"{r['suspend_s']:.2f}", f"{r['numpy_write_s']:.2f}",
                  f"{r['resume_s']:.2f}", f"{r['numpy_read_s']:.2f}", "yes" if r["identical"] else "NO")
    print(table.render())
    small, big = results[0], results[-1]
    gib = (big["bytes"] - small["bytes"]) / GIB

    def slope(key: str) -> float:
        return (big[key] - small[key]) / gib

    fixed = small["resume_s"] - small["bytes"] / GIB * slope("resume_s")
    per = {k: slope(k) for k in ("suspend_s", "resume_s")}
    write, read = big["numpy_write_s"] * GIB / big["bytes"], big["numpy_read_s"] * GIB / big["bytes"]
    identical = all(r["identical"] for r in results)
    write_json(args.out, {"sizes": sizes, "results": results, "per_gib": per, "restart_s": fixed})
    print(f"suspend: {per['suspend_s']:.2f} s/GiB (numpy write {write:.2f} s/GiB, "
          f"{ratio_text(per['suspend_s'] / write)}), resume: {per['resume_s']:.2f} s/GiB + {fixed:.1f} s to restart "
          f"islands (numpy read {read:.2f} s/GiB, {ratio_text(per['resume_s'] / read)}), arrays bitwise identical: "
          f"{'yes' if identical else 'no'}")


if __name__ == "__main__":
    main()
