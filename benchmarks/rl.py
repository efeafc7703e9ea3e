"""RL across islands: GRPO on the sorting task (examples/rl) under each ``pw.rl`` placement, and its weight sync.

Per placement (colocated, disaggregated, async k=1), each with a loop of its own on the same cluster, measured in
alternating rounds (the order turning each round) so that a busy moment hits all three:

- steps/s: ``--steps`` steps dispatched back to back (the loop keeps k + 2 in flight) until the last has landed;
- the sampler's and the trainer's busy fractions: the seconds their computations ran (``NAME_sample`` and
  ``NAME_train`` spans of a ``pw.trace`` recorded over the round, summed from the hosts' own timings) over the
  round's wall time;
- the reward curve: every step's mean reward (training goes on across the rounds).

T = the median async steps/s over the median disaggregated (on-policy) steps/s. Here a rollout takes about a third
of an update, which bounds T near 1.3; so disaggregated and async run again with generation as slow as training
(``balanced``; ``--no-balance`` skips it): the trainer's host capped at 0.9 cores and the sampler's at 0.9 times
the measured ratio of their busy times (``benchmarks.cpu_caps``, as ``benchmarks.pipeline`` makes devices of
fixed speed), and T is taken there.

Weight sync: the RL policy at a size where bytes dominate (``SYNC_CONFIG``: d_model 1024, 4 layers, 237 MB;
``--quick``: d_model 512) moved from the trainer's layout (FSDP over ("data",)) to the sampler's (tensor parallel
over ("model",)) on another island by ``pw.WeightSync``, from dispatch until every synced leaf has been used
there (``benchmarks.weight_sync.time_sync``; nothing subtracted, and the fixed cost of such a program printed
beside it), alternating with a memcpy of the same bytes (``benchmarks.weight_sync.measure_memcpy``). The loop's
slices hold one device each, so that sync reshards nothing; the headline's memcpy ratio is therefore that of a
resharding sync, ``benchmarks.weight_sync.one_node`` (PaLM's parameters, (2, 2) FSDP x model -> (1, 4) on
another island; on CPU). Across two Ray nodes (unless ``--no-nodes``): ``benchmarks.weight_sync.two_nodes``,
the same resharding sync between islands on two Ray nodes of this machine, alternating with raw TCP between the
same two hosts. With ``--platform gpu`` the
two islands share the one GPU (``gpu_share`` 0.5, as ``benchmarks.gpu_check``'s shared_gpu check), each slice is
that one device, and neither the balanced rounds nor the two nodes run.

    python -m benchmarks.rl [--quick] [--platform cpu|gpu] [--rounds N] [--steps N] [--no-nodes] [--no-balance]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

if __name__ == "__main__":
    # Before Ray loads (as benchmarks.transfer_nodes): the two-node cluster's files in a private temp dir.
    os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pwbench-", dir="/tmp")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pathways as pw  # noqa: E402
from benchmarks.common import Table, default_out, median, ratio, write_json  # noqa: E402
from benchmarks.weight_sync import check_bits, measure_memcpy, time_sync  # noqa: E402
from examples.rl import model  # noqa: E402
from examples.rl.train import TrainOptions, make_loop  # noqa: E402

KINDS = ("colocated", "disaggregated", "async")
SYNC_CONFIG = {"d_model": 1024, "n_layers": 4, "n_heads": 16, "head_dim": 64, "ffn_dim": 4096, "seq_len": 128,
               "vocab_size": 12}
QUICK_SYNC_CONFIG = {**SYNC_CONFIG, "d_model": 512, "ffn_dim": 2048, "n_heads": 8}
TRAINER_CORES = 0.9  # balanced: the trainer's host's cap; the sampler's is this times its natural busy ratio, at first
CALIBRATIONS = 4  # balanced: rounds at most that adjust the sampler's cap until a rollout takes as long as an update
TOLERANCE = 0.1  # balanced: how far from 1 a rollout's time over an update's may stay


def topology(platform: str) -> pw.Topology:
    if platform == "gpu":
        return pw.Topology(islands=2, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=0.5)
    return pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4)


def busy_seconds(trace_path: str, name: str) -> tuple[float, float]:
    """Seconds the computations ``NAME_sample`` and ``NAME_train`` ran in a recorded trace (their hosts' spans)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = {"sample": 0.0, "train": 0.0}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "exec":
            for role in spans:
                if e["name"] == f"{name}_{role}":
                    spans[role] += e["dur"] / 1e6
    return spans["sample"], spans["train"]


def measure_round(loop: pw.rl.Loop, kind: str, steps: int, folder: str, row: dict) -> None:
    """``steps`` steps of one loop under a trace: steps/s, each role's busy fraction, and every step's reward."""
    path = os.path.join(folder, f"{kind}_{len(row['steps_per_s'])}.json")
    with pw.trace(path):
        start = time.perf_counter()
        results = [loop.step() for _ in range(steps)]
        loop.finish()
        wall = time.perf_counter() - start
    sample_s, train_s = busy_seconds(path, loop.name)
    row["steps_per_s"].append(steps / wall)
    row["sampler_busy"].append(sample_s / wall)
    row["trainer_busy"].append(train_s / wall)
    row["rewards"] += [res.read()["reward"] for res in results]


def alternate(loops: dict, kinds: Sequence[str], rounds: int, steps: int, rows: dict, label: str) -> None:
    folder = tempfile.mkdtemp(prefix="rl-bench-")
    for r in range(rounds):
        for kind in list(kinds[r % len(kinds):]) + list(kinds[:r % len(kinds)]):
            measure_round(loops[kind], kind, steps, folder, rows[kind])
        print(f"  {label} round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {rows[k]['steps_per_s'][-1]:.2f} steps/s" for k in kinds), flush=True)


def new_rows(kinds: Sequence[str]) -> dict:
    return {k: {"steps_per_s": [], "sampler_busy": [], "trainer_busy": [], "rewards": []} for k in kinds}


def placements(args: argparse.Namespace) -> dict:
    """Every placement's loop on one cluster, timed in alternating rounds: per kind, steps/s and busy fractions per
    round and the reward of every step; then disaggregated and async again with generation made as slow as
    training (``balanced``); then the weight sync against memcpy."""
    pw.init(topology=topology(args.platform), timeouts=pw.Timeouts(fetch=120.0, op=120.0))
    devices = 1 if args.platform == "gpu" else args.devices
    loops: dict[str, Any] = {}
    out: dict[str, Any] = {"natural": new_rows(KINDS)}
    try:
        for kind in KINDS:
            opts = TrainOptions(placement=kind, config=args.config, devices=devices, prompts=args.prompts,
                                group=args.group, length=args.length, seed=0, progress=False, plot=False)
            loop, state = make_loop(opts, name=f"rl_{kind}")
            loop.start(*state[:2], consts=state[2], key=jax.random.key(1))
            loops[kind] = loop
            out["natural"][kind]["rewards"] += [r.read()["reward"] for r in [loop.step() for _ in range(3)]]
            if kind == "colocated":
                out["colocated_memory"] = resident(loop, opts, state)
        alternate(loops, KINDS, args.rounds, args.steps, out["natural"], "natural")
        out["reward_curve"] = list(out["natural"]["async"]["rewards"])  # the async loop's every step
        if args.balance and args.platform == "cpu":
            out["balanced"] = balanced(loops, args, out)
            out["reward_curve"] += out["balanced"]["async"]["rewards"]
        out["sync"] = sync_one_node(loops["disaggregated"], args)
    finally:
        for loop in loops.values():
            loop.close()
        pw.shutdown()
    return out


def balanced(loops: dict, args: argparse.Namespace, out: dict) -> dict:
    """Disaggregated and async again with the sampler's host capped so that a rollout takes as long as an update
    (the trainer's host capped at ``TRAINER_CORES``, the sampler's first at that times the measured ratio of their
    busy times, then adjusted by ``calibrate``): two devices of fixed speeds whose work per step is the same, as
    when generation dominates less."""
    from benchmarks import cpu_caps

    natural = out["natural"]["disaggregated"]
    share = median(natural["sampler_busy"]) / median(natural["trainer_busy"])
    rows: dict[str, Any] = new_rows(("disaggregated", "async"))
    caps, why = cpu_caps.Caps.start()
    if caps is None:
        rows["note"] = f"not measured ({why})"
        return rows
    spin = {}

    def busy(island: int) -> None:
        where = loops["disaggregated"].trainer if island == 0 else loops["disaggregated"].sampler
        if island not in spin:
            spin[island] = pw.jit(lambda a: jax.lax.fori_loop(0, 40, lambda _, b: jax.numpy.tanh(b @ b), a),
                                  slice=where)
        spin[island](np.eye(512, dtype=np.float32)).block_until_ready(120)

    try:
        hosts = cpu_caps.hosts_by_island([0, 1], busy)
        caps.cap(hosts[0], TRAINER_CORES)
        sampler_cores, tried = calibrate(lambda cores: caps.cap(hosts[1], cores), loops["disaggregated"],
                                         max(0.05, TRAINER_CORES * share), args.steps)
        rows["caps"] = {"trainer_cores": TRAINER_CORES, "sampler_cores": sampler_cores,
                        "natural_sample_over_train": share, "calibration": tried, "how": why}
        print(f"  balanced: sampler capped at {sampler_cores:.2f} cores after "
              + ", ".join(f"{c:.2f} cores -> sample/train {r:.2f}" for c, r in tried), flush=True)
        alternate(loops, ("disaggregated", "async"), args.rounds, args.steps, rows, "balanced")
    finally:
        caps.release()
    return rows


def calibrate(cap: Callable[[float], None], loop: pw.rl.Loop, cores: float,
              steps: int) -> tuple[float, list[tuple[float, float]]]:
    """The sampler's cap at which a rollout takes as long as an update, from ``cores`` on: a round of ``steps``
    disaggregated steps per try, the cap scaled by the rollout's time over the update's (a capped host's
    computation takes time in inverse proportion to its cores) until that ratio is within ``TOLERANCE`` of 1, at
    most ``CALIBRATIONS`` tries. The cap is computed, not assumed: a host uses less than its core when it waits, so
    the natural busy ratio alone leaves a rollout shorter than an update. Returns the cap set and every (cores,
    sample / train) tried."""
    folder = tempfile.mkdtemp(prefix="rl-calibrate-")
    tried: list[tuple[float, float]] = []
    for _ in range(CALIBRATIONS):
        cap(cores)
        row = new_rows(("calibrate",))["calibrate"]
        measure_round(loop, "calibrate", steps, folder, row)
        share = row["sampler_busy"][0] / row["trainer_busy"][0]
        tried.append((cores, share))
        if abs(share - 1) <= TOLERANCE:
            break
        cores = min(TRAINER_CORES, max(0.05, cores * share))
    cap(cores)
    return cores, tried


def resident(loop: pw.rl.Loop, opts: TrainOptions, state: tuple) -> dict:
    """What the colocated island holds between steps (this tenant's buffers, only this loop there yet), against
    the training state and the KV cache a rollout's generation uses: the cache lives inside the generate
    computation (an XLA temporary), so it is freed before the training computation runs."""
    from client.session import current

    loop.finish()
    usage = current().usage(loop.trainer.island)
    rows = opts.prompts * opts.group
    length = opts.length * 2 + 2
    return {"resident_bytes": usage["buffer_bytes"], "peak_bytes": usage["peak_buffer_bytes"],
            "state_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)),
            "params_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(state[0])),
            "kv_cache_bytes": model.kv_cache_bytes(opts.model_config, rows, length)}


def sync_one_node(loop: pw.rl.Loop, args: argparse.Namespace) -> dict:
    """The policy at ``SYNC_CONFIG``'s size synced trainer to sampler (another island), alternating with memcpy."""
    config = model.Config(**(QUICK_SYNC_CONFIG if args.quick else SYNC_CONFIG))
    host = jax.tree.map(np.asarray, model.init(config, jax.random.key(0)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
    params = pw.put(host, loop.trainer, model.fsdp_specs(config, "data"))
    sync = pw.WeightSync(loop.sampler, model.param_specs(config, "model"))
    check_bits(sync(params), params)
    row: dict[str, Any] = {"bytes": nbytes, "memcpy_s": []}
    row["sync_s"], row["probe_s"] = time_sync(sync, params, args.reps,
                                              also=lambda: row["memcpy_s"].append(measure_memcpy(nbytes, 1)))
    return row


def resharded(args: argparse.Namespace) -> dict:
    """The resharding sync on one node (``benchmarks.weight_sync.one_node``), against memcpy."""
    from benchmarks import weight_sync

    return weight_sync.one_node(["small" if args.quick else "medium"], args.reps, 1)[0]


def two_nodes(args: argparse.Namespace) -> dict | None:
    from benchmarks import weight_sync

    rows = weight_sync.two_nodes(["small" if args.quick else "medium"], args.reps, 1)
    return rows[0] if rows else None


def phase_table(rows: dict, title: str) -> Table:
    table = Table([title, "steps/s", "sampler busy", "trainer busy", "sample / train", "reward first 10",
                   "reward last 10"])
    for kind in (k for k in KINDS if k in rows):
        row = rows[kind]
        sampler, trainer = median(row["sampler_busy"]), median(row["trainer_busy"])
        table.add(kind, f"{median(row['steps_per_s']):.2f}", f"{sampler:.2f}", f"{trainer:.2f}",
                  f"{ratio(sampler, trainer):.2f}", f"{np.mean(row['rewards'][:10]):.3f}",
                  f"{np.mean(row['rewards'][-10:]):.3f}")
    return table


def throughput(rows: dict) -> float:
    return ratio(median(rows["async"]["steps_per_s"]), median(rows["disaggregated"]["steps_per_s"]))


def summary(out: dict) -> str:
    """The headline line (and its figures into ``out``)."""
    sync = out.get("resharded") or out["sync"]
    sync_s, memcpy_s = median(sync["sync_s"]), median(sync["memcpy_s"])
    gbps = sync["bytes"] / sync_s / 1e9
    r1 = ratio(memcpy_s, sync_s)
    nodes = out.get("nodes")
    r2 = ratio(median(nodes["raw_tcp_s"]), median(nodes["sync_s"])) if nodes else None
    balanced = out.get("balanced")
    t = throughput(balanced if balanced and "async" in balanced and balanced["async"]["steps_per_s"]
                   else out["natural"])
    rewards = out["reward_curve"]
    a, b = float(np.mean(rewards[:10])), float(np.mean(rewards[-10:]))
    out.update(gbps=gbps, r1=r1, r2=r2, t=t, t_natural=throughput(out["natural"]), reward_first=a, reward_last=b)
    r2_text = f"{r2:.2f}x raw TCP" if r2 is not None else "raw TCP not measured"
    return (f"rl: weight sync {gbps:.2f} GB/s ({r1:.2f}x memcpy, {r2_text}), async/sync throughput {t:.2f}, "
            f"reward {a:.3f} -> {b:.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="about a minute: fewer rounds, a smaller sync")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per placement per round (default 12; --quick 8)")
    p.add_argument("--reps", type=int, default=None, help="sync repetitions (default 7; --quick 3)")
    p.add_argument("--config", default="sort", choices=sorted(model.CONFIGS))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--length", type=int, default=5, help="digits to sort (the answer's tokens)")
    p.add_argument("--devices", type=int, default=1, help="devices of each slice (CPU)")
    p.add_argument("--no-nodes", dest="nodes", action="store_false", help="skip the two-Ray-node sync")
    p.add_argument("--no-balance", dest="balance", action="store_false",
                   help="skip the rounds with generation capped to take as long as training")
    p.add_argument("--out", default=str(default_out("rl")))
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (8 if args.quick else 12)
    args.reps = args.reps or (3 if args.quick else 7)
    if args.rounds < 1 or args.steps < 1 or args.reps < 1:
        p.error("--rounds, --steps and --reps must be positive")
    out = placements(args)
    if args.platform == "cpu":
        out["resharded"] = resharded(args)
    if args.nodes and args.platform == "cpu":
        out["nodes"] = two_nodes(args)
    line = summary(out)
    print(phase_table(out["natural"], "placement").render())
    print(f"async/sync throughput {out['t_natural']:.2f} (generation and training as they are)")
    balanced = out.get("balanced")
    if balanced and balanced["async"]["steps_per_s"]:
        caps = balanced["caps"]
        print(f"\nbalanced: trainer host capped at {caps['trainer_cores']:.2f} cores, sampler host at "
              f"{caps['sampler_cores']:.2f} ({caps['how']}), so that a rollout takes about as long as an update")
        print(phase_table(balanced, "placement").render())
        print(f"async/sync throughput {out['t']:.2f}")
    elif balanced:
        print(f"balanced: {balanced.get('note')}")
    sync, again = out["sync"], out.get("resharded")
    print(f"\nweight sync between the loop's slices (one device each, nothing resharded): "
          f"{sync['bytes'] / 1e6:.1f} MB in {median(sync['sync_s']) * 1e3:.1f} ms, of which "
          f"{median(sync['probe_s']) * 1e3:.1f} ms a program's fixed cost (memcpy {median(sync['memcpy_s']) * 1e3:.1f} "
          f"ms, {ratio(median(sync['memcpy_s']), median(sync['sync_s'])):.2f}x)")
    if again:
        print(f"weight sync resharded (2, 2) -> (1, 4), one node: {again['bytes'] / 1e6:.1f} MB in "
              f"{median(again['sync_s']) * 1e3:.1f} ms (memcpy {median(again['memcpy_s']) * 1e3:.1f} ms)" + (
                  f"; two nodes: {out['nodes']['bytes'] / 1e6:.1f} MB in {median(out['nodes']['sync_s']) * 1e3:.1f} "
                  f"ms (raw TCP {median(out['nodes']['raw_tcp_s']) * 1e3:.1f} ms)" if out.get("nodes") else ""))
    mem = out["colocated_memory"]
    print(f"colocated island between steps: {mem['resident_bytes'] / 1e6:.2f} MB resident, peak "
          f"{mem['peak_bytes'] / 1e6:.2f} MB: the training state (params, Adam, reference: "
          f"{mem['state_bytes'] / 1e6:.2f} MB) and parameter copies ({mem['params_bytes'] / 1e6:.2f} MB each: the "
          f"sampler's, versions kept); a rollout's KV cache ({mem['kv_cache_bytes'] / 1e6:.2f} MB) lives only inside "
          "the generate computation")
    write_json(args.out, {"args": vars(args), **out})
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
