"""PaLM's two-pod training through the runtime (tiny config, the session's 2-island cluster): both pods stay
bitwise identical, the gradient exchange overlaps the backward pass, checkpoints resume bit-exactly."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from conftest import lower_graph

import pathways as pw
from examples.palm import checkpoint, data, logs, optim, runs
from examples.palm.checkpoint import RunFolderError
from examples.palm.config import CONFIGS
from examples.palm.spikes import SpikeDetector, SpikePolicy
from examples.palm.step import TrainStep
from examples.palm.train import TrainOptions, fetch_tree, main, parse_args, parser, train

TINY = CONFIGS["tiny"]
OPT = optim.OptimConfig()
BATCH = 8


def _run(step: TrainStep, palm_host_state: tuple, n: int) -> tuple:
    state, losses = step.put_state(*palm_host_state), []
    for i in range(n):
        state, metrics, _ = step(state, data.batch(i, 0, BATCH, TINY.seq_len))
        losses.append(np.mean([m.fetch()[0] for m in metrics]))
    return state, losses


def _leaves(tree) -> list[np.ndarray]:
    return jax.tree.leaves(fetch_tree(tree))


def _bitwise_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_two_pods_stay_bitwise_identical_and_match_one_pod(palm_pods, palm_host_state):
    two, losses2 = _run(TrainStep(TINY, OPT, palm_pods, overlap=True), palm_host_state, 4)
    pod0, pod1 = _leaves(two.params[0]), _leaves(two.params[1])
    assert _bitwise_equal(pod0, pod1)
    assert not _bitwise_equal(pod0, [np.asarray(x) for x in jax.tree.leaves(palm_host_state[0])])  # it did train
    assert _bitwise_equal(_leaves(two.opt_state[0]), _leaves(two.opt_state[1]))
    one, losses1 = _run(TrainStep(TINY, OPT, palm_pods[:1]), palm_host_state, 4)
    np.testing.assert_allclose(losses2, losses1, rtol=1e-5)
    for got, want in zip(pod0, _leaves(one.params[0])):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def _island0_ops(step: TrainStep, palm_host_state: tuple) -> list[tuple[str, str]]:
    """(op, computation name) of pod 0's fragment, in the order the host runs them."""
    state = step.put_state(*palm_host_state)
    graph = step.program.graph(state.params, state.opt_state,
                               step.put_batch(data.batch(0, 0, BATCH, TINY.seq_len)))
    return [(op.KIND, getattr(op, "name", "")) for op in lower_graph(graph).fragments[0].ops]


def test_overlap_sends_each_group_while_the_next_backward_runs(palm_pods, palm_host_state):
    n_pieces = TINY.layer_groups + 2  # one packed buffer per group, the head's, and the embedding lookup's
    for overlap in (True, False):
        ops = _island0_ops(TrainStep(TINY, OPT, palm_pods, overlap=overlap), palm_host_state)
        sends = [i for i, (op, _) in enumerate(ops) if op == "send"]
        recvs = [i for i, (op, _) in enumerate(ops) if op == "recv"]
        stages = [i for i, (op, name) in enumerate(ops) if name.startswith("stage_backward")]
        backward_done = max(i for i, (_, name) in enumerate(ops) if name == "embed_backward")
        apply = next(i for i, (_, name) in enumerate(ops) if name.startswith("apply"))
        assert len(sends) == len(recvs) == n_pieces
        assert backward_done < min(recvs) and max(recvs) < apply  # the other pod's grads are waited for last
        if overlap:  # the head's grads leave before the first group's backward, each group's before the next
            assert sends[0] < stages[0] and any(stages[0] < i < stages[1] for i in sends)
        else:  # PaLM's order: nothing leaves before the whole backward is done
            assert min(sends) > backward_done


def test_overlap_and_post_backward_exchange_give_the_same_bits(palm_pods, palm_host_state):
    a, _ = _run(TrainStep(TINY, OPT, palm_pods, overlap=True), palm_host_state, 2)
    b, _ = _run(TrainStep(TINY, OPT, palm_pods, overlap=False), palm_host_state, 2)
    assert _bitwise_equal(_leaves(a.params[1]), _leaves(b.params[1]))


def _opts(tmp_path, name: str, **kw) -> TrainOptions:
    base = dict(config="tiny", pods=2, batch=BATCH, steps=6, ckpt_every=3, eval_every=1000, eval_batches=1,
                out=str(tmp_path / name), peak_flops=1e11, progress=False, plot=False)
    return TrainOptions(**{**base, **kw})


def _ckpt_leaves(path: str) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[k] for k in sorted(z.files) if k != "__meta__"]


def test_resume_is_bit_exact(cluster, tmp_path):
    straight = train(_opts(tmp_path, "straight", steps=6))
    train(_opts(tmp_path, "split", steps=3))
    resumed = train(_opts(tmp_path, "split", steps=6, resume=True))
    assert straight.steps == resumed.steps == 6
    assert _bitwise_equal(_ckpt_leaves(straight.final_checkpoint), _ckpt_leaves(resumed.final_checkpoint))
    assert straight.losses[3:] == resumed.losses  # the same bits in, the same losses out
    events = logs.read(str(tmp_path / "split" / "log.jsonl"))
    starts = [e for e in events if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 3] and starts[1]["data_pos"] == 3
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]


def test_a_run_folder_holds_one_run(cluster, tmp_path, monkeypatch, capsys):
    first = train(_opts(tmp_path, "run", steps=3))
    folder = tmp_path / "run" / "checkpoints"
    kept = {p.name: p.read_bytes() for p in folder.iterdir()}
    newest = checkpoint.latest(str(folder))

    def no_cluster(*args, **kwargs):
        raise AssertionError("a refused run folder must not start a cluster")

    monkeypatch.setattr(pw, "init", no_cluster)
    command = ["--config", "tiny", "--batch", str(BATCH), "--out", str(tmp_path / "run"), "--no-progress"]
    refusals = {
        # the same folder, another seed and learning rate: another run, whose step 3 it must not continue
        ("--resume", "--seed", "1", "--lr", "0.02"): (
            f"--resume: {newest} (step 3) belongs to a run of another configuration: it was written with --lr 0.01, "
            "--seed 0; this run asks for --lr 0.02, --seed 1. Resume with that run's options, or start this run in "
            "another folder (--out) or over that one (--overwrite deletes its checkpoints)"),
        # a fresh run where a run is: it would mix with it
        (): (f"{folder} already holds checkpoints (steps 0 to 3) of an earlier run: pass --resume to continue it, "
             "--overwrite to delete them and start over, or --out to start this run in another folder"),
    }
    for extra, said in refusals.items():
        assert main([*command, *extra]) == 1
        assert capsys.readouterr().err == f"error: {said}\n"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == kept  # nothing touched
    with pytest.raises(RunFolderError, match="no checkpoint under"):
        train(_opts(tmp_path, "empty", resume=True))
    monkeypatch.undo()

    again = train(_opts(tmp_path, "run", steps=2, overwrite=True))  # starts over: the earlier run is gone
    assert again.steps == 2 and checkpoint.steps(str(folder)) == [0, 2]
    starts = [e for e in logs.read(str(tmp_path / "run" / "log.jsonl")) if e["event"] == "start"]
    assert len(starts) == 1 and starts[0]["resumed_from"] is None
    assert checkpoint.read_meta(again.final_checkpoint)["extra"]["run"]["id"] == starts[0]["run"]
    assert first.final_checkpoint.endswith("ckpt_00000003.npz") and not os.path.exists(first.final_checkpoint)


def test_a_folder_of_two_runs_or_of_unrecorded_checkpoints_is_not_resumed(tmp_path):
    params, opt = {"w": np.zeros(2, np.float32)}, {"m": np.zeros(2, np.float32)}
    config = TrainOptions(config="tiny").run_config
    for step, run_id in ((3, "aaa"), (6, "bbb")):
        checkpoint.save(str(tmp_path), checkpoint.Checkpoint(step, step, params, opt, {"run": {"id": run_id,
                                                                                                **config}}))
    assert runs.claim(str(tmp_path), config, resume=False, overwrite=True).deleted == (3, 6)
    for step, run_id in ((3, "aaa"), (6, "bbb")):
        checkpoint.save(str(tmp_path), checkpoint.Checkpoint(step, step, params, opt, {"run": {"id": run_id,
                                                                                                **config}}))
    with pytest.raises(RunFolderError, match="holds the checkpoints of 2 different runs"):
        runs.claim(str(tmp_path), config, resume=True, overwrite=False)
    checkpoint.save(str(tmp_path), checkpoint.Checkpoint(9, 9, params, opt, {"spike_history": []}))
    with pytest.raises(RunFolderError, match="does not record the configuration it was written with"):
        runs.claim(str(tmp_path), config, resume=True, overwrite=False)
    other = TrainOptions(config="small").run_config
    assert runs.differences(config, other) == [("--config", "tiny", "small")]  # not every shape of the model


def test_every_option_says_what_it_does(capsys):
    options = [a for a in parser()._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 20 and all(a.help and len(a.help) > 10 for a in options), \
        [a.option_strings for a in options if not a.help]
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert all(a.option_strings[0] in text for a in options)
    assert "--seed SEED seed of the initial parameters and of the data order (default: 0)" in " ".join(text.split())
    with pytest.raises(SystemExit):
        parse_args(["--resume", "--overwrite"])
    assert "pass one of them" in capsys.readouterr().err


def test_spike_rolls_back_and_skips_batches(cluster, tmp_path):
    spike = SpikePolicy(factor=1.3, window=4, rollback_steps=3, skip_batches=5)
    opts = _opts(tmp_path, "spike", steps=12, ckpt_every=2, spike=spike, inject_spike_at=9)
    result = train(opts)
    events = logs.read(opts.log_path)
    spikes = [e for e in events if e["event"] == "spike"]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert result.rollbacks == 1 and len(spikes) == 1 and len(rollbacks) == 1
    assert spikes[0]["step"] == 9 and spikes[0]["loss"] > 1.3 * spikes[0]["median"]
    back = rollbacks[0]
    assert back["to_step"] == 6 and back["skipped_batches"] == 5 and back["data_pos"] == 6 + 5
    assert back["removed"] == [8]  # the abandoned timeline's checkpoint is gone
    steps = [(e["step"], e["data_pos"]) for e in events if e["event"] == "step"]
    assert steps[:8] == [(s, s - 1) for s in range(1, 9)]
    assert steps[8:] == [(s, s + 4) for s in range(7, 13)]  # step 7 reads batch 11: batches 6-10 skipped
    assert result.steps == 12 and max(result.losses) < spikes[0]["loss"]


def test_elastic_training_is_bitwise_the_donating_run_spikes_and_rollbacks_included(cluster, tmp_path):
    spike = SpikePolicy(factor=1.3, window=4, rollback_steps=3, skip_batches=5)
    runs = {}
    for name, elastic in (("donating", False), ("elastic", True)):
        opts = _opts(tmp_path, name, steps=10, ckpt_every=2, eval_every=5, spike=spike, inject_spike_at=8,
                     elastic=elastic)
        runs[name] = (train(opts), logs.read(opts.log_path))
    (plain, plain_log), (elastic, elastic_log) = runs["donating"], runs["elastic"]
    assert elastic.rollbacks == plain.rollbacks == 1
    assert elastic.losses == plain.losses and elastic.eval_losses == plain.eval_losses
    assert _bitwise_equal(_ckpt_leaves(plain.final_checkpoint), _ckpt_leaves(elastic.final_checkpoint))
    assert [e["step"] for e in elastic_log if e["event"] == "step"] == [e["step"] for e in plain_log
                                                                        if e["event"] == "step"]
    assert elastic.pods_lost == elastic.rejoins == 0 and not [e for e in elastic_log if e["event"] == "elastic"]


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    opt = {"m": np.zeros(3, np.float32)}
    first = checkpoint.save(str(tmp_path), checkpoint.Checkpoint(5, 7, params, opt, {"note": "first"}))

    def broken(f, **arrays):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        checkpoint.save(str(tmp_path), checkpoint.Checkpoint(5, 9, params, opt, {}))
    monkeypatch.undo()
    back = checkpoint.load(first, params, opt)
    assert (back.step, back.data_pos, back.extra) == (5, 7, {"note": "first"})
    np.testing.assert_array_equal(back.params["w"], params["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000005.npz"]  # no temp file left behind
    with pytest.raises(ValueError, match="another config"):
        checkpoint.load(first, {"w": np.zeros((3, 2), np.float32)}, opt)


def test_spikes_are_losses_over_a_factor_of_the_recent_ones_and_options_are_checked():
    detector = SpikeDetector(SpikePolicy(factor=2.0, window=3))
    assert not any(detector.is_spike(x) for x in (3.0, 2.0, 2.5))
    assert detector.is_spike(5.1) and detector.is_spike(float("nan"))
    assert not detector.is_spike(4.9) and detector.state() == [2.0, 2.5, 4.9]
    opts = parse_args(["--pods", "1", "--config", "tiny", "--no-overlap", "--rollback-steps", "7"])
    assert (opts.pods, opts.overlap, opts.spike.rollback_steps) == (1, False, 7)
    assert opts.out == "runs/palm_tiny_1pod"
    with pytest.raises(ValueError, match="multiple of 4"):
        dataclasses.replace(opts, pods=2, batch=6)
