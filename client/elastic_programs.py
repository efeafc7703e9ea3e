"""The programs an elastic data-parallel run (``pw.elastic.DataParallel``) runs on its pods.

The step: every share's gradients on the pod that computes it, then every pod's update with all the
gradients moved to it, in share order, and a probe per pod that says its new state exists. The rejoin copy:
a landed state moved host to host to a pod that comes back, with both sides' fingerprints. The warm-up: what
a returning pod will run, on a copy of a landed state and one share, so that it compiles before it rejoins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from client.array import put
from client.fingerprint import fingerprint, probe
from client.host_values import broadcast_specs
from client.jit import jit
from client.program import ProgramFunction, transfer
from client.slices import VirtualSlice
from pathways.errors import ProgramError

if TYPE_CHECKING:
    from client.elastic import Plan


class StepPrograms:
    """The step, rejoin and warm-up programs over ``slices`` (one per pod), tracing the user's ``grads`` and
    ``update``; ``batch_specs`` places a share's rows on a pod. ``start`` fixes the state's layout."""

    def __init__(self, slices: Sequence[VirtualSlice], grads: Callable, update: Callable, batch_specs: Any,
                 name: str) -> None:
        self._slices = list(slices)
        self._grads, self._update, self._batch_specs = grads, update, batch_specs
        self.step = ProgramFunction(self._body, name=name)
        self.copy = ProgramFunction(self._copy, name=f"{name}_rejoin")
        self.warm_up = ProgramFunction(self._warm_up, name=f"{name}_warm_up")
        self._probe: Any = None  # per state layout (``start``): pw.jit functions that read every leaf
        self._fingerprint: Any = None

    def start(self, state: Any, specs: Any) -> Any:
        """Take the layout of ``state`` sharded by ``specs`` (a PartitionSpec prefix; None: replicated); the
        full spec tree, to place the state with."""
        spec_tree = jax.tree.unflatten(jax.tree.structure(state), broadcast_specs(specs, state,
                                                                                  "pw.elastic start: specs"))
        self._probe = jit(probe, in_specs=(spec_tree,), name="state_ready")
        self._fingerprint = jit(fingerprint, in_specs=(spec_tree,), name="state_fingerprint")
        return spec_tree

    def check_batch(self, batch: Any) -> None:
        """ProgramError unless ``batch`` splits into one share per pod: every leaf's leading dimension the same,
        and divisible by the number of pods."""
        sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
        n = len(self._slices)
        if len(sizes) != 1 or None in sizes or next(iter(sizes)) % n:
            raise ProgramError(f"pw.elastic: every leaf of the batch needs the same leading dimension, divisible "
                               f"by the {n} pods; got leading dimensions {sorted(map(str, sizes))}")

    def share(self, batch: Any, share: int, pod: int) -> Any:
        """Data share ``share`` of the global ``batch`` (its rows), placed on ``pod``."""
        rows = jax.tree.leaves(batch)[0].shape[0] // len(self._slices)
        part = jax.tree.map(lambda x: np.asarray(x)[share * rows:(share + 1) * rows], batch)
        return put(part, self._slices[pod], self._batch_specs)

    def _body(self, states: list, batches: list, plan: Plan, transform: Callable | None) -> tuple:
        by_pod = dict(zip(plan.pods, states))
        if transform is not None:
            by_pod = {p: transform(s) for p, s in by_pod.items()}
        grads, metrics = [], []
        for (_, pod), batch in zip(plan.shares, batches):
            g, m = self._grads(by_pod[pod], batch)
            grads.append(g)
            metrics.append(m)
        new, aux, ready = [], [], []
        for pod in plan.pods:
            state, extra = self._update(by_pod[pod], [transfer(g, self._slices[pod]) for g in grads],
                                        plan.lr_scale)
            new.append(state)
            aux.append(extra)
            ready.append(self._probe(state))
        return new, metrics, aux, ready

    def _copy(self, state: Any, pod: int) -> tuple:
        moved = transfer(state, self._slices[pod])
        return moved, self._fingerprint(state), self._fingerprint(moved)

    def _warm_up(self, state: Any, batch: Any, pod: int, parts: int, lr_scale: float) -> tuple:
        """What ``pod`` will run once it rejoins, on a copy of a landed state and one share, results dropped:
        the receive, ``grads``, ``update`` of ``parts`` gradients at ``lr_scale``, the probe, the fingerprint
        (and the source's fingerprint, which the rejoin compares with)."""
        moved = transfer(state, self._slices[pod])
        grads, _ = self._grads(moved, batch)
        new, _ = self._update(moved, [grads] * parts, lr_scale)
        return self._probe(new), self._fingerprint(moved), self._fingerprint(state)
