"""The cross-island step as one program: every island's segments, the experts in between, the backward pass
along the same routes, the gradient sums and the updates.

Each island holds a copy of the shared (non-expert) parameters and a share of the global batch; each MoE layer's
experts sit in slots as a ``Placement`` says. Island i runs segment m on its tokens and sends each island j the
tokens for j's slots ([groups, capacity positions, D], static shapes); j runs its experts on its own tokens
first, then on each other island's as they arrive, and sends the outputs back; segment m+1 combines them. The
backward pass sends the cotangents along the same routes. Every island then adds all islands' shared gradients
in island order (so every island computes the same bits), every copy of an expert the gradients of all its
copies from all islands' tokens in one fixed order, and applies Adam.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

import pathways as pw
from examples.moe import model
from examples.moe.config import MoeConfig
from examples.moe.placement import Placement
from examples.moe.stages import Staged, experts_fn, segment_fn
from examples.palm.step import pack, unpack


def optimizer(config: MoeConfig) -> optax.GradientTransformation:
    """Adam: elementwise, so an expert's update is the same wherever its weights and moments live."""
    return optax.adam(config.learning_rate)


def stats_vector(metrics: jax.Array, demand: jax.Array, kept: jax.Array) -> jax.Array:
    """One small vector per step: the metrics, then demand [M, E] and kept [M, E] (fetched in one round trip)."""
    return jnp.concatenate([metrics.astype(jnp.float32), demand.ravel().astype(jnp.float32),
                            kept.ravel().astype(jnp.float32)])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["shared", "shared_opt", "slots", "slot_opts"],
                   meta_fields=[])
@dataclass
class IslandState:
    """What one island holds: the shared parameters and their Adam state, and per MoE layer its expert slots'
    weights and Adam states (pw.Array pytrees)."""

    shared: Any
    shared_opt: Any
    slots: list[list[Any]]
    slot_opts: list[list[Any]]


def run(fns: Functions, states: list[IslandState], batch: list[dict], ones: list) -> tuple[list, list]:
    """One training step over every island: (new states, each island's stats vector). ``batch[i]`` is island
    i's ``{"inputs", "targets"}``; ``ones[i]`` a float32 1.0 on island i (the loss's cotangent). Traced by
    ``pw.program`` with ``functions(...)``, or run eagerly with ``functions(..., local=True)``."""
    placement = fns.placement
    islands, n_moe = range(placement.islands), len(placement.layers)
    seg_res: list[list] = [[None] * (n_moe + 1) for _ in islands]
    exp_res: dict[tuple[int, int, int], Any] = {}  # (m, island, source) -> residuals
    demand, kept, metrics = [[] for _ in islands], [[] for _ in islands], [None for _ in islands]
    carry = []
    for i in islands:
        out, aux, seg_res[i][0] = fns.segments[0][i].forward((states[i].shared,), batch[i]["inputs"])
        carry.append(out)
        demand[i].append(aux[0])
        kept[i].append(aux[1])
    for m in range(n_moe):  # forward: dispatch, experts (each island's own tokens first), combine
        results = {}
        for j in islands:
            for i in fns.sources[m][j]:
                weights = [states[j].slots[m][s] for s in fns.used[m][i][j]]
                sent = carry[i][3][fns.dests[m][i].index(j)]
                results[j, i], _, exp_res[m, j, i] = fns.experts[m][j, i].forward((weights, sent), ())
        for i in islands:
            outs = [results[j, i] for j in fns.dests[m][i]]
            x, aux_sum, combine, _ = carry[i]
            last = m + 1 == n_moe
            out, aux, seg_res[i][m + 1] = fns.segments[m + 1][i].forward(
                (states[i].shared, x, aux_sum, combine, outs), batch[i]["targets"] if last else ())
            carry[i] = out
            if last:
                metrics[i] = aux
            else:
                demand[i].append(aux[0])
                kept[i].append(aux[1])
    grads: list[list] = [[] for _ in islands]
    slot_grads: dict[tuple[int, int, int], list] = {}  # (m, island, source) -> grads of the used slots
    cot = []
    for i in islands:  # backward, from the loss
        g = fns.segments[n_moe][i].backward(seg_res[i][n_moe], (ones[i],))
        grads[i].append(g[0])
        cot.append(g[1:])
    for m in reversed(range(n_moe)):
        back = {}
        for j in islands:
            for i in fns.sources[m][j]:
                ct = cot[i][3][fns.dests[m][i].index(j)]
                slot_grads[m, j, i], back[j, i] = fns.experts[m][j, i].backward(exp_res[m, j, i], ct)
        for i in islands:
            g_pieces = [back[j, i] for j in fns.dests[m][i]]
            gx, g_aux, g_combine, _ = cot[i]
            g = fns.segments[m][i].backward(seg_res[i][m], (gx, g_aux, g_combine, g_pieces))
            grads[i].append(g[0])
            cot[i] = g[1:]
    packed = [fns.sum_shared(grads[i]) for i in islands]
    new_states, vectors = [], []
    for j in islands:
        # Each slot's gradient: every copy of its expert, from every source island's tokens, in a fixed order.
        copies = [[[slot_grads[m, q, i][fns.used[m][i][q].index(s)]
                    for q, s in placement.replicated(m, slot.expert) for i in fns.sources[m][q]
                    if s in fns.used[m][i][q]]
                   for slot in placement.layers[m][j]] for m in range(n_moe)]
        st = states[j]
        shared, shared_opt, slots, slot_opts = fns.apply[j](st.shared, st.shared_opt, st.slots, st.slot_opts,
                                                            packed, copies)
        new_states.append(IslandState(shared, shared_opt, slots, slot_opts))
        vectors.append(fns.stats(metrics[j], demand[j], kept[j]))
    return new_states, vectors


@dataclass(frozen=True)
class Functions:
    """A placement's computations: segments[m][i], experts[m][island, source], per-island apply; and the routes."""

    placement: Placement
    segments: list[list[Staged]]
    experts: list[dict[tuple[int, int], Staged]]  # experts[m][island, source]
    dests: list[list[list[int]]]  # dests[m][i]: islands island i sends tokens to in MoE layer m
    sources: list[list[list[int]]]  # sources[m][j]: islands whose tokens island j's experts take, its own first
    used: list[list[list[list[int]]]]  # used[m][i][j]: island j's slots that island i's groups use
    sum_shared: Callable  # pw.jit functions, or jax.jit ones when local
    apply: list[Callable]
    stats: Callable


@functools.lru_cache(maxsize=16)
def functions(config: MoeConfig, placement: Placement, local: bool = False) -> Functions:
    """Every computation of a placement's step, built once: ``pw.jit`` functions (each runs on the island of
    its first argument), or with ``local`` the same functions under ``jax.jit`` in this process."""
    islands, n_moe = placement.islands, len(config.moe_layers)
    fraction = 1.0 / islands
    segments, experts, dests, sources, used = [], [], [], [], []
    for m in range(n_moe + 1):
        fns = [segment_fn(config, placement, m, i, fraction) for i in range(islands)]
        segments.append([Staged(fn, f"moe_segment{m}_island{i}", local) for i, fn in enumerate(fns)])
        if m < n_moe:
            dests.append([fn.dests for fn in fns])
            used.append([[placement.used_slots(m, i, j) for j in range(islands)] for i in range(islands)])
            sources.append([[j] * bool(used[m][j][j]) + [i for i in range(islands) if i != j and used[m][i][j]]
                            for j in range(islands)])
            experts.append({(j, i): Staged(experts_fn(placement, m, j, i), f"moe_experts{m}_island{j}_from{i}",
                                          local)
                            for j in range(islands) for i in sources[m][j]})
    shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
    opt = optimizer(config)

    def sum_shared(pieces: list) -> jax.Array:
        return pack(functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), pieces))

    def apply(shared: Any, shared_opt: Any, slots: list, slot_opts: list, packed: list, copies: list) -> tuple:
        grads = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b),
                                 [unpack(flat, shapes["shared"]) for flat in packed])
        updates, shared_opt = opt.update(grads, shared_opt, shared)
        shared = optax.apply_updates(shared, updates)
        new_slots, new_opts = [], []
        for layer, layer_opts, layer_copies in zip(slots, slot_opts, copies):
            ws, os_ = [], []
            for w, o, grads_of_copies in zip(layer, layer_opts, layer_copies):
                g = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), grads_of_copies)
                updates, o = opt.update(g, o, w)
                ws.append(optax.apply_updates(w, updates))
                os_.append(o)
            new_slots.append(ws)
            new_opts.append(os_)
        return shared, shared_opt, new_slots, new_opts

    def stats(metrics: jax.Array, demand: list, kept: list) -> jax.Array:
        return stats_vector(metrics, jnp.stack(demand), jnp.stack(kept))

    jit = (lambda fn, name: jax.jit(fn)) if local else (lambda fn, name: pw.jit(fn, name=name))
    return Functions(placement, segments, experts, dests, sources, used, jit(sum_shared, "moe_sum_shared"),
                     [jit(apply, f"moe_apply_island{j}") for j in range(islands)], jit(stats, "moe_stats"))
