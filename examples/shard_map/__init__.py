"""Porting the "Neural networks" section of JAX's shard_map tutorial (data parallelism, FSDP with ``jax.remat``
and ``all_gather``, tensor parallelism with ``psum_scatter``, FSDP with tensor parallelism, and an SPMD pipeline
with ``ppermute``) to pathways: JAX code in today's sharding style (``jax.make_mesh``, ``jax.set_mesh``,
``jax.device_put``, ``jax.shard_map`` without ``mesh=``).

``jax_train.py`` is the tutorial's code as its authors wrote it; ``pw_train.py`` is the same file on pathways
slices. ``changed_lines`` counts the code lines that differ (module docstrings and blank lines aside), and
``python -m examples.shard_map`` runs both and compares what they computed.
"""

from __future__ import annotations

import os

from examples import ports

HERE = os.path.dirname(os.path.abspath(__file__))


def changed_lines() -> tuple[int, list[str]]:
    """(number of code lines of pw_train.py that are new or changed against jax_train.py, the unified diff)."""
    return ports.changed_lines(os.path.join(HERE, "jax_train.py"), os.path.join(HERE, "pw_train.py"))
