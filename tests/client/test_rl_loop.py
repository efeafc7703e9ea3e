"""``pw.rl``: the placements as one argument, their errors, and the loop on the session's cluster with a tiny policy
(tests/support/rl_policy.py): every placement trains, each rollout records the weight version it was generated
with, and the weight sync is bitwise the trainer's parameters resharded onto the sampler."""

from __future__ import annotations

import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import rl_policy as policy
from conftest import await_line, tenant_env
from jax.sharding import PartitionSpec as P
from suite_paths import script

import pathways as pw
from client.rl.placement import Mesh, Placement

STEPS = 12


def island_times(admin: pw.Admin, island: int) -> dict[str, float]:
    """Island time charged to each tenant so far (the scheduler's own accounts)."""
    return next(s for s in admin.schedules() if s["island"] == island)["tenant_time_s"]


def test_a_placement_is_one_argument_by_name_or_constructor():
    assert pw.rl.placement("async", 2) == pw.rl.asynchronous(k=2) == Placement("async", 2, 1, 0)
    assert pw.rl.placement("asynchronous") == pw.rl.asynchronous(1)
    assert pw.rl.placement("colocated") == pw.rl.colocated() == Placement("colocated", 0, 0, 0)
    assert pw.rl.placement("Disaggregated", islands=(0, 1)) == pw.rl.disaggregated(sampler=0, trainer=1)
    # step n trains on rollouts generated with the weights after version(n) updates: at most k behind
    assert [pw.rl.asynchronous(2).version(n) for n in range(5)] == [0, 0, 0, 1, 2]
    assert [pw.rl.disaggregated().version(n) for n in range(3)] == [0, 1, 2]
    assert str(pw.rl.asynchronous(1)) == "async (k=1), sampler island 1, trainer island 0"


@pytest.mark.parametrize("make, said", [
    (lambda: pw.rl.asynchronous(k=-1), "at least 1"),
    (lambda: pw.rl.asynchronous(k=0), "pw.rl.disaggregated()"),
    (lambda: pw.rl.placement("async", staleness=-2), "at least 1"),
    (lambda: pw.rl.placement("sideways"), "choose one of colocated, disaggregated, async"),
    (lambda: pw.rl.placement(3), "pw.rl.colocated()"),
    (lambda: Placement("colocated", 0, 0, 1), "on one island"),
    (lambda: Placement("disaggregated", 0, 1, 1), "islands of their own"),
    (lambda: Placement("disaggregated", 2, 1, 0), "pw.rl.asynchronous(k=2)"),
    (lambda: pw.rl.disaggregated(sampler=-1), "at least 0"),
    (lambda: Mesh.of(((2,), ("a", "b")), "sampler"), "one positive size per axis name"),
    (lambda: Mesh.of("two", "trainer"), "the trainer's mesh must be (shape, axis names)"),
])
def test_bad_placements_are_refused_saying_what_to_do(make, said):
    with pytest.raises(ValueError) as info:
        make()
    assert said in str(info.value)


def _run(placement, steps: int = STEPS) -> tuple[list[dict], list[int], np.ndarray, pw.rl.Loop]:
    loop = pw.rl.Loop(placement, **policy.loop_args())
    params, opt_state = policy.init()
    loop.start(params, opt_state, key=jax.random.key(1))
    results = [loop.step() for _ in range(steps)]
    metrics = [r.read() for r in results]
    return metrics, [r.version for r in results], np.asarray(loop.params()["logits"]), loop


def test_every_placement_trains_and_records_the_weight_version_of_its_rollouts(cluster):
    runs = {}
    for placement in (pw.rl.colocated(), pw.rl.disaggregated(), pw.rl.asynchronous(k=1)):
        metrics, versions, params, loop = _run(placement)
        with loop:
            assert (loop.sampler.island, loop.trainer.island) == (placement.sampler_island, placement.trainer_island)
            assert loop.sampler.shape == loop.trainer.shape == (2,)
        rewards = [m["reward"] for m in metrics]
        assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, (placement, rewards)  # from 1/8, rising
        assert versions == [placement.version(n) for n in range(STEPS)]
        assert [int(m["version"]) for m in metrics] == versions  # what the sampler stamped on each rollout
        runs[placement.kind] = metrics, params
    # where the sampler runs changes nothing: the same math on the same weight versions
    assert runs["colocated"][0] == runs["disaggregated"][0]
    assert np.array_equal(runs["colocated"][1], runs["disaggregated"][1])
    assert runs["async"][0][0] == runs["disaggregated"][0][0]  # both start from version 0
    assert runs["async"][0][2] != runs["disaggregated"][0][2]  # then async trains on rollouts a version older


def test_the_weight_sync_is_bitwise_the_trainers_parameters_resharded(cluster):
    metrics, _, _, loop = _run(pw.rl.asynchronous(k=2), steps=3)
    with loop:
        trained = loop.params()
        synced = loop.sync(trained)
        assert synced["logits"].slice is loop.sampler and synced["logits"].spec == P(None, "model")
        assert trained["logits"].spec == P("data", None)
        want = np.asarray(trained["logits"])
        assert np.asarray(synced["logits"]).tobytes() == want.tobytes()
        assert not np.array_equal(want, policy.init()[0]["logits"])  # it did train


def test_islands_and_meshes_that_do_not_exist_or_fit_are_refused(cluster):
    args = policy.loop_args()
    with pytest.raises(pw.ResourceError, match="island 5, which does not exist: the cluster has 2"):
        pw.rl.Loop(pw.rl.disaggregated(sampler=5), **args)
    with pytest.raises(pw.ResourceError, match=r"trainer's mesh \(8,\) needs 8 devices; island 0 has 4"):
        pw.rl.Loop(pw.rl.colocated(), **{**args, "trainer": ((8,), ("data",))})
    with pytest.raises(ValueError, match="depth must be a positive int"):
        pw.rl.Loop(pw.rl.colocated(), **args, depth=0)
    loop = pw.rl.Loop("colocated", **args)
    with loop, pytest.raises(pw.ProgramError, match="before start"):
        loop.step()


def test_an_rl_job_is_an_ordinary_tenant_and_leaves_a_neighbor_its_share(cluster):
    """The loop's slices, arrays and weight syncs are its tenant's; another tenant loading the trainer's island
    at the same weight keeps about half of its time while the loop trains."""
    admin = pw.admin()
    ramp, window = 1.0, 3.0
    neighbor = subprocess.Popen([sys.executable, script("tenant_client.py"), "load", str(ramp + window + 1.0)],
                                env=tenant_env("rl-neighbor", weight=1.0), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, _, _, loop = _run(pw.rl.asynchronous(k=1), steps=2)  # compiled before the window
    with loop:
        await_line(neighbor, "READY", timeout=120)
        start_at = time.time() + 0.2
        neighbor.stdin.write(f"{start_at}\n")
        neighbor.stdin.flush()
        mine = {s.key for s in (loop.sampler, loop.trainer)}
        assert mine <= {a["key"] for a in pw.status().allocations if a["tenant"] == cluster.tenant}
        steps, before = 0, None
        while time.time() < start_at + ramp + window:
            if before is None and time.time() > start_at + ramp:
                before = island_times(admin, loop.trainer.island)
            loop.step()
            steps += 1
        loop.finish()
        after = island_times(admin, loop.trainer.island)
    out, err = neighbor.communicate(timeout=60)
    assert neighbor.returncode == 0, err[-3000:]
    rl = after[cluster.tenant] - before.get(cluster.tenant, 0.0)
    other = after["rl-neighbor"] - before.get("rl-neighbor", 0.0)
    assert steps > 10 and rl > 0.05, (steps, rl)  # the loop trained, its island time charged to its tenant
    assert other / (rl + other) > 0.35, (rl, other)  # equal weights: the neighbor is not starved
