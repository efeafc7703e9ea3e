"""Porting Flax's NNX MNIST tutorial (a CNN with BatchNorm, Dropout, nnx.Rngs, nnx.Optimizer and metrics,
trained with nnx.jit) to pathways: needs ``pip install 'pathways-ray[flax]'``.

``jax_train.py`` is the example as its authors wrote it; ``pw_train.py`` is the same file moved onto a
pathways slice. ``changed_lines`` counts the code lines that differ (module docstrings and blank lines
aside), and ``python -m examples.nnx_mnist`` runs both and compares what they computed.
"""

from __future__ import annotations

import os

from examples import ports

HERE = os.path.dirname(os.path.abspath(__file__))


def changed_lines() -> tuple[int, list[str]]:
    """(number of code lines of pw_train.py that are new or changed against jax_train.py, the unified diff)."""
    return ports.changed_lines(os.path.join(HERE, "jax_train.py"), os.path.join(HERE, "pw_train.py"))
