"""Run by test_palm_zero.py in its own process and cluster: a ZeRO run whose pod's host is killed (SIGKILL) mid-run
stops naming its checkpoint; once the island has restarted, the run resumes from that checkpoint. Prints one JSON
line: what the stop said, what the log recorded, and the resumed run's and a straight run's results."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import pathways as pw
from examples.palm import logs
from examples.palm.train import ShareLostError, TrainOptions, train
from examples.palm.zero_step import ZeroTrainStep


def options(out: str, **kw) -> TrainOptions:
    base = dict(config="tiny", pods=2, batch=8, steps=3, ckpt_every=2, eval_every=1000, eval_batches=1, out=out,
                peak_flops=1e11, progress=False, plot=False, zero=2)
    return TrainOptions(**{**base, **kw})


def leaves(path: str) -> list[list]:
    with np.load(path) as z:
        return [z[k].tobytes().hex() for k in sorted(z.files) if k != "__meta__"]


def main(folder: str) -> None:
    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=60.0, op=60.0, poll=0.5))
    straight = train(options(os.path.join(folder, "straight")))
    victim = session.host_stats(1)["pid"]
    reads = {"n": 0}
    read = ZeroTrainStep.read

    def read_after_a_kill(self, state, metrics, norms):
        reads["n"] += 1
        if reads["n"] == 3:  # step 3 is dispatched: its pod 1 dies with it in flight, as when its machine goes
            os.kill(victim, signal.SIGKILL)
        return read(self, state, metrics, norms)

    ZeroTrainStep.read = read_after_a_kill
    out = os.path.join(folder, "failed")
    result: dict = {}
    started = time.monotonic()
    try:
        train(options(out))
        result["stop"] = "no error"
    except ShareLostError as exc:
        result["stop"] = str(exc)
    result["stop_s"] = time.monotonic() - started
    ZeroTrainStep.read = read
    result["logged"] = [e.get("checkpoint") for e in logs.read(os.path.join(out, "log.jsonl"))
                        if e["event"] == "share_lost"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the resource manager restarts the island's host
        island = pw.status().islands[1]
        if island.healthy and island.epoch >= 1:
            break
        time.sleep(0.2)
    resumed = train(options(out, resume=True))
    result.update(straight_losses=straight.losses, resumed_losses=resumed.losses, resumed_steps=resumed.steps,
                  same_bits=leaves(straight.final_checkpoint) == leaves(resumed.final_checkpoint))
    print(json.dumps(result), flush=True)
    pw.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
