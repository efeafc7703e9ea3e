"""The Flax NNX example: ported in a few lines, the same losses through pathways as with jax.jit."""

from __future__ import annotations

import numpy as np

from examples.flax_port import changed_lines, jax_train, pw_train


def test_port_changes_fewer_than_ten_lines():
    changed, diff = changed_lines()
    assert 0 < changed < 10, "\n".join(diff)


def test_ported_loop_gives_the_losses_of_the_jax_loop(cluster):
    steps = 8
    plain = jax_train.train(steps, hidden=16)
    ported = pw_train.train(steps, hidden=16)
    assert plain[-1] < plain[0]  # it trains
    np.testing.assert_allclose(ported, plain, rtol=1e-5)
