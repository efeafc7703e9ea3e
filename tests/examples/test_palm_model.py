"""The PaLM example's pure-JAX pieces: model, staged gradients, data, optimizer, FLOPs.

CPU only; works with one or several (simulated) CPU devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from examples.palm import data, flops, model, optim
from examples.palm.config import CONFIGS, PalmConfig

TINY = CONFIGS["tiny"]
BATCH = 4

# Jitted once per module so tests share compilations (eager dispatch is slow on CPU).
_forward = jax.jit(model.forward, static_argnames="config")
_loss = jax.jit(model.loss_fn, static_argnames="config")
_value_and_grad = jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True), static_argnames="config")


@pytest.fixture(scope="module")
def params() -> dict:
    return jax.jit(model.init_params, static_argnums=0)(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def text_batch() -> dict:
    return {k: jnp.asarray(v) for k, v in data.batch(0, 0, BATCH, TINY.seq_len).items()}


@pytest.fixture(scope="module")
def reference(params: dict, text_batch: dict) -> tuple:
    """(loss, grads) from jax.grad of the unstaged loss."""
    (loss, _), grads = _value_and_grad(params, text_batch, TINY)
    return loss, grads


def _random_batch(config: PalmConfig, batch_size: int, seed: int = 0) -> dict:
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch_size, config.seq_len + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def test_forward_gives_logits_per_position_and_layers_share_one_kv_head(params: dict) -> None:
    tokens = jnp.zeros((3, TINY.seq_len), jnp.int32)
    logits = _forward(params, tokens, TINY)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    layer = params["layers"][0]
    assert layer["q"].shape == (TINY.d_model, TINY.n_heads, TINY.head_dim)
    assert layer["k"].shape == layer["v"].shape == (TINY.d_model, TINY.head_dim)  # one shared k/v head
    assert layer["gate"].shape == (TINY.d_model, TINY.ffn_dim)


def test_param_count_matches_init(params: dict) -> None:
    assert sum(x.size for x in jax.tree.leaves(params)) == TINY.n_params()
    for config in CONFIGS.values():
        shapes = jax.eval_shape(lambda k, c=config: model.init_params(c, k), jax.random.key(0))
        assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == config.n_params()


def test_flops_per_token_formula() -> None:
    c = CONFIGS["350m"]
    expected = 6 * c.n_params() + 12 * c.n_layers * c.n_heads * c.head_dim * c.seq_len
    assert c.flops_per_token() == expected
    assert flops.mfu(1000.0, c, 1e15) == pytest.approx(1000.0 * expected / 1e15)
    assert flops.hfu(1000.0, c, 1e15) == flops.mfu(1000.0, c, 1e15)
    assert flops.hfu(1000.0, c, 1e15, recompute=True) > flops.mfu(1000.0, c, 1e15)


def test_changing_a_token_changes_no_earlier_logits(params: dict) -> None:
    tokens = _random_batch(TINY, 3, seed=1)["inputs"]
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
    a, b = _forward(params, tokens, TINY), _forward(params, changed, TINY)
    np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[0, 10:], b[0, 10:])


def test_loss_at_init_is_near_uniform(params: dict) -> None:
    # The shared N(0, 1) embedding makes a fresh model favour repeating its input byte
    # (logit ~ sqrt(d_model) * cos), so the loss sits somewhat above ln(256), not on it.
    loss, metrics = _loss(params, _random_batch(TINY, BATCH), TINY)
    assert math.log(256) - 0.1 < float(metrics["cross_entropy"]) < math.log(256) + 1.5
    assert float(loss) == pytest.approx(float(metrics["cross_entropy"] + metrics["z_loss"]), rel=1e-6)


def test_zero_logits_give_the_closed_form_cross_entropy_and_z_loss() -> None:
    # Zero logits give log Z = ln(256) exactly, so both terms are known in closed form.
    shapes = jax.eval_shape(lambda k: model.init_params(TINY, k), jax.random.key(1))
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    batch = _random_batch(TINY, BATCH)
    loss, metrics = _loss(zero, batch, TINY)
    log_z = math.log(256)
    assert float(metrics["cross_entropy"]) == pytest.approx(log_z, rel=1e-6)
    assert float(metrics["z_loss"]) == pytest.approx(1e-4 * log_z**2, rel=1e-5)
    assert float(loss) == pytest.approx(log_z + 1e-4 * log_z**2, rel=1e-6)
    no_z = PalmConfig(**{**TINY.__dict__, "z_loss": 0.0})
    assert float(_loss(zero, batch, no_z)[0]) == pytest.approx(log_z, rel=1e-6)


def test_group_bounds_cover_layers() -> None:
    c = PalmConfig(d_model=8, n_layers=7, n_heads=2, head_dim=4, ffn_dim=8, seq_len=4, layer_groups=3)
    assert c.group_bounds() == ((0, 3), (3, 5), (5, 7))
    assert [len(g) for g in model.split_groups(list(range(7)), c)] == [3, 2, 2]
    with pytest.raises(ValueError):
        PalmConfig(d_model=8, n_layers=2, n_heads=2, head_dim=4, ffn_dim=8, seq_len=4, layer_groups=3)


@pytest.mark.parametrize("groups", [1, 2])
def test_staged_grads_equal_jax_grad(params: dict, text_batch: dict, reference: tuple, groups: int) -> None:
    config = PalmConfig(**{**TINY.__dict__, "layer_groups": groups})
    loss, expected = reference
    metrics, staged = jax.jit(model.grads_by_group, static_argnames="config")(params, text_batch, config)
    assert len(staged["groups"]) == groups
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    got = model.merge_group_grads(staged)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


def test_stages_compile_separately(params: dict, text_batch: dict, reference: tuple) -> None:
    """The stages as separately jitted functions, run the way the runtime will chain them."""
    fwd = jax.jit(model.stage_forward, static_argnames="config")
    bwd = jax.jit(model.stage_backward, static_argnames="config")
    groups = model.split_groups(params["layers"], TINY)
    xs = [jax.jit(model.embed_forward, static_argnames="config")(params["embed"], text_batch["inputs"], TINY)]
    for group in groups:
        xs.append(fwd(group, xs[-1], TINY))
    _, head_grads, cot = jax.jit(model.head_forward_backward, static_argnames="config")(
        model.head_params(params), xs.pop(), text_batch["targets"], TINY)
    grads = []
    for group, x in zip(reversed(groups), reversed(xs), strict=True):
        g, cot = bwd(group, x, cot, TINY)
        grads.insert(0, g)
    embed = head_grads["embed"] + jax.jit(model.embed_backward, static_argnames="config")(
        text_batch["inputs"], cot, TINY)
    expected = reference[1]
    np.testing.assert_allclose(embed, expected["embed"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads[0][0]["q"], expected["layers"][0]["q"], rtol=1e-4, atol=1e-6)


def _is_spec(x: object) -> bool:
    return isinstance(x, P)


def _check_specs(specs: dict, params_shape: dict, mesh_axes: dict[str, int]) -> None:
    assert jax.tree.structure(specs, is_leaf=_is_spec) == jax.tree.structure(params_shape)
    for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=_is_spec), jax.tree.leaves(params_shape), strict=True):
        assert len(spec) <= len(leaf.shape)
        used = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
        assert len(used) == len(set(used)) and set(used) <= set(mesh_axes)
        for dim, entry in zip(leaf.shape[:len(spec)], spec, strict=True):
            if entry is not None:
                parts = math.prod(mesh_axes[a] for a in ((entry,) if isinstance(entry, str) else entry))
                assert dim % parts == 0, (spec, leaf.shape)


@pytest.mark.parametrize("name", ["tiny", "small", "350m", "1b"])
@pytest.mark.parametrize("data_axis", ["data", None])
def test_param_specs_fit_a_2x2_mesh(name: str, data_axis: str | None) -> None:
    config = CONFIGS[name]
    shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
    specs = model.param_specs(shapes, data_axis=data_axis)
    _check_specs(specs, shapes, {"data": 2, "model": 2})
    assert specs["layers"][0]["gate"] == P(data_axis, "model")
    assert specs["layers"][0]["norm"] == P()
    assert model.batch_spec() == {"inputs": P("data", None), "targets": P("data", None)}


def test_sharded_loss_matches_unsharded(params: dict, text_batch: dict) -> None:
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))

    def shardings(specs: dict) -> dict:
        return jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec), specs, is_leaf=_is_spec)

    sharded = jax.device_put(params, shardings(model.param_specs(params)))
    batch = jax.device_put(text_batch, shardings(model.batch_spec()))
    loss = jax.jit(model.loss_fn, static_argnames="config")(sharded, batch, TINY)[0]
    assert float(loss) == pytest.approx(float(_loss(params, text_batch, TINY)[0]), rel=1e-5)


def test_batches_are_deterministic() -> None:
    a = data.batch(3, 7, 4, 64)
    b = data.batch(3, 7, 4, 64)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert a["inputs"].dtype == np.int32 and a["inputs"].shape == (4, 64)
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert not np.array_equal(a["inputs"], data.batch(4, 7, 4, 64)["inputs"])
    assert not np.array_equal(a["inputs"], data.batch(3, 8, 4, 64)["inputs"])


def test_holdout_split_is_disjoint(monkeypatch: pytest.MonkeyPatch) -> None:
    train, held = data.split_range("train"), data.split_range("eval")
    assert train[0] == 0 and train[1] == held[0] and held[1] == data.corpus().size
    assert held[1] - held[0] == int(data.corpus().size * data.HOLDOUT_FRACTION)
    # On a stream of 0s (train region) then 1s (held-out tail), every byte of a window,
    # targets included, shows which region it came from.
    stream = np.zeros(2000, np.uint8)
    stream[2000 - int(2000 * data.HOLDOUT_FRACTION):] = 1
    monkeypatch.setattr(data, "corpus", lambda max_bytes=data.CORPUS_BYTES: stream)
    for step in range(50):
        train_batch = data.batch(step, 0, 16, 64, split="train")
        eval_batch = data.batch(step, 0, 16, 64, split="eval")
        assert not train_batch["inputs"].any() and not train_batch["targets"].any()
        assert eval_batch["inputs"].all() and eval_batch["targets"].all()
    with pytest.raises(ValueError):
        data.batch(0, 0, 1, 100, split="eval")


def test_optimizer_reduces_loss_on_a_fixed_batch(params: dict, text_batch: dict) -> None:
    config = optim.OptimConfig(peak_lr=1e-2, const_steps=100)
    state = optim.init_opt_state(params, config)

    @jax.jit
    def step(p: dict, s: object) -> tuple:
        (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(p, text_batch, TINY)
        p, s = optim.apply_update(p, s, grads, config)
        return p, s, loss

    p, losses = params, []
    for _ in range(10):
        p, state, loss = step(p, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


def test_learning_rate_warms_up_holds_then_decays_as_inverse_sqrt() -> None:
    lr = optim.learning_rate(optim.OptimConfig(peak_lr=1e-2, const_steps=10_000))
    assert float(lr(0)) == pytest.approx(1e-2)
    assert float(lr(10_000)) == pytest.approx(1e-2)
    assert float(lr(40_000)) == pytest.approx(1e-2 / 2)
    warm = optim.learning_rate(optim.OptimConfig(peak_lr=1e-2, const_steps=100, warmup_steps=10))
    assert float(warm(0)) == pytest.approx(1e-3) and float(warm(9)) == pytest.approx(1e-2)


def test_peak_flops_from_gpu_datasheets_or_measured_on_cpu() -> None:
    assert flops.gpu_datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.gpu_datasheet_peak("NVIDIA H200", "float32") == 67e12
    assert flops.gpu_datasheet_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.gpu_datasheet_peak("some cpu") is None
    value, source = flops.peak_flops(jax.devices("cpu")[:1])
    assert value > 1e8 and source.startswith("measured")
