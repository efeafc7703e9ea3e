"""``pw.WeightSync`` on a live cluster: a parameter tree resharded to another slice bitwise, across islands and on
one island, planned once per tree signature, in buckets, and bad input refused with a clear error."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pathways as pw


def _tree(rng: np.random.Generator) -> dict:
    """Host values of a small model: two large kernels, many small leaves, two dtypes."""
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {"embed": normal(128, 64), "final_norm": normal(64),
            "layers": [{"norm": normal(64), "q": normal(64, 32), "down": normal(32, 64)} for _ in range(3)],
            "step": np.arange(8, dtype=np.int32), "big": normal(512, 256)}


def _src_specs(tree: dict) -> dict:
    return {"embed": P("x", None), "final_norm": P(), "layers": [{"norm": P(), "q": P("x", None), "down": P("x")}
                                                                  for _ in tree["layers"]],
            "step": P(), "big": P("x", None)}


# the sampler's layout: kernels split by columns, the rest replicated; "big" keeps its own spec (None)
LAYER = {"norm": P(), "q": P(None, "x"), "down": P(None, "x")}
DST_SPECS = {"embed": P(None, "x"), "final_norm": P(), "layers": [LAYER] * 3,
             "step": P("x"), "big": None}


def _fetch(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a.fetch(timeout=60)), tree)


def _same_bits(got: dict, want: dict) -> None:
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
        assert g.tobytes() == w.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def test_a_tree_resharded_to_another_island_is_bitwise_the_trainers_and_planned_once(cluster):
    rng = np.random.default_rng(0)
    host = _tree(rng)
    with pw.slice((4,), ("x",), island=0) as trainer, pw.slice((4,), ("x",), island=1) as sampler:
        params = pw.put(host, trainer, _src_specs(host))
        sync = pw.WeightSync(sampler, DST_SPECS, bucket_bytes=48 << 10, small_bytes=4 << 10, stack_bytes=64 << 10)
        new = sync(params)
        leaves = jax.tree_util.tree_leaves(new)
        assert all(isinstance(a, pw.Array) and a.slice is sampler for a in leaves)
        assert new["embed"].spec == P(None, "x") and new["layers"][1]["q"].spec == P(None, "x")
        assert new["big"].spec == P("x", None) and new["step"].spec == P("x")
        _same_bits(_fetch(new), host)
        # the same as pw.transfer leaf by leaf
        by_leaf = [pw.transfer(a, sampler, a.spec) for a in leaves]
        for a, b in zip(leaves, by_leaf):
            assert np.asarray(a.fetch(timeout=60)).tobytes() == np.asarray(b.fetch(timeout=60)).tobytes()

        plan = sync.plan
        kinds = [b.kind for b in plan.buckets]
        # "big" (512 KiB) and "embed" (one of its shape) alone; q and down each one stack of three layers; the
        # norms and "step" in one pack per dtype
        assert kinds.count("leaf") == 2 and kinds.count("stack") == 2, plan.describe()
        assert kinds.count("pack") == 2 and plan.transfers == 6 < plan.leaves == 13, plan.describe()
        assert all(b.nbytes <= 48 << 10 for b in plan.buckets if b.kind in ("pack", "stack"))
        assert sorted(k for b in plan.buckets for k in b.leaves) == list(range(plan.leaves))
        assert plan.nbytes == sum(v.nbytes for v in jax.tree_util.tree_leaves(host))
        assert plan.pairs[(trainer.key, ("x",), (None, "x"))] == (7, 32768 + 6 * 8192)  # embed, q, down

        # a second step: new values of the same signature are only executed
        host2 = jax.tree_util.tree_map(lambda v: v + np.ones((), v.dtype), host)
        params2 = pw.put(host2, trainer, _src_specs(host2))
        _same_bits(_fetch(sync(params2)), host2)
        assert sync.plans_made == 1 and sync.plan is plan and plan.executions == 2


def test_a_sync_inside_a_program_and_on_one_island(cluster):
    rng = np.random.default_rng(1)
    host = {"w": rng.standard_normal((64, 32)).astype(np.float32), "s": rng.standard_normal(32).astype(np.float32)}
    with pw.slice((2,), ("x",), island=0) as trainer, pw.slice((2,), ("x",), island=0) as sampler:
        # (whether the two slices share devices depends on what else the session's cluster holds; either way it is
        # a reshard on the island, with no host-to-host copy)
        params = pw.put(host, trainer, {"w": P("x", None), "s": P()})
        sync = pw.WeightSync(sampler, {"w": P(None, "x"), "s": P("x")}, small_bytes=1 << 10)
        step = pw.jit(lambda p: jax.tree_util.tree_map(lambda v: v * 2.0, p), slice=trainer,
                      out_specs={"w": P("x", None), "s": P()})

        @pw.program
        def train_then_sync(p):
            q = step(p)
            return q, sync(q)

        trained, synced = train_then_sync(params)
        assert synced["w"].slice is sampler and synced["w"].spec == P(None, "x")
        _same_bits(_fetch(synced), _fetch(trained))
        np.testing.assert_array_equal(np.asarray(synced["w"].fetch(timeout=60)), host["w"] * 2.0)
        # outside a program, on the same island: one program, the same bits
        _same_bits(_fetch(sync(params)), host)
        assert sync.plans_made == 1 and sync.plan.executions == 2  # traced values or arrays: one plan


def test_bad_input_is_refused_with_what_to_do(cluster):
    with pw.slice((4,), ("x",), island=0) as trainer, pw.slice((4,), ("x",), island=1) as sampler:
        params = pw.put({"w": np.ones((8, 6), np.float32)}, trainer, P("x", None))
        with pytest.raises(pw.ProgramError, match=r"\['w'\].*dimension 1 of shape \(8, 6\) is not divisible"):
            pw.WeightSync(sampler, P(None, "x"))(params)
        with pytest.raises(pw.ProgramError, match=r"\['b'\] is ndarray, not a pw.Array"):
            pw.WeightSync(sampler, P())({"w": params["w"], "b": np.ones(3)})
        with pytest.raises(pw.ProgramError, match="specs do not match the params tree"):
            pw.WeightSync(sampler, {"v": P()})(params)
        with pytest.raises(pw.ProgramError, match="PartitionSpec"):
            pw.WeightSync(sampler, {"w": "x"})(params)
        with pytest.raises(pw.ProgramError, match="needs a pw.VirtualSlice"):
            pw.WeightSync("island 1", P())
        sync = pw.WeightSync(sampler, P())
    with pytest.raises(pw.ProgramError, match="was released"):
        sync(params)
