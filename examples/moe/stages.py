"""The cross-island step's computations: the model's segments and the experts, each as a forward and a backward.

A **staged** function is a pair of ``pw.jit`` functions built from one differentiable function ``fn``: the
forward returns ``fn``'s outputs and the residuals of its VJP (the arrays ``jax.vjp`` keeps for the backward
pass); the backward takes the residuals and the output cotangents and returns the input cotangents. So the
backward recomputes nothing, as in one ``jax.grad``, and the residuals stay on the island that made them.
None of these functions has a slice: each runs on the island of its first argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import pathways as pw
from examples.moe import model
from examples.moe.config import MoeConfig
from examples.moe.placement import Placement


class Staged:
    """``fn(diff, fixed) -> (outputs, aux)`` as a forward ``(diff, fixed) -> (outputs, aux, residuals)`` and a
    backward ``(residuals, output cotangents) -> cotangents of diff``. ``fixed`` is not differentiated."""

    def __init__(self, fn: Callable[[Any, Any], tuple[Any, Any]], name: str, local: bool = False) -> None:
        self._treedef: Any = None

        def forward(diff: Any, fixed: Any) -> tuple:
            outputs, pullback, aux = jax.vjp(lambda d: fn(d, fixed), diff, has_aux=True)
            residuals, self._treedef = jax.tree.flatten(pullback)
            return outputs, aux, residuals

        def backward(residuals: list, cotangents: Any) -> Any:
            if self._treedef is None:
                raise RuntimeError(f"{name}: the backward was traced before its forward")
            return jax.tree.unflatten(self._treedef, residuals)(cotangents)[0]

        if local:  # in this process, for tests: the same functions under jax.jit
            self.forward, self.backward = jax.jit(forward), jax.jit(backward)
        else:
            self.forward = pw.jit(forward, name=f"{name}_fwd")
            self.backward = pw.jit(backward, name=f"{name}_bwd")


def segment_fn(config: MoeConfig, placement: Placement, m: int, island: int, share: float) -> Callable:
    """Segment ``m`` on ``island``'s groups, as ``Staged`` takes it.

    diff: segment 0 ``(shared,)``; later ones ``(shared, x, aux_sum, combine, outputs by expert island)``.
    fixed: the tokens (segment 0), the targets (the last), else nothing. A segment before an MoE layer returns
    ``(x, aux_sum, combine, dispatched tokens by expert island)`` with aux ``(demand, kept)``; the last returns
    ``(share * loss,)`` with aux the island's metric vector. ``share`` is the island's fraction of the global
    batch, so the islands' losses add up to the global loss.
    """
    n_moe = len(config.moe_layers)
    dests = [j for j in range(placement.islands) if m < n_moe and placement.width(m, island, j)]

    def fn(diff: tuple, fixed: Any) -> tuple:
        shared = diff[0]
        if m == 0:
            x, aux_sum = model.embed(shared, fixed, config), jnp.float32(0.0)
        else:
            _, x, aux_sum, combine, outs = diff
            gate = model.Gate(combine, jnp.float32(0.0), None, None)
            x = model.combine_from(x, gate, jnp.concatenate(outs, axis=1))
        x = model.run_dense(shared, x, m, config)
        if m == n_moe:
            ce, accuracy = model.head(shared, x, fixed)
            value = model.total_loss(ce, aux_sum, config)
            return (share * value,), jnp.stack([value, ce, aux_sum, accuracy.astype(jnp.float32)])
        x, gate, sent = model.dispatch_into(shared, x, m, config, placement.table(m, island))
        pieces, start = [], 0
        for j in range(placement.islands):
            width = placement.width(m, island, j)
            if width:
                pieces.append(sent[:, start:start + width])
            start += width
        return (x, aux_sum + gate.aux, gate.combine, pieces), (gate.demand, gate.kept)

    fn.dests = dests  # type: ignore[attr-defined]
    return fn


def experts_fn(placement: Placement, m: int, island: int, source: int) -> Callable:
    """The expert slots of ``island`` that ``source``'s groups use in MoE layer m, on those groups' tokens, as
    ``Staged`` takes it.

    diff: ``(the used slots' weights in slot order, the tokens [G, width, D] source sent)``; returns the
    outputs in the same layout. One computation per source lets an island run its experts on its own tokens
    while the other islands' tokens are still on their way.
    """
    slots = [placement.layers[m][island][s] for s in placement.used_slots(m, source, island)]

    def fn(diff: tuple, fixed: Any) -> tuple:
        weights, received = diff
        outs, start = [], 0
        for w, slot in zip(weights, slots):
            outs.append(model.ffn(w, received[:, start:start + slot.capacity]))
            start += slot.capacity
        return jnp.concatenate(outs, axis=1), None

    return fn
