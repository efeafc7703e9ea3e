"""Fixtures the PaLM example's cluster tests share (a plugin of tests/conftest.py): two pods and the tiny config's
initial state."""

from __future__ import annotations

import jax
import pytest

import pathways as pw
from examples.palm import model, optim
from examples.palm.config import CONFIGS


@pytest.fixture(scope="module")
def palm_pods(cluster):
    """A 2x2 (data, model) pod on each of the session cluster's two islands."""
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    yield pods
    for s in pods:
        s.release()


@pytest.fixture(scope="module")
def palm_host_state() -> tuple:
    """The tiny config's parameters and optimizer state, on the host."""
    params = jax.jit(model.init_params, static_argnums=0)(CONFIGS["tiny"], jax.random.key(0))
    return params, optim.init_opt_state(params, optim.OptimConfig())
