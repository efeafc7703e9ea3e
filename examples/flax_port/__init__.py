"""Porting a Flax NNX training loop written in the functional style (``nnx.split`` once, ``nnx.merge`` in a
jitted step) to pathways (needs ``pip install 'pathways-ray[flax]'``).

``jax_train.py`` is the loop as a Flax user writes it with plain JAX;
``pw_train.py`` is the same file moved onto a pathways slice. ``changed_lines``
counts the code lines that differ (module docstrings and blank lines aside),
and ``python -m examples.flax_port`` runs both and compares their losses.
"""

from __future__ import annotations

import os

from examples import ports

HERE = os.path.dirname(os.path.abspath(__file__))


def changed_lines() -> tuple[int, list[str]]:
    """(number of code lines of pw_train.py that are new or changed against jax_train.py, the unified diff)."""
    return ports.changed_lines(os.path.join(HERE, "jax_train.py"), os.path.join(HERE, "pw_train.py"))
