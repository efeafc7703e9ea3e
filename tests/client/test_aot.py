"""Ahead-of-time: pw.jit(f).lower(*args) and .compile() against jax.jit(f).lower(*args).compile() for the same
mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways as pw
from client.aot import Compiled, Lowered


@pytest.fixture(scope="module")
def s(cluster):
    with pw.slice((2,), ("data",), island=0) as sl:
        yield sl


def layer(x, w):
    return jnp.tanh(x @ w).sum(axis=1)


def jax_compiled(x, w):
    """jax.jit's own compile of ``layer`` for the same 2-device mesh and shardings."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    return jax.jit(layer, in_shardings=(NamedSharding(mesh, P("data")), NamedSharding(mesh, P())),
                   out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()


def test_lower_compile_and_call_like_jax_jit(s):
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    w = np.eye(8, dtype=np.float32)
    f = pw.jit(layer, slice=s, in_specs=(P("data"), P()))
    lowered = f.lower(pw.put(x, s, P("data")), w)
    text = lowered.as_text()
    assert isinstance(lowered, Lowered) and lowered.in_avals == [((8, 8), np.float32, False)] * 2
    assert "stablehlo.tanh" in text and "stablehlo.dot_general" in text and "func.func public @main" in text
    compiled = lowered.compile()
    assert isinstance(compiled, Compiled)
    np.testing.assert_allclose(np.asarray(compiled(pw.put(x, s, P("data")), w)), jax.jit(layer)(x, w), rtol=1e-6)
    with pytest.raises(pw.ProgramError, match="compiled for arguments"):
        compiled(np.ones((4, 8), np.float32), w)


def test_cost_and_memory_analysis_are_xlas_for_the_same_mesh(s):
    x = np.ones((8, 8), np.float32)
    w = np.ones((8, 8), np.float32)
    compiled = pw.jit(layer, slice=s, in_specs=(P("data"), P())).lower(
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype)).compile()
    want = jax_compiled(x, w)
    assert compiled.cost_analysis()["flops"] == want.cost_analysis()["flops"] > 0
    got, ref = compiled.memory_analysis(), want.memory_analysis()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(got, field) == getattr(ref, field), field
    assert "XLA:CPU" in compiled.analysis_note


def test_analyses_are_none_and_say_why_without_enough_client_devices(s, monkeypatch):
    cpu = jax.devices("cpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: cpu[:1])
    compiled = pw.jit(jnp.sin, slice=s).lower(np.ones(4, np.float32)).compile()
    assert compiled.cost_analysis() is None and compiled.memory_analysis() is None
    assert "xla_force_host_platform_device_count=2" in compiled.analysis_note
    np.testing.assert_allclose(np.asarray(compiled(np.ones(4, np.float32))), np.sin(np.ones(4)), rtol=1e-6)
