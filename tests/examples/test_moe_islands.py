"""The MoE example through the runtime (tiny config, a 2-island cluster of this module's own, which runs beside the
session cluster's tests): experts split over two islands give the one-island run's losses and parameters, a new
placement (an expert moved, another replicated) changes nothing in the loss, and a training run's loss falls."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import pathways as pw
from client.session import current
from examples.moe import model
from examples.moe.config import CONFIGS
from examples.moe.placement import Placement, Slot
from examples.moe.step import AXIS, CrossIslandStep, SingleIslandStep
from examples.moe.train import TrainOptions, train
from examples.palm import data

TINY = CONFIGS["tiny"]
BATCH, STEPS = 8, 3
UNIFORM = Placement.uniform(TINY.n_experts, 2, TINY.capacity, len(TINY.moe_layers))

pytestmark = [pytest.mark.cluster, pytest.mark.own_cluster]


@pytest.fixture(scope="module")
def runtime():
    """Two islands of 2 devices, started here and stopped after the module (in one process with the session's
    cluster, under ``-n 0``, that cluster: ``pw.init`` returns the session there is)."""
    try:
        session, started = current(), False
    except pw.PathwaysError:
        session, started = pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=2)), True
    yield session
    if started:
        pw.shutdown()


@pytest.fixture(scope="module")
def slices(runtime):
    wide = pw.slice((2,), (AXIS,), island=0)
    singles = [pw.slice((1,), (AXIS,), island=i) for i in range(2)]
    yield wide, singles
    for s in (wide, *singles):
        s.release()


@pytest.fixture(scope="module")
def params() -> dict:
    return jax.jit(model.init_params, static_argnums=0)(TINY, jax.random.key(0))


def _steps(step, state, first: int, last: int) -> tuple:
    losses, kept = [], []
    for i in range(first, last):
        state, out = step(state, data.batch(i, 0, BATCH, TINY.seq_len))
        stats = step.read(out)
        stats = stats[0] if isinstance(stats, tuple) else stats
        losses.append(stats.metrics["loss"])
        kept.append(stats.kept)
    return state, losses, kept


@pytest.fixture(scope="module")
def uniform_run(slices, params) -> tuple:
    """Three steps with half of the experts on each island (GShard's placement)."""
    step = CrossIslandStep(TINY, slices[1], UNIFORM)
    state, losses, kept = _steps(step, step.put_state(params), 0, STEPS)
    return step.gather(state), losses, kept


def _assert_params_close(got: dict, want: dict) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_experts_across_islands_train_as_on_one_island(slices, params, uniform_run):
    one = SingleIslandStep(TINY, slices[0])  # experts split over one island's 2 devices, all-to-all inside
    state, losses, kept = _steps(one, one.put_state(params), 0, STEPS)
    cross_params, cross_losses, cross_kept = uniform_run
    np.testing.assert_allclose(cross_losses, losses, rtol=1e-5)
    for a, b in zip(cross_kept, kept):
        np.testing.assert_array_equal(a, b)  # the same tokens kept and dropped
    assert np.sum(kept[0]) < 2 * BATCH * TINY.seq_len * len(TINY.moe_layers)  # some were dropped
    one_params = jax.tree.map(lambda a: a.fetch(), state[0])
    _assert_params_close(cross_params, one_params)
    moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(one_params["experts"]), jax.tree.leaves(params["experts"]))]
    assert min(moved) > 0  # the experts trained


def test_moving_and_replicating_experts_changes_nothing_in_the_loss(slices, params, uniform_run):
    """Expert 0 and 2 swap islands and expert 1 gets a second copy, each copy with the uniform capacity, so
    every group sees the same capacities: the same tokens are kept and the loss and parameters stay the same."""
    cap = TINY.capacity
    layout = ((Slot(1, cap), Slot(2, cap)), (Slot(0, cap), Slot(1, cap), Slot(3, cap)))
    placed = Placement((layout,) * len(TINY.moe_layers), TINY.n_experts)
    step = CrossIslandStep(TINY, slices[1], UNIFORM)
    state, losses, _ = _steps(step, step.put_state(params), 0, 1)
    state = step.place(state, placed)
    assert step.placement == placed
    state, later, _ = _steps(step, state, 1, STEPS)
    want_params, want_losses, _ = uniform_run
    np.testing.assert_allclose(losses + later, want_losses, rtol=1e-5)
    _assert_params_close(step.gather(state), want_params)
    copies = [jax.tree.map(lambda a: a.fetch(), state[j].slots[0][s]) for j, s in placed.replicated(0, 1)]
    for a, b in zip(jax.tree.leaves(copies[0]), jax.tree.leaves(copies[1])):
        np.testing.assert_array_equal(a, b)  # the two copies of expert 1 stay bitwise identical


def test_training_loss_falls_with_a_plot(runtime, uniform_run, tmp_path):
    result = train(TrainOptions(config="tiny", islands=2, steps=16, batch=BATCH, out=str(tmp_path),
                                progress=False))
    assert np.mean(result.losses[-4:]) < np.mean(result.losses[:4]) - 0.3
    assert os.path.exists(tmp_path / "log.jsonl")
    if result.plot is not None:
        assert os.path.getsize(result.plot) > 0
