"""The programs of an elastic run (client/elastic_programs.py), on two pods of the session's cluster: a share
is its rows of the global batch on the pod that computes it, the step updates every pod with every share's
gradients in share order, the rejoin copy moves a state with matching fingerprints, and the warm-up runs what a
returning pod will run."""

from __future__ import annotations

import re

import numpy as np
import pytest

import pathways as pw
from client.elastic import plan
from client.elastic_programs import StepPrograms
from client.slices import VirtualSlice

_row_sums = pw.jit(lambda x: (x.sum(axis=0), x.sum()), name="row_sums")
_step = pw.jit(lambda w, total, lr: (w - lr * total, w.sum()), static_argnums=(2,), name="sgd")
_add = pw.jit(lambda a, b: a + b, name="add")


def _grads(state, batch):
    total, loss = _row_sums(batch["x"])
    return {"w": total}, loss


def _update(state, grads, lr_scale):
    total = grads[0]["w"]
    for g in grads[1:]:
        total = _add(total, g["w"])
    w, aux = _step(state["w"], total, lr_scale)
    return {"w": w}, aux


def _pod(island: int) -> VirtualSlice:
    return VirtualSlice(None, {"key": f"p{island}", "shape": [1], "axes": ["data"], "island": island,
                               "devices": [[0, 0]], "tenant": "t"})


@pytest.mark.parametrize("batch, got", [
    ({"x": np.zeros((3, 2))}, "['3']"),  # not divisible by the 2 pods
    ({"x": np.zeros((4, 2)), "y": np.zeros(6)}, "['4', '6']"),  # leaves disagree
    ({"x": np.zeros((4, 2)), "scale": np.float32(1)}, "['4', 'None']"),  # a scalar has no rows
])
def test_a_batch_that_does_not_split_into_one_share_per_pod_is_refused(batch, got):
    programs = StepPrograms([_pod(0), _pod(1)], _grads, _update, None, "check")
    programs.check_batch({"x": np.zeros((4, 2)), "y": np.zeros(4)})  # two rows per pod
    with pytest.raises(pw.ProgramError, match=r"divisible by the 2 pods; got leading dimensions " + re.escape(got)):
        programs.check_batch(batch)


def test_the_step_copy_and_warm_up_programs(cluster):
    slices = [pw.slice((1,), ("data",), island=k) for k in (0, 1)]
    try:
        programs = StepPrograms(slices, _grads, _update, None, "pods_step")
        state = {"w": np.arange(3, dtype=np.float32)}
        spec_tree = programs.start(state, None)
        states = [pw.put(state, s, spec_tree) for s in slices]
        batch = {"x": np.arange(12, dtype=np.float32).reshape(4, 3)}
        share = programs.share(batch, 1, 0)  # share 1's rows, computed on pod 0
        np.testing.assert_array_equal(share["x"].fetch(timeout=30), batch["x"][2:])
        step_plan = plan([0, 1], 2)
        shares = [programs.share(batch, s, p) for s, p in step_plan.shares]
        new, metrics, aux, ready = programs.step(states, shares, step_plan, None)
        want = state["w"] - batch["x"].sum(axis=0)
        for pod in (0, 1):
            np.testing.assert_array_equal(new[pod]["w"].fetch(timeout=30), want)
            assert ready[pod].fetch(timeout=30).dtype == np.uint32
        assert [float(m.fetch(timeout=30)) for m in metrics] == [batch["x"][:2].sum(), batch["x"][2:].sum()]
        moved, want_fp, got_fp = programs.copy(new[0], 1)
        np.testing.assert_array_equal(moved["w"].fetch(timeout=30), want)
        np.testing.assert_array_equal(want_fp.fetch(timeout=30), got_fp.fetch(timeout=30))
        probe, fp_moved, fp_source = programs.warm_up(new[0], programs.share(batch, 1, 1), 1, 2, 1.0)
        np.testing.assert_array_equal(fp_moved.fetch(timeout=30), fp_source.fetch(timeout=30))
        assert probe.fetch(timeout=30).dtype == np.uint32
    finally:
        for s in slices:
            s.release()
