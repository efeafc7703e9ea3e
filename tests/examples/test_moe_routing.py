"""The MoE example's pure-JAX pieces: GShard routing and capacity against a loop over tokens, the MoE layer
and its gradients against a dense reference, expert parallelism by all-to-all against one device, and the
controller's placement policy. CPU only (4 simulated devices for the all-to-all)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.moe import model, routing
from examples.moe.config import CONFIGS, MoeConfig
from examples.moe.placement import Controller, Placement, Policy, Slot, predicted_drops, rebalance
from examples.moe.routing import Table
from examples.palm import data

TINY = CONFIGS["tiny"]
G, S, E, D, H = 3, 12, 4, 8, 16


def _logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(G, S, E)).astype(np.float32) * 2.0


def _loop_routing(logits: np.ndarray, table: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """GShard's gating one token at a time: (combine [G, S, F], demand [E], kept [E], aux)."""
    combine = np.zeros((G, S, table.width), np.float64)
    demand, kept, aux = np.zeros(E, int), np.zeros(E, int), 0.0
    for g in range(G):
        z = logits[g].astype(np.float64)
        gates = np.exp(z - z.max(-1, keepdims=True))
        gates /= gates.sum(-1, keepdims=True)
        first = gates.argmax(-1)
        masked = gates.copy()
        masked[np.arange(S), first] = -1.0
        second = masked.argmax(-1)
        aux += E * np.sum(gates.mean(0) * np.bincount(first, minlength=E) / S) / G
        filled = np.zeros(E, int)
        for choice in (first, second):  # every first choice of the group before any second choice
            for s in range(S):
                e = choice[s]
                demand[e] += 1
                if filled[e] < table.cap[e]:
                    norm = gates[s, first[s]] + gates[s, second[s]]
                    combine[g, s, table.offset[e] + filled[e]] = gates[s, e] / norm
                    kept[e] += 1
                filled[e] += 1
    return combine, demand, kept, aux


@pytest.mark.parametrize("table", [Table.uniform(E, 3), Table((5, 0, 11, 2), (6, 2, 1, 3), 12)],
                         ids=["uniform", "ragged"])
def test_routing_and_capacity_match_a_loop_over_tokens(table):
    logits = _logits()
    r = jax.jit(routing.route, static_argnums=1)(jnp.asarray(logits), table)
    want_combine, want_demand, want_kept, want_aux = _loop_routing(logits, table)
    np.testing.assert_allclose(np.asarray(r.combine), want_combine, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(r.dispatch), (want_combine > 0).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(r.demand), want_demand)
    np.testing.assert_array_equal(np.asarray(r.kept), want_kept)
    np.testing.assert_allclose(float(r.aux), want_aux, rtol=1e-5)
    assert want_kept.sum() < want_demand.sum()  # the capacities are small enough that tokens drop
    assert np.all(want_kept <= np.asarray(table.cap) * G)


def test_a_table_must_hold_every_expert():
    with pytest.raises(ValueError, match="capacity of at least 1"):
        Table((0, 4), (4, 0), 8)
    with pytest.raises(ValueError, match="do not lie"):
        Table((0, 4), (4, 5), 8)


def _experts(seed: int = 1) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"wi": jax.random.normal(k1, (E, D, H)) / np.sqrt(D), "wo": jax.random.normal(k2, (E, H, D)) / np.sqrt(H)}


def _moe(x, router, experts, table):
    """The example's MoE layer: route, dispatch onto the capacity axis, run each expert there, combine."""
    r = routing.route(jnp.einsum("gsd,de->gse", x, router), table)
    return routing.combine(model.experts_table(experts, routing.dispatch(x, r), table), r)


def _dense_moe(x, router, experts, kept1, kept2):
    """Every expert on every token, each token taking its kept choices' outputs by their normalized gates."""
    gates = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, router), axis=-1)
    first = jnp.argmax(gates, -1)
    second = jnp.argmax(gates * (1 - jax.nn.one_hot(first, E)), -1)
    every = jax.vmap(model.ffn, in_axes=(0, None))(experts, x)  # [E, G, S, D]
    pick = lambda idx: jnp.take_along_axis(every, idx[None, ..., None], axis=0)[0]  # noqa: E731
    g1 = jnp.take_along_axis(gates, first[..., None], -1)[..., 0]
    g2 = jnp.take_along_axis(gates, second[..., None], -1)[..., 0]
    return ((kept1 * g1 / (g1 + g2))[..., None] * pick(first) + (kept2 * g2 / (g1 + g2))[..., None] * pick(second))


def _kept_masks(x, router, table):
    """Which first and second choices the loop reference keeps."""
    logits = np.asarray(jnp.einsum("gsd,de->gse", x, router))
    combine, *_ = _loop_routing(logits, table)
    first = logits.argmax(-1)
    second = np.where(np.arange(E) == first[..., None], -np.inf, logits).argmax(-1)
    kept1 = np.zeros((G, S), np.float32)
    kept2 = np.zeros((G, S), np.float32)
    for g in range(G):
        for s in range(S):
            for choice, kept in ((first, kept1), (second, kept2)):
                e = choice[g, s]
                kept[g, s] = combine[g, s, table.offset[e]:table.offset[e] + table.cap[e]].any()
    return jnp.asarray(kept1), jnp.asarray(kept2)


def test_moe_layer_and_its_gradients_match_a_dense_reference():
    table = Table.uniform(E, 3)
    x = jax.random.normal(jax.random.key(2), (G, S, D))
    router = jax.random.normal(jax.random.key(3), (D, E))
    experts = _experts()
    kept1, kept2 = _kept_masks(x, router, table)
    assert 0 < float(kept2.sum()) < G * S  # some second choices are dropped
    got = jax.jit(_moe, static_argnums=3)(x, router, experts, table)
    want = jax.jit(_dense_moe)(x, router, experts, kept1, kept2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    dropped = np.asarray((kept1 + kept2) == 0)
    if dropped.any():  # a token both of whose choices were dropped gets nothing: it passes on the residual
        assert np.all(np.asarray(got)[dropped] == 0)

    cot = jax.random.normal(jax.random.key(4), (G, S, D))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(_moe(*a, table) * cot), argnums=(0, 1, 2)))
    want_grad = jax.jit(jax.grad(lambda *a: jnp.sum(_dense_moe(*a, kept1, kept2) * cot), argnums=(0, 1, 2)))
    got_g, want_g = grad(x, router, experts), want_grad(x, router, experts)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert float(jnp.max(jnp.abs(b))) > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def params() -> dict:
    return jax.jit(model.init_params, static_argnums=0)(TINY, jax.random.key(0))


def _batch(size: int = 8) -> dict:
    return {k: jnp.asarray(v) for k, v in data.batch(0, 0, size, TINY.seq_len).items()}


def test_all_to_all_expert_parallelism_matches_one_device(params):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    tables = model.uniform_tables(TINY)
    batch = _batch()

    def value_and_grad(experts):
        return jax.value_and_grad(lambda p, b: model.loss(p, b, TINY, tables, experts), has_aux=True)

    (want, metrics), want_grads = jax.jit(value_and_grad(model.experts_local(tables)))(params, batch)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = {"shared": jax.tree.map(lambda _: P(), params["shared"]),
            "experts": jax.tree.map(lambda _: P("expert"), params["experts"])}
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))
        (got, got_metrics), got_grads = jax.jit(value_and_grad(model.experts_all_to_all(TINY, "expert")))(
            placed, jax.device_put(batch, NamedSharding(mesh, P("expert"))))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_metrics["kept"]), np.asarray(metrics["kept"]))
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    expert_grad = want_grads["experts"][0]["wi"]
    assert float(jnp.max(jnp.abs(expert_grad))) > 0  # the experts are trained, not constants


def test_every_other_layer_is_a_mixture_and_the_dense_twin_has_the_same_active_flops():
    assert TINY.moe_layers == (1, 3)
    assert TINY.capacity == 10  # ceil(2 * 16 * 1.25 / 4)
    dense = TINY.dense_equivalent()
    assert dense.moe_layers == () and dense.ffn_dim == TINY.top_k * TINY.expert_dim
    assert dense.flops_per_token() == TINY.flops_per_token()
    with pytest.raises(ValueError, match="top-2"):
        MoeConfig(top_k=1)


# -- placement --------------------------------------------------------------------------------------------


def test_uniform_placement_is_gshards_layout():
    placement = Placement.uniform(8, 2, 5, 2)
    for source in (0, 1):
        assert placement.table(0, source) == Table.uniform(8, 5)
        assert placement.width(0, source, 1 - source) == 20
    assert placement.bytes_across([4, 4], 64) == 2 * 2 * 4 * (4 * 20 * 64 * 4)


def test_a_placement_must_hold_every_expert_once_per_island():
    with pytest.raises(ValueError, match=r"experts \[3\] have none"):
        Placement((((Slot(0, 2), Slot(1, 2)), (Slot(2, 2),)),), 4)
    with pytest.raises(ValueError, match="holds an expert twice"):
        Placement((((Slot(0, 2), Slot(0, 2)), (Slot(1, 2),)),), 2)


def test_a_local_copy_serves_its_island_and_only_the_others_cross():
    layout = ((Slot(0, 4), Slot(1, 2)), (Slot(0, 3), Slot(2, 2)))
    placement = Placement((layout,), 3)
    assert placement.copy_used(0, 0, 0) == (0, 0) and placement.copy_used(0, 1, 0) == (1, 0)
    assert placement.copy_used(0, 1, 1) == (0, 1)
    assert placement.table(0, 1) == Table((2, 0, 5), (3, 2, 2), 7)  # island 0's expert 1, then its own 0 and 2
    assert placement.width(0, 0, 1) == 2 and placement.width(0, 1, 0) == 2


def _skewed_demand(islands: int = 2, n_moe: int = 2) -> np.ndarray:
    """Per-group demand with expert 0 taking half of the choices (a group of 64 tokens makes 128)."""
    share = np.array([0.5] + [0.5 / 7] * 7)
    return np.broadcast_to(128 * share, (n_moe, islands, 8)).copy()


def test_the_policy_replicates_hot_experts_and_drops_and_sends_less():
    uniform = Placement.uniform(8, 2, 20, 2)
    demand, groups = _skewed_demand(), [8, 8]
    placed = rebalance(uniform, demand, groups)
    assert [j for j, _ in placed.replicated(0, 0)] == [0, 1]  # the hot expert has a copy on every island
    assert all(len(placed.replicated(0, e)) == 1 for e in range(1, 8))
    assert predicted_drops(placed, demand) < 0.05 < predicted_drops(uniform, demand)
    assert placed.bytes_across(groups, 64) < uniform.bytes_across(groups, 64) / 2
    for m in range(2):
        for j in range(2):  # no island does more expert work than under the uniform placement
            assert placed.work(m, j, groups) <= uniform.work(m, j, groups)


def test_the_controller_waits_for_a_gain():
    uniform = Placement.uniform(8, 2, 20, 2)
    controller = Controller(uniform, [8, 8], Policy())
    assert controller.decide() is None
    controller.observe([np.full((2, 8), 16.0 * 8)] * 2)  # balanced: 16 choices per group per expert
    assert controller.decide() is None
    controller.observe([_skewed_demand()[:, 0] * 8] * 2)
    controller.observe([_skewed_demand()[:, 0] * 8] * 2)
    new = controller.decide()
    assert new is not None and controller.placement == new and len(new.replicated(0, 0)) == 2


def test_a_replica_with_room_for_every_token_changes_nothing(params):
    """Routing onto a copy elsewhere gives the same layer output when nothing is dropped."""
    config = dataclasses.replace(TINY, capacity_factor=2.0)  # capacity = seq_len: no token can be dropped
    cap = config.capacity
    uniform = Placement.uniform(4, 2, cap, 2)
    replicated = Placement(tuple(((Slot(0, cap), Slot(1, cap)), (Slot(1, cap), Slot(2, cap), Slot(3, cap)))
                                 for _ in range(2)), 4)
    batch = _batch(4)
    for source in (0, 1):
        tables = [p.table(0, source) for p in (uniform, replicated)]
        losses = [model.loss(params, batch, config, [t, t], model.experts_local([t, t]))[0] for t in tables]
        np.testing.assert_allclose(float(losses[0]), float(losses[1]), rtol=1e-6)
