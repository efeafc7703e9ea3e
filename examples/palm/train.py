"""Train the PaLM example on one or two pods through the runtime.

    python -m examples.palm.train --pods 2 --config small --steps 150

Each pod is an island with a (2, 2) ("data", "model") slice; the step is one
``@pw.program`` (examples/palm/step.py). The run writes, under ``--out``, a
JSONL event log, checkpoints every ``--ckpt-every`` steps (atomic, with the
optimizer state, step and data position), and a loss-curve PNG when
matplotlib is installed. ``--resume`` continues bit-exactly from the newest
checkpoint, which must be of this run's configuration; a fresh run refuses a
folder that holds another run's checkpoints unless ``--overwrite`` says to
delete them (examples/palm/runs.py). A loss spike (above ``--spike-factor`` times the running median)
rolls back to the checkpoint about ``--rollback-steps`` earlier and skips
``--skip-batches`` batches, as PaLM did; ``--inject-spike-at`` blows up the
parameters once to show it. ``--elastic`` runs the step through ``pw.elastic``:
if a pod dies, the other computes its half of the batch too (the same bits),
and the pod rejoins once its island has restarted; the log records each event.
``--zero 1|2|3`` shares the optimizer state (1), and the gradients (2) and the
parameters (3) too, over the pods instead of copying it on each
(examples/palm/zero_step.py); a pod that dies then takes its share with it, so
such a run stops and says which checkpoint to resume from.

``train()`` is the loop and takes an already-initialized session; ``main()``
starts and stops the cluster around it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import pathways as pw
from examples.palm import checkpoint, data, flops, logs, model, optim, runs
from examples.palm.checkpoint import RunFolderError
from examples.palm.config import CONFIGS, PalmConfig
from examples.palm.peak import pods_peak
from examples.palm.spikes import SpikeDetector, SpikePolicy
from examples.palm.step import METRICS, ElasticTrainStep, PodState, TrainStep
from examples.palm.zero_step import ZeroTrainStep

DEVICES_PER_POD = 4
WARMUP_STEPS = 3  # steps that include compilation; left out of the step-time median


@dataclass(frozen=True)
class TrainOptions:
    """Everything a run depends on. ``steps`` is the total number of updates, counting resumed ones."""

    config: str = "small"
    pods: int = 2
    steps: int = 150
    batch: int = 16
    seed: int = 0
    overlap: bool = True
    donate: bool = True  # each step donates the parameters and optimizer state it replaces
    elastic: bool = False  # go on when a pod fails, and take it back when its island restarts (no donation)
    elastic_policy: str = "global_batch"  # or "pod_batch": see pw.elastic
    zero: int = 0  # ZeRO stage: 0 every pod holds the whole state; 1, 2, 3 see examples/palm/zero_step.py
    optimizer: optim.OptimConfig = optim.OptimConfig()
    eval_every: int = 50
    eval_batches: int = 2
    out: str = "runs/palm"
    ckpt_every: int = 50
    resume: bool = False
    overwrite: bool = False  # a fresh run deletes the checkpoints already in its folder (else it refuses them)
    spike: SpikePolicy = SpikePolicy()
    inject_spike_at: int | None = None
    peak_flops: float | None = None  # None: measure it on the pods (CPU) or use the datasheet (GPU)
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if self.config not in CONFIGS:
            raise ValueError(f"unknown config {self.config!r}; choose from {sorted(CONFIGS)}")
        if self.pods not in (1, 2):
            raise ValueError(f"--pods must be 1 or 2, got {self.pods}")
        if self.batch < 1 or self.batch % (2 * self.pods):
            raise ValueError(f"--batch {self.batch} must be a positive multiple of {2 * self.pods} "
                             f"({self.pods} pod(s) x 2 data shards)")
        if self.elastic and self.pods < 2:
            raise ValueError("--elastic needs --pods 2: with one pod there is no survivor to go on with")
        if self.zero not in pw.zero.STAGES:
            raise ValueError(f"--zero must be one of {list(pw.zero.STAGES)}, got {self.zero}")
        if self.zero and self.pods < 2:
            raise ValueError(f"--zero {self.zero} shares the state over the pods: it needs --pods 2")
        if self.zero and self.elastic:
            raise ValueError(
                f"--zero {self.zero} keeps each pod's share of the training state on that pod alone, so a pod that "
                "dies takes its share with it and pw.elastic cannot go on without it: run --elastic with --zero 0 "
                "(every pod holds the whole state), or --zero without --elastic and, after a failure, --resume "
                "from the last checkpoint")
        if self.zero and not self.overlap:
            raise ValueError(f"--no-overlap orders the replicated step's exchange; --zero {self.zero} always sends "
                             "each group's gradients as soon as they exist: leave out one of them")
        if self.elastic_policy not in ("global_batch", "pod_batch"):
            raise ValueError(f"--elastic-policy must be global_batch or pod_batch, got {self.elastic_policy!r}")
        for name in ("steps", "eval_every", "ckpt_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: pass one of them")

    @property
    def model_config(self) -> PalmConfig:
        return CONFIGS[self.config]

    @property
    def run_config(self) -> dict:
        """What decides the computation (as JSON values): a checkpoint written with another one is another run's."""
        return json.loads(json.dumps({"config": self.config, "model": dataclasses.asdict(self.model_config),
                                      "seed": self.seed, "batch": self.batch,
                                      "optimizer": dataclasses.asdict(self.optimizer)}))

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.out, "checkpoints")

    @property
    def log_path(self) -> str:
        return os.path.join(self.out, "log.jsonl")


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # accepted train losses, in order
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    rollbacks: int = 0
    pods_lost: int = 0  # --elastic: pods that failed during the run
    rejoins: int = 0  # --elastic: pods that came back
    wall_s: float = 0.0
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_flops: float | None = None
    peak_source: str = ""
    final_checkpoint: str | None = None


@dataclass
class _InFlight:
    """A dispatched step whose results have not been read yet."""

    step: int  # updates done once this one lands
    data_pos: int  # the batch it read
    state: PodState
    metrics: list
    norms: list


def fetch_tree(tree: Any) -> Any:
    """Fetch every pw.Array of a pytree, many at once (each fetch is a round trip to an island)."""
    leaves, treedef = jax.tree.flatten(tree)
    with ThreadPoolExecutor(max_workers=8) as pool:
        return jax.tree.unflatten(treedef, list(pool.map(lambda a: a.fetch(), leaves)))


class Trainer:
    """One run: the pods' state, the data position, the spike detector, checkpoints and the log."""

    def __init__(self, opts: TrainOptions, start: runs.Start) -> None:
        self.opts = opts
        self.start = start
        self.config = opts.model_config
        self.slices = [pw.slice((2, 2), ("data", "model"), island=p) for p in range(opts.pods)]
        if opts.elastic:
            self.step_fn: TrainStep = ElasticTrainStep(self.config, opts.optimizer, self.slices, overlap=opts.overlap,
                                                       policy=opts.elastic_policy, on_event=self._elastic_event)
        elif opts.zero:
            self.step_fn = ZeroTrainStep(self.config, opts.optimizer, self.slices, opts.zero, donate=opts.donate)
        else:
            self.step_fn = TrainStep(self.config, opts.optimizer, self.slices, overlap=opts.overlap,
                                     donate=opts.donate)
        self.result = TrainResult(steps=0)
        self.detector = SpikeDetector(opts.spike)
        self.injected = False
        self.intervals: list[float] = []
        self._templates = self._fresh_host_state()
        self._last_landed = 0.0  # when the previous step's metrics arrived

    def _fresh_host_state(self) -> tuple[Any, Any]:
        params = jax.jit(model.init_params, static_argnums=0)(self.config, jax.random.key(self.opts.seed))
        return params, optim.init_opt_state(params, self.opts.optimizer)

    def close(self) -> None:
        for s in self.slices:
            s.release()

    def _say(self, message: str) -> None:
        if self.opts.progress:
            tqdm.write(message, file=sys.stdout)

    def _elastic_event(self, event: Any) -> None:
        """--elastic: a pod failed, the survivors resumed, or a pod came back; log it and say it."""
        self.result.pods_lost += event.kind == "pod_lost"
        self.result.rejoins += event.kind == "rejoined"
        self.log.write("elastic", kind=event.kind, pod=event.pod, step=event.step, pods=list(event.pods),
                       detail=event.detail)
        self._say(f"step {event.step}: {event.detail}")

    def _place(self, params: Any, opt_state: Any, step: int) -> PodState:
        """Host values on every pod as the state after ``step`` updates (the elastic runner counts from it)."""
        if isinstance(self.step_fn, ElasticTrainStep):
            return self.step_fn.put_state(params, opt_state, step)
        return self.step_fn.put_state(params, opt_state)

    # -- state on and off the pods ----------------------------------------------------------------
    def start_state(self) -> tuple[PodState, int, int, bool]:
        """(state, step, data position, resumed) from the checkpoint this run resumes, or fresh."""
        path = self.start.resume_from
        if path is None:
            params, opt_state = self._templates
            state = self._place(params, opt_state, 0)
            self.save(state, 0, 0)
            return state, 0, 0, False
        ckpt = checkpoint.load(path, *self._templates)
        self.detector = SpikeDetector(self.opts.spike, ckpt.extra.get("spike_history", []))
        return self._place(ckpt.params, ckpt.opt_state, ckpt.step), ckpt.step, ckpt.data_pos, True

    def save(self, state: PodState, step: int, data_pos: int) -> str:
        """Checkpoint the state (pod 0's copy, or every pod's share with --zero) and drop ones too old to roll
        back to."""
        params, opt_state = fetch_tree(self.step_fn.full_state(state))
        extra = {"spike_history": self.detector.state(), "run": {"id": self.start.run_id, **self.opts.run_config}}
        path = checkpoint.save(self.opts.ckpt_dir, checkpoint.Checkpoint(step, data_pos, params, opt_state, extra))
        horizon = step - self.opts.spike.rollback_steps - self.opts.ckpt_every
        removed = checkpoint.remove(self.opts.ckpt_dir, lambda s: s >= horizon)
        self.log.write("checkpoint", step=step, data_pos=data_pos, path=path, removed=removed)
        return path

    def rollback(self, spike_step: int) -> tuple[PodState, int, int]:
        """PaLM's recovery: restart from the checkpoint about M steps back, B batches further on."""
        policy = self.opts.spike
        self.result.rollbacks += 1
        if self.result.rollbacks > policy.max_rollbacks:
            raise RuntimeError(f"loss spiked {self.result.rollbacks} times; giving up after "
                               f"{policy.max_rollbacks} rollbacks (see {self.opts.log_path})")
        path = checkpoint.at_or_before(self.opts.ckpt_dir, spike_step - policy.rollback_steps)
        ckpt = checkpoint.load(path, *self._templates)
        # Later checkpoints belong to the abandoned timeline; --resume must never pick them up.
        removed = checkpoint.remove(self.opts.ckpt_dir, lambda s: s <= ckpt.step)
        self.detector = SpikeDetector(policy, ckpt.extra.get("spike_history", []))
        data_pos = ckpt.data_pos + policy.skip_batches
        self.log.write("rollback", from_step=spike_step, to_step=ckpt.step, checkpoint=path,
                       skipped_batches=policy.skip_batches, data_pos=data_pos, removed=removed)
        return self._place(ckpt.params, ckpt.opt_state, ckpt.step), ckpt.step, data_pos

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, state: PodState, step: int) -> float:
        """Mean metrics of the current params over a fixed set of held-out batches."""
        opts = self.opts
        outs = [self.step_fn.eval_metrics(state, data.batch(i, opts.seed, opts.batch, self.config.seq_len, "eval"))
                for i in range(opts.eval_batches)]
        mean = np.mean([o.fetch() for o in outs], axis=0)
        record = dict(zip(METRICS, map(float, mean)))
        self.log.write("eval", step=step, **record)
        self._say(f"step {step}: eval loss {record['loss']:.3f} (held out), accuracy {record['accuracy']:.1%}")
        self.result.eval_losses.append((step, record["loss"]))
        return record["loss"]

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        opts, config = self.opts, self.config
        started = time.perf_counter()
        self.log = logs.JsonlLog(opts.log_path, append=opts.resume)
        try:
            peak, source = (opts.peak_flops, "given") if opts.peak_flops else pods_peak(self.slices)
            self.result.peak_flops, self.result.peak_source = peak, source
            self._say(f"peak: {peak / 1e9:.1f} GFLOP/s ({source})" if peak else f"peak: unknown ({source})")
            state, step, data_pos, resumed = self.start_state()
            self.log.write("start", run=self.start.run_id, options=_jsonable(opts), n_params=config.n_params(),
                           flops_per_token=config.flops_per_token(), peak_flops=peak, peak_source=source,
                           resumed_from=step if resumed else None, data_pos=data_pos)
            bar = tqdm(total=opts.steps, initial=step, disable=not opts.progress, dynamic_ncols=True,
                       desc=f"palm {opts.config} on {opts.pods} pod(s)", file=sys.stdout)
            try:
                state, step, data_pos = self._loop(state, step, data_pos, bar)
            except pw.IslandFailedError as exc:
                if not opts.zero:
                    raise
                raise ShareLostError(self._share_lost(exc)) from exc
            finally:
                bar.close()
            self.result.steps = step
            self.result.final_checkpoint = self.save(state, step, data_pos)
            if not self.result.eval_losses or self.result.eval_losses[-1][0] != step:
                self.evaluate(state, step)
            self._summarize(time.perf_counter() - started)
        finally:
            self.log.close()
        if opts.plot:
            logs.plot_losses(opts.log_path, os.path.join(opts.out, "loss.png"))
        return self.result

    def _share_lost(self, exc: Exception) -> str:
        """What to tell the user when a pod failed under --zero: its share of the state is gone."""
        newest = checkpoint.latest(self.opts.ckpt_dir)
        self.log.write("share_lost", error=str(exc)[:500], checkpoint=newest)
        where = (f"restore the last checkpoint, {newest}, with the same command plus --resume"
                 if newest else "no checkpoint was written yet: start the run again")
        return (f"a pod failed ({exc}); with --zero {self.opts.zero} each pod held its own share of the training "
                f"state, and that share died with it, so the run cannot go on: {where} (or run with --zero 0 "
                "--elastic to survive a pod's failure)")

    def _reads_state(self, step: int) -> bool:
        """Whether the state after ``step`` updates is checkpointed or evaluated once its step lands."""
        opts = self.opts
        return (step % opts.ckpt_every == 0 and step < opts.steps) or step % opts.eval_every == 0

    def _loop(self, state: PodState, step: int, data_pos: int, bar: tqdm) -> tuple[PodState, int, int]:
        """Dispatch step n+1 before reading step n's loss, so the pods never wait for the client.

        Each step donates the state it starts from, so a state that is checkpointed or evaluated is read
        (its step finished) before the next step is dispatched.
        """
        opts = self.opts
        pending: _InFlight | None = None
        self._last_landed = time.perf_counter()
        while True:
            if pending is not None and self.step_fn.donate and self._reads_state(pending.step):
                restored, pending = self._finish(pending, bar), None
                if restored is not None:
                    state, step, data_pos = restored
                    bar.n = step
                    bar.refresh()
            current = None
            if step < opts.steps:
                batch = data.batch(data_pos, opts.seed, opts.batch, self.config.seq_len)
                spike = opts.inject_spike_at == step + 1 and not self.injected
                if spike:
                    self.injected = True
                    self.log.write("inject_spike", step=step + 1, data_pos=data_pos)
                new_state, metrics, norms = self.step_fn(state, batch, spike=spike)
                current = _InFlight(step + 1, data_pos, new_state, metrics, norms)
                state, step, data_pos = new_state, step + 1, data_pos + 1
            restored = self._finish(pending, bar) if pending is not None else None
            if restored is not None:
                current = None  # dispatched from a state that the rollback discarded
                state, step, data_pos = restored
                bar.n = step
                bar.refresh()
            pending = current
            if pending is None and step >= opts.steps:
                return state, step, data_pos

    def _finish(self, run: _InFlight, bar: tqdm) -> tuple[PodState, int, int] | None:
        """Read a landed step's metrics; log, checkpoint, evaluate. On a spike: the rolled-back state."""
        opts = self.opts
        per_pod, grad_norm = self.step_fn.read(run.state, run.metrics, run.norms)
        record = dict(zip(METRICS, map(float, per_pod.mean(axis=0))))
        now = time.perf_counter()
        interval, self._last_landed = now - self._last_landed, now
        if self.detector.is_spike(record["loss"]):
            self.log.write("spike", step=run.step, data_pos=run.data_pos, loss=record["loss"],
                           median=self.detector.median(), factor=opts.spike.factor)
            restored = self.rollback(run.step)
            self._say(f"step {run.step}: loss {record['loss']:.3f} spiked; rolled back to step "
                      f"{restored[1]} and skipped {opts.spike.skip_batches} batches")
            return restored
        self.intervals.append(interval)
        tokens_per_s = opts.batch * self.config.seq_len / interval
        mfu = flops.mfu(tokens_per_s, self.config, self.result.peak_flops) if self.result.peak_flops else None
        self.log.write("step", step=run.step, data_pos=run.data_pos, **record, grad_norm=grad_norm,
                       step_s=round(interval, 5), tokens_per_s=round(tokens_per_s, 1), mfu=mfu)
        self.result.losses.append(record["loss"])
        recent = opts.batch * self.config.seq_len / statistics.median(self.intervals[-10:])
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{recent:,.0f}"}
        if self.result.peak_flops:
            postfix["MFU"] = f"{flops.mfu(recent, self.config, self.result.peak_flops):.1%}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if run.step % opts.ckpt_every == 0 and run.step < opts.steps:
            self.save(run.state, run.step, run.data_pos + 1)
        if run.step % opts.eval_every == 0:
            self.evaluate(run.state, run.step)
        return None

    def _summarize(self, wall_s: float) -> None:
        opts, config, result = self.opts, self.config, self.result
        result.wall_s = wall_s
        timed = self.intervals[WARMUP_STEPS:] or self.intervals
        if timed:
            result.median_step_s = statistics.median(timed)
            result.tokens_per_s = opts.batch * config.seq_len / result.median_step_s
            if result.peak_flops:
                result.mfu = flops.mfu(result.tokens_per_s, config, result.peak_flops)
                result.hfu = flops.hfu(result.tokens_per_s, config, result.peak_flops, recompute=True)
        self.log.write("end", steps=result.steps, wall_s=round(wall_s, 2), median_step_s=result.median_step_s,
                       tokens_per_s=result.tokens_per_s, mfu=result.mfu, hfu=result.hfu,
                       rollbacks=result.rollbacks, pods_lost=result.pods_lost, rejoins=result.rejoins,
                       final_loss=result.losses[-1] if result.losses else None,
                       eval_loss=result.eval_losses[-1][1] if result.eval_losses else None)


class ShareLostError(RuntimeError):
    """A pod failed in a --zero run: its share of the training state is gone; the message names the checkpoint."""


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def claim_folder(opts: TrainOptions) -> runs.Start:
    """Where this run starts in ``opts.out``; RunFolderError when the folder holds another run's checkpoints."""
    start = runs.claim(opts.ckpt_dir, opts.run_config, opts.resume, opts.overwrite)
    if start.deleted and opts.progress:
        print(f"--overwrite: deleted {len(start.deleted)} checkpoint(s) of the earlier run in {opts.ckpt_dir} "
              f"(steps {start.deleted[0]} to {start.deleted[-1]})", flush=True)
    return start


def train(opts: TrainOptions, start: runs.Start | None = None) -> TrainResult:
    """Run training on the current session (pw.init must have been called), from ``start`` (default: where
    ``claim_folder`` says)."""
    trainer = Trainer(opts, start or claim_folder(opts))
    try:
        return trainer.run()
    finally:
        trainer.close()


class _Help(argparse.HelpFormatter):
    """Each option's help, with its default where it has one (not for flags or options unset by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and action.default is not False and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    """The command's options, each with its help and default."""
    d = TrainOptions()
    s = d.spike
    p = argparse.ArgumentParser(prog="python -m examples.palm.train", description=__doc__.split("\n")[0],
                                formatter_class=_Help)
    p.add_argument("--config", default=d.config, choices=sorted(CONFIGS),
                   help="model size (examples/palm/config.py): tiny for tests, small for the CPU demo, "
                        "350m and 1b for GPUs")
    p.add_argument("--pods", type=int, default=d.pods, choices=(1, 2),
                   help="pods (islands) to train on, data-parallel, with a (2, 2) data x model slice each")
    p.add_argument("--steps", type=int, default=d.steps, help="total updates, counting resumed ones")
    p.add_argument("--batch", type=int, default=d.batch, help="global batch in sequences, split over the pods")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial parameters and of the data order")
    p.add_argument("--no-overlap", action="store_true",
                   help="exchange gradients after the whole backward (as PaLM did) instead of group by group")
    p.add_argument("--no-donate", action="store_true",
                   help="keep each step's input parameters and optimizer state (two copies on every pod)")
    p.add_argument("--elastic", action="store_true",
                   help="go on when a pod fails (the survivor computes its half of the batch too) and take it back "
                        "when its island restarts; never donates")
    p.add_argument("--zero", type=int, default=d.zero, choices=pw.zero.STAGES,
                   help="ZeRO over the pods: 1 shares the optimizer state, 2 also reduce-scatters the gradients, "
                        "3 also shares the parameters (gathered group by group); 0 copies everything on each pod")
    p.add_argument("--elastic-policy", default=d.elastic_policy, choices=("global_batch", "pod_batch"),
                   help="while a pod is out: keep the global batch (bitwise the same run) or keep the per-pod "
                        "batch and scale the learning rate by the live fraction")
    p.add_argument("--lr", type=float, default=d.optimizer.peak_lr, help="peak learning rate")
    p.add_argument("--const-steps", type=int, default=d.optimizer.const_steps,
                   help="steps at the peak learning rate before the 1/sqrt(step) decay")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="evaluate on held-out batches every this many steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="held-out batches per evaluation")
    p.add_argument("--out", default=None,
                   help="run folder for the log, checkpoints and loss plot (default: runs/palm_<config>_<pods>pod)")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="write a checkpoint every this many steps")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint (refused if that checkpoint was "
                        "written with another --config, --seed, --batch or optimizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds an earlier run's checkpoints, deleting them "
                        "(without it such a folder is refused)")
    p.add_argument("--spike-factor", type=float, default=s.factor, help="spike: loss > factor x running median")
    p.add_argument("--spike-window", type=int, default=s.window, help="losses in the running median")
    p.add_argument("--rollback-steps", type=int, default=s.rollback_steps, help="M: roll back about M steps")
    p.add_argument("--skip-batches", type=int, default=s.skip_batches, help="B: then skip B batches")
    p.add_argument("--max-rollbacks", type=int, default=s.max_rollbacks,
                   help="give up (an error) after this many rollbacks instead of looping on a run that keeps spiking")
    p.add_argument("--inject-spike-at", type=int, default=None,
                   help="scale the embedding by 100 before this step (once) to see a spike and its rollback")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="the devices' peak FLOP/s for MFU (default: measured on the pods, or the GPU's datasheet)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p


def parse_args(argv: list[str] | None = None) -> TrainOptions:
    """TrainOptions from the command line."""
    d = TrainOptions()
    p = parser()
    a = p.parse_args(argv)
    try:
        return TrainOptions(
            config=a.config, pods=a.pods, steps=a.steps, batch=a.batch, seed=a.seed, overlap=not a.no_overlap,
            donate=not a.no_donate, elastic=a.elastic, elastic_policy=a.elastic_policy, zero=a.zero,
            optimizer=dataclasses.replace(d.optimizer, peak_lr=a.lr, const_steps=a.const_steps),
            eval_every=a.eval_every, eval_batches=a.eval_batches,
            out=a.out or os.path.join("runs", f"palm_{a.config}_{a.pods}pod"), ckpt_every=a.ckpt_every,
            resume=a.resume, overwrite=a.overwrite,
            spike=SpikePolicy(factor=a.spike_factor, window=a.spike_window, rollback_steps=a.rollback_steps,
                              skip_batches=a.skip_batches, max_rollbacks=a.max_rollbacks),
            inject_spike_at=a.inject_spike_at, peak_flops=a.peak_flops, progress=not a.no_progress)
    except ValueError as exc:
        p.error(str(exc))


def report(opts: TrainOptions, result: TrainResult) -> str:
    config = opts.model_config
    lines = [f"peak: {result.peak_flops / 1e9:.1f} GFLOP/s ({result.peak_source})" if result.peak_flops
             else f"peak: unknown ({result.peak_source})",
             f"model: {opts.config}, {config.n_params():,} params, {config.flops_per_token():.3g} FLOPs/token "
             f"(6N + 12LHQT); {opts.pods} pod(s), global batch {opts.batch} x {config.seq_len} tokens, "
             f"{'overlapped' if opts.overlap else 'post-backward'} gradient exchange"
             + (f", ZeRO stage {opts.zero}" if opts.zero else "")]
    if result.losses:
        lines.append(f"train loss: {result.losses[0]:.3f} (first) -> {result.losses[-1]:.3f} (last)")
    if result.eval_losses:
        lines.append("eval loss: " + ", ".join(f"{loss:.3f} @ {s}" for s, loss in result.eval_losses))
    if result.median_step_s:
        mfu = f", MFU {result.mfu:.1%}, HFU {result.hfu:.1%}" if result.mfu is not None else ""
        lines.append(f"median step {result.median_step_s * 1e3:.0f} ms, {result.tokens_per_s:,.0f} tokens/s{mfu}")
    if opts.elastic:
        lines.append(f"elastic ({opts.elastic_policy}): {result.pods_lost} pod(s) lost, {result.rejoins} rejoined")
    lines.append(f"{result.steps} steps, {result.rollbacks} rollback(s), {result.wall_s:.1f} s in train(); "
                 f"log {opts.log_path}; checkpoint {result.final_checkpoint}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.perf_counter()
    try:  # before the cluster starts: a refused folder costs nothing
        start = claim_folder(opts)
    except RunFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    pw.init(topology=pw.Topology(islands=opts.pods, hosts_per_island=1, devices_per_host=DEVICES_PER_POD))
    print(f"cluster up in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        result = train(opts, start)
    except ShareLostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        pw.shutdown()
    print(report(opts, result))
    print(f"total wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
