"""examples/rl/train.py: GRPO on the sorting task through ``pw.rl`` on the session's cluster; a short run with a
fixed seed raises the mean reward, logs every step with its weight version, and the options refuse bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.rl.train import TrainOptions, parse_args, train

STEPS = 40


def test_a_short_asynchronous_run_raises_the_mean_reward(cluster, tmp_path):
    result = train(TrainOptions(placement="async", steps=STEPS, seed=0, out=str(tmp_path), progress=False,
                                plot=False))
    rewards = result.rewards
    assert len(rewards) == STEPS and result.versions == [0] + list(range(STEPS - 1))
    assert np.mean(rewards[-8:]) > 2 * np.mean(rewards[:8]) and np.mean(rewards[-8:]) > 0.15, rewards
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(1, STEPS + 1)) and [e["version"] for e in log] == result.versions
    assert all({"reward", "solved", "loss", "kl"} <= set(e) for e in log)


def test_the_options_refuse_what_does_not_fit(capsys):
    assert parse_args(["--placement", "async"]).staleness == 1
    assert parse_args(["--placement", "colocated"]).staleness == 0
    for argv, said in ((["--placement", "async", "--staleness", "0"], "at least 1"),
                       (["--placement", "colocated", "--staleness", "2"], "async only"),
                       (["--placement", "sideways"], "invalid choice"),
                       (["--prompts", "3", "--group", "3", "--devices", "2"], "must divide over --devices")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err
