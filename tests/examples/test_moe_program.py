"""The cross-island MoE step's program run in this process (``program.functions(..., local=True)``): its staged
forward and backward, the routes between islands and the gradient sums give one ``jax.grad`` step of the
whole model, for a placement with an expert moved and another replicated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.moe import model, program
from examples.moe.config import CONFIGS
from examples.moe.placement import Placement, Slot
from examples.palm import data

TINY = CONFIGS["tiny"]
CAP = TINY.capacity
# GShard's uniform placement is checked end to end across islands (test_moe_islands.py); this one, with an expert
# moved and another replicated, exercises every route the uniform one takes and more.
PLACEMENTS = {
    "moved_and_replicated": Placement((((Slot(1, CAP), Slot(2, CAP)), (Slot(0, CAP), Slot(1, CAP), Slot(3, CAP))),)
                                      * len(TINY.moe_layers), TINY.n_experts),
}


@pytest.fixture(scope="module")
def reference() -> tuple:
    """Parameters, a batch of 8, and one jax.grad + Adam step of the whole model on one device."""
    params = jax.jit(model.init_params, static_argnums=0)(TINY, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in data.batch(0, 0, 8, TINY.seq_len).items()}
    tables = model.uniform_tables(TINY)
    opt = program.optimizer(TINY)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(  # jitted: op by op it took 13 s
        lambda p: model.loss(p, batch, TINY, tables, model.experts_local(tables)), has_aux=True))(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    return params, batch, float(loss), metrics, optax.apply_updates(params, updates)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_the_program_is_one_gradient_step_of_the_model(name, reference):
    params, batch, loss, metrics, want = reference
    placement, opt = PLACEMENTS[name], program.optimizer(TINY)
    states = []
    for j in range(2):
        slots = [[{k: params["experts"][m][k][slot.expert] for k in ("wi", "wo")} for slot in layout[j]]
                 for m, layout in enumerate(placement.layers)]
        states.append(program.IslandState(params["shared"], opt.init(params["shared"]), slots,
                                          [[opt.init(w) for w in layer] for layer in slots]))
    halves = [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    fns = program.functions(TINY, placement, local=True)
    new, vectors = program.run(fns, states, halves, [jnp.float32(1.0)] * 2)

    n = len(TINY.moe_layers) * TINY.n_experts
    island_losses = [float(v[0]) for v in vectors]
    np.testing.assert_allclose(np.mean(island_losses), loss, rtol=1e-5)
    kept = sum(np.asarray(v[4 + n:4 + 2 * n]) for v in vectors).reshape(np.shape(metrics["kept"]))
    np.testing.assert_array_equal(kept, np.asarray(metrics["kept"]))  # the same tokens kept as on one device
    for j in range(2):  # every island's shared parameters, and every copy of every expert, took the same step
        for a, b in zip(jax.tree.leaves(new[j].shared), jax.tree.leaves(want["shared"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
        for m, layout in enumerate(placement.layers):
            for s, slot in enumerate(layout[j]):
                for k in ("wi", "wo"):
                    np.testing.assert_allclose(np.asarray(new[j].slots[m][s][k]),
                                               np.asarray(want["experts"][m][k][slot.expert]), atol=1e-4)
    for a, b in zip(jax.tree.leaves(new[0].shared), jax.tree.leaves(new[1].shared)):
        np.testing.assert_array_equal(a, b)  # both islands hold the same bits
