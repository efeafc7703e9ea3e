"""PaLM's two-pod step with ZeRO stages 1-3 (tiny config, the session's 2-island cluster): the same losses and
parameters as the replicated step, one set of bits on every pod, the bytes each stage sends, and a run whose pod
fails stops and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import host_stats, lower_graph
from suite_paths import ROOT, script

from examples.palm import data, optim
from examples.palm.config import CONFIGS
from examples.palm.step import TrainStep
from examples.palm.train import fetch_tree, parse_args
from examples.palm.zero_step import ZeroTrainStep

TINY = CONFIGS["tiny"]
OPT = optim.OptimConfig()
BATCH = 8
STEPS = 2


def _bytes_out(session) -> int:
    return sum(host_stats(session, i)["bytes_out"] for i in (0, 1))


def _run(session, step: TrainStep, palm_host_state: tuple) -> tuple:
    """STEPS steps: (state, losses, bytes sent by both pods during the last step)."""
    state, losses = step.put_state(*palm_host_state), []
    for i in range(STEPS):
        before = _bytes_out(session)
        state, metrics, norms = step(state, data.batch(i, 0, BATCH, TINY.seq_len))
        losses.append([m.fetch()[0] for m in metrics])
        for x in jax.tree.leaves((state.params, norms)):  # every send of the step has landed
            x.block_until_ready()
        sent = _bytes_out(session) - before
    return state, np.array(losses), sent


def _bits(leaves) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in leaves]


def test_every_stage_trains_as_the_replicated_step_with_one_set_of_bits(cluster, palm_pods, palm_host_state):
    replicated = TrainStep(TINY, OPT, palm_pods)
    ref, ref_losses, ref_sent = _run(cluster, replicated, palm_host_state)
    ref_params, ref_opt = (jax.tree.leaves(t) for t in fetch_tree(replicated.full_state(ref)))
    param_bytes = sum(x.nbytes for x in ref_params)
    assert ref_sent >= 2 * param_bytes  # stage 0: each pod sends all its gradients
    sent = {}
    for stage in (1, 2, 3):
        step = ZeroTrainStep(TINY, OPT, palm_pods, stage)
        state, losses, sent[stage] = _run(cluster, step, palm_host_state)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=f"stage {stage}")
        params, opt_state = (jax.tree.leaves(t) for t in fetch_tree(step.full_state(state)))
        for got, want in zip(params + opt_state, ref_params + ref_opt):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"stage {stage}")
        assert _bits(params) != _bits(jax.tree.leaves(palm_host_state[0]))  # it did train
        owned = [step.layout.part.owned(p) for p in range(2)]
        assert all(len(jax.tree.leaves(s)) < len(jax.tree.leaves(ref_opt)) for s in state.opt_state)
        if stage < 3:  # both pods hold every parameter: the bits each owner computed
            pods = [jax.tree.leaves(fetch_tree(p)) for p in state.params]
            assert _bits(pods[0]) == _bits(pods[1]) == _bits(params)
        else:  # each pod holds its own leaves only
            assert [len(p) for p in state.params] == [len(o) for o in owned]
            assert [p[0].slice.island for p in state.params] == [0, 1]
    # what crossed the network in one step: stage 1 adds the updated shares to the whole exchange; stage 2 sends
    # half the gradients and the shares; stage 3 half the gradients and each share about twice (forward, backward)
    assert 1.3 * ref_sent < sent[1] < 1.7 * ref_sent, (sent, ref_sent)
    assert 0.85 * ref_sent < sent[2] < 1.15 * ref_sent, (sent, ref_sent)
    assert 1.1 * ref_sent < sent[3] < 1.7 * ref_sent, (sent, ref_sent)


def test_stage3_sends_each_group_one_group_ahead_of_where_it_is_read(palm_pods, palm_host_state):
    step = ZeroTrainStep(TINY, OPT, palm_pods, 3)
    state = step.put_state(*palm_host_state)
    graph = step.program.graph(state.params, state.opt_state, step.put_batch(data.batch(0, 0, BATCH, TINY.seq_len)))
    for fragment in lower_graph(graph).fragments.values():  # both pods alike
        ops = [(op.KIND, getattr(op, "name", "")) for op in fragment.ops]
        f0, f1, b1, b0 = [i for i, (_, name) in enumerate(ops) if name.startswith(("stage_forward", "stage_backward"))]
        sends = [i for i, (kind, _) in enumerate(ops) if kind == "send"]
        recvs = [i for i, (kind, _) in enumerate(ops) if kind == "recv"]
        assert any(i < f0 for i in sends) and any(f0 < i < f1 for i in recvs)  # group 1 travels under group 0
        assert any(f1 < i < b1 for i in sends) and any(b1 < i < b0 for i in recvs)  # group 0, again, under 1's
        assert not any(f1 < i < b1 for i in recvs)  # the last group's gathered copy is kept for its backward


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_zero_run_whose_pod_is_killed_stops_naming_its_checkpoint_and_resumes_from_it(tmp_path):
    """A pod's host killed mid-run (its share goes with it): the run stops in bounded time with ShareLostError naming
    the last checkpoint and --resume, and logs it; after the island restarts, the resumed run ends with the bits of
    a run that never failed. In a cluster of its own (tests/support/zero_failure_scenario.py)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, script("zero_failure_scenario.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=540, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    r = json.loads(lines[-1])
    checkpoint = str(tmp_path / "failed" / "checkpoints" / "ckpt_00000002.npz")
    assert "share" in r["stop"] and "ckpt_00000002.npz" in r["stop"] and "--resume" in r["stop"], r["stop"]
    assert r["stop_s"] < 120 and r["logged"] == [checkpoint], r
    assert r["resumed_steps"] == 3 and r["resumed_losses"] == r["straight_losses"][2:], r
    assert r["same_bits"]


def test_zero_refuses_what_it_cannot_keep(capsys):
    assert parse_args(["--zero", "2"]).zero == 2
    for argv, said in ((["--zero", "1", "--elastic"], "takes its share with it"),
                       (["--zero", "3", "--pods", "1"], "needs --pods 2"),
                       (["--zero", "2", "--no-overlap"], "leave out one of them"),
                       (["--zero", "4"], "invalid choice")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match="1, 2 or 3"):
        ZeroTrainStep(TINY, OPT, [], 0)
