"""pw.elastic: the survivors redo an interrupted step bitwise, a returned pod rejoins with the same bits, a
pod dying while it receives the state or the last survivor dying are clear errors in bounded time.

The cluster tests read tests/support/elastic_scenario.py, which kills hosts of its own cluster (started when the
first of them needs it); the unit tests check the plan, the fingerprint and the arguments without Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compile_cache_env
from jax.sharding import PartitionSpec as P
from suite_paths import ROOT, SUPPORT, script

import pathways as pw
from client.fingerprint import fingerprint, probe
from client.slices import VirtualSlice
from examples.palm.train import TrainOptions, parse_args

STEPS = 8


# -- unit tier ---------------------------------------------------------------------------------------------------

def test_the_survivors_take_the_lost_pods_shares_in_order():
    plan = pw.elastic.plan
    assert plan([0, 1], 2) == pw.elastic.Plan((0, 1), ((0, 0), (1, 1)), 1.0)
    assert plan([0], 2) == pw.elastic.Plan((0,), ((0, 0), (1, 0)), 1.0)  # every share, in share order
    assert plan([1], 2).shares == ((0, 1), (1, 1))
    assert plan([0, 3], 4).shares == ((0, 0), (1, 0), (2, 3), (3, 3))  # spread over the survivors
    assert plan([2], 3).shares == ((0, 2), (1, 2), (2, 2))


def test_per_pod_batch_keeps_the_live_pods_shares_and_scales_the_learning_rate():
    plan = pw.elastic.plan([0, 2], 4, pw.elastic.POD_BATCH)
    assert plan.shares == ((0, 0), (2, 2)) and plan.lr_scale == 0.5
    assert pw.elastic.plan([0, 1], 2, pw.elastic.POD_BATCH).lr_scale == 1.0


@pytest.mark.parametrize("active, n, policy, words", [
    ([], 2, pw.elastic.GLOBAL_BATCH, "non-empty subset"),
    ([2], 2, pw.elastic.GLOBAL_BATCH, "subset of 0..1"),
    ([0], 2, "shrink", "unknown policy"),
])
def test_a_plan_for_impossible_pods_says_what_is_wrong(active, n, policy, words):
    with pytest.raises(ValueError, match=words):
        pw.elastic.plan(active, n, policy)


def _state() -> dict:
    return {"w": jnp.arange(24, dtype=jnp.float32).reshape(4, 6), "b16": jnp.linspace(0, 1, 8, dtype=jnp.bfloat16),
            "step": jnp.int32(7), "mask": jnp.array([True, False, True]), "key": jax.random.key(3),
            "empty": jnp.zeros((0, 2))}


def test_a_fingerprint_changes_with_any_changed_or_moved_word():
    state = _state()
    fp = jax.jit(fingerprint)
    base = np.asarray(fp(state))
    assert base.shape == (6,) and base.dtype == np.uint32
    np.testing.assert_array_equal(fp(jax.tree.map(lambda x: x, state)), base)  # same bits, same fingerprint
    flipped = state["w"].at[2, 3].set(jnp.nextafter(state["w"][2, 3], jnp.inf))  # one ulp
    swapped = state["w"].at[0, 0].set(state["w"][0, 1]).at[0, 1].set(state["w"][0, 0])  # two words trade places
    for w in (flipped, swapped, -state["w"]):
        changed = np.asarray(fp({**state, "w": w})) != base
        assert changed.tolist() == [False, False, False, False, False, True], changed  # only w's (sorted keys)
    assert np.asarray(fp({**state, "mask": ~state["mask"]}) != base).sum() == 1
    assert np.asarray(fp({**state, "key": jax.random.key(4)}) != base).sum() == 1


def test_the_probe_reads_one_word_of_every_non_empty_leaf():
    out = np.asarray(jax.jit(probe)(_state()))
    assert out.dtype == np.uint32 and out.shape == (5,)  # the empty leaf has no word


def _slice(island: int, shape=(2, 2), axes=("data", "model")) -> VirtualSlice:
    return VirtualSlice(None, {"key": f"s{island}", "shape": list(shape), "axes": list(axes), "island": island,
                               "devices": [[0, d] for d in range(int(np.prod(shape)))], "tenant": "t"})


def _grads(state, batch):
    return state, batch


def _update(state, grads, lr_scale):
    return state, None


@pytest.mark.parametrize("slices, kwargs, words", [
    ([], {}, "one pw.VirtualSlice per pod"),
    ([_slice(0), _slice(0)], {}, "its own island"),
    ([_slice(0), _slice(1, (4,), ("data",))], {}, "same shape and axis names"),
    ([_slice(0), _slice(1)], {"policy": "shrink"}, "unknown policy"),
    ([_slice(0), _slice(1)], {"grads": None}, "must be functions"),
])
def test_bad_data_parallel_arguments_say_what_is_wrong(slices, kwargs, words):
    args = {"grads": _grads, "update": _update, **kwargs}
    with pytest.raises(pw.ProgramError, match=words):
        pw.elastic.DataParallel(slices, args.pop("grads"), args.pop("update"), batch_specs=P("data"), **args)


def test_training_before_start_says_to_start():
    dp = pw.elastic.DataParallel([_slice(0), _slice(1)], _grads, _update)
    with pytest.raises(pw.ProgramError, match=r"start\(state, specs\)"):
        dp.submit({"x": np.zeros((4, 2))})


def test_palm_elastic_options():
    assert parse_args(["--elastic"]).elastic and parse_args(["--elastic"]).elastic_policy == "global_batch"
    assert parse_args(["--elastic", "--elastic-policy", "pod_batch"]).elastic_policy == "pod_batch"
    with pytest.raises(ValueError, match="--elastic needs --pods 2"):
        TrainOptions(pods=1, batch=4, elastic=True)


# -- cluster tier: the session's cluster ------------------------------------------------------------------------

def _slow(a):
    return jax.lax.fori_loop(0, 400, lambda i, b: jnp.tanh(b @ b), a)  # about 2.5 s on 4 CPU devices here


def test_a_fetch_waiting_on_one_thread_holds_up_nothing_on_another(cluster):
    """What a pod's warm-up relies on: its thread waits for a value while the training thread goes on sending to
    and fetching from the same hosts (one connection per host, shared by the threads)."""
    s0, s1 = pw.slice((4,), ("x",), island=0), pw.slice((4,), ("x",), island=1)
    try:
        slow, quick = pw.jit(_slow, slice=s0), pw.jit(lambda a: a + 1.0, slice=s1)
        start = np.eye(512, dtype=np.float32) * 0.5
        there = [pw.put(np.full(4, k, np.float32), s0).block_until_ready(30) for k in range(5)]  # not fetched yet
        quick(pw.put(np.zeros(8, np.float32), s1)).fetch()  # compiled before the clock matters
        pending = slow(pw.put(start, s0))
        waited: dict = {}

        def warm_up() -> None:
            waited["value"] = pending.fetch()
            waited["at"] = time.monotonic()

        thread = threading.Thread(target=warm_up)
        thread.start()
        time.sleep(0.2)  # its fetch is on the wire and waits at island 0's host
        fetched, sums = [], []
        for k in range(5):
            fetched.append(there[k].fetch(timeout=30).tolist())  # over the connection the other thread waits on
            pw.put(np.zeros(4, np.float32), s0)  # sent on it too (it runs after the slow computation)
            sums.append(float(np.asarray(quick(pw.put(np.arange(8, dtype=np.float32) * k, s1))).sum()))
        trained_at = time.monotonic()
        assert thread.is_alive() and "at" not in waited  # the other thread still waits for its value
        thread.join(timeout=60)
        assert waited["at"] > trained_at
        np.testing.assert_allclose(waited["value"], jax.jit(_slow)(start), rtol=1e-5, atol=1e-6)
        assert fetched == [[float(k)] * 4 for k in range(5)]
        assert sums == [28.0 * k + 8.0 for k in range(5)]
    finally:
        s0.release()
        s1.release()


# -- cluster tier: pods killed in a cluster of the scenario's own ----------------------------------------------

class Scenario:
    """tests/support/elastic_scenario.py, started when a test first needs it; its JSON lines by case."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(SUPPORT), env.get("PYTHONPATH")) if p)
        env.update(compile_cache_env())  # the restarted pods' warm-ups compile what their first hosts did
        proc = subprocess.run([sys.executable, script("elastic_scenario.py")], env=env,
                              capture_output=True, text=True, timeout=600)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        self.cases = {line.get("case", "done"): line for line in lines}
        self.rc, self.tail = proc.returncode, proc.stderr[-4000:]

    def __getitem__(self, case: str) -> dict:
        if case not in self.cases:
            pytest.fail(f"case {case!r} did not report (exit {self.rc}):\n{self.tail}")
        return self.cases[case]


@pytest.fixture(scope="module")
def scenario():
    return Scenario()


def _kinds(events: list[dict]) -> list[tuple[str, int | None]]:
    return [(e["kind"], e["pod"]) for e in events]


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_pod_killed_mid_step_is_redone_on_the_survivor_bitwise(scenario):
    ref, run = scenario["reference"], scenario["global_batch"]
    assert run["losses"] == ref["losses"]  # every step's loss, both shares, to the bit
    assert run["pods"][:2] == [[0, 1]] * 2 and run["pods"][2] == [0]  # step 3 ran again on pod 0 alone
    assert run["attempts"][2] == 2
    lost = next(e for e in run["events"] if e["kind"] == "pod_lost")
    resumed = next(e for e in run["events"] if e["kind"] == "resumed")
    assert lost["pod"] == 1 and resumed["step"] == 2 and resumed["pods"] == [0]  # from the landed step 2
    assert run["resumed_s"] < 10, run["resumed_s"]  # from the kill to step 3 landed on the survivor


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_the_returned_pod_rejoins_with_bitwise_identical_state(scenario):
    ref, run = scenario["reference"], scenario["global_batch"]
    assert run["rejoined_all"], run["events"]
    rejoined = [e for e in run["events"] if e["kind"] == "rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["pods"] == [0, 1]
    assert run["pods"][-1] == [0, 1]  # the last steps ran on both pods again
    assert run["digests"][0] == run["digests"][1] == ref["digests"][0] == ref["digests"][1]


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_a_new_pod_dying_while_it_receives_the_state_fails_its_rejoin_only(scenario):
    run = scenario["global_batch"]
    kinds = _kinds(run["events"])
    first = kinds.index(("rejoining", 1))
    assert kinds[first + 1] == ("rejoin_failed", 1), kinds  # then it came back once more and rejoined
    assert kinds[-2:] == [("rejoining", 1), ("rejoined", 1)] and kinds.count(("returned", 1)) == 2, kinds
    failed = next(e for e in run["events"] if e["kind"] == "rejoin_failed")
    assert "failed while receiving the state from pod 0" in failed["detail"] and "nothing of it is used" in \
        failed["detail"]
    assert failed["pods"] == [0] and failed["t"] - run["rejoining_killed_at"] < 15  # bounded, and pod 0 went on
    assert run["losses"] == scenario["reference"]["losses"]  # nothing of the half-received state was used


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_per_pod_batch_trains_the_survivors_share_at_a_scaled_learning_rate(scenario):
    ref, run = scenario["reference"], scenario["pod_batch"]
    assert run["shares"] == [[0, 1], [0], [0]] and run["lr_scale"] == [1.0, 0.5, 0.5]
    assert run["losses"][:2] == [ref["losses"][0], ref["losses"][1][:1]]  # the same bits until the update changes
    assert run["losses"][2][0] != ref["losses"][2][0]  # half the batch at half the learning rate: another run


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_the_survivor_dying_too_is_a_clear_error_in_bounded_time(scenario):
    run = scenario["pod_batch"]
    assert run["survivor_died"].startswith("IslandFailedError"), run
    assert "every pod that held the training state failed" in run["survivor_died"]
    assert "restore it from a checkpoint" in run["survivor_died"]
    assert run["survivor_died_s"] < 15, run["survivor_died_s"]
    assert run["pods_after"] == []  # no restarted, empty pod took over
    assert run["submit_after"] == run["survivor_died"]  # and every later call says the same
    assert scenario.rc == 0, scenario.tail


@pytest.mark.cluster
@pytest.mark.own_cluster
def test_the_elastic_client_speaks_only_the_protocol(scenario):
    assert scenario["done"]["ray_loaded"] is False  # every case above ran where `import ray` fails
