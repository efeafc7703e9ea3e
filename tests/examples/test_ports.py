"""Three real ports, Flax's NNX MNIST tutorial, Equinox's "Train RNN" example and the "Neural networks" section of
JAX's shard_map tutorial: each changes only the lines the README's porting table names, and computes what the
original computes under jax.jit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples import eqx_rnn, nnx_mnist, shard_map
from examples.eqx_rnn import jax_train as eqx_jax
from examples.eqx_rnn import pw_train as eqx_pw
from examples.nnx_mnist import jax_train as nnx_jax
from examples.nnx_mnist import pw_train as nnx_pw
from examples.shard_map import jax_train as shard_map_jax
from examples.shard_map import pw_train as shard_map_pw

PORTS = {"nnx_mnist": nnx_mnist, "eqx_rnn": eqx_rnn}


@pytest.mark.parametrize("name", sorted(PORTS))
def test_a_port_changes_only_imports_a_slice_init_and_decorators(name):
    changed, diff = PORTS[name].changed_lines()
    added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:].strip() for line in diff if line.startswith("-") and not line.startswith("---")]
    assert added[:2] == ["from jax.sharding import PartitionSpec as P", "import pathways as pw"], diff
    rest = added[2:]
    assert sum(line.startswith("s = pw.slice(") for line in rest) == 1, diff
    assert [line for line in rest if line.startswith("pw.")] == [
        "pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))", "pw.shutdown()"], diff
    decorators = [line for line in rest if line.startswith("@")]
    assert len(decorators) == len(removed) and all(old.startswith(("@nnx.jit", "@eqx.filter_jit")) for old in removed)
    assert changed == 2 + 1 + 2 + len(decorators) <= 7, diff


def test_nnx_mnist_port_gives_the_losses_and_accuracies_of_nnx_jit(cluster, monkeypatch):
    sizes = {"train_steps": 6, "eval_every": 3, "batch_size": 16, "image_size": 8, "features": (4, 8),
             "hidden": 16, "test_steps": 2}
    ported = nnx_pw.train(**sizes)
    # The port splits each batch over 2 devices, so BatchNorm's statistics and the losses' means sum in
    # another order than on one device (2e-4 apart after a few steps): the reference is nnx.jit on the same
    # split, over this process's own 2 devices.
    split = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
    digits = nnx_jax.digits
    monkeypatch.setattr(nnx_jax, "digits", lambda *a: (jax.device_put(b, split) for b in digits(*a)))
    plain = nnx_jax.train(**sizes)
    assert plain["train_loss"][-1] < plain["train_loss"][0]  # it trains
    assert set(ported) == set(plain)
    for name in plain:
        np.testing.assert_allclose(ported[name], plain[name], rtol=1e-5, err_msg=name)


def test_eqx_rnn_port_gives_the_losses_and_accuracy_of_filter_jit(cluster):
    sizes = {"dataset_size": 256, "batch_size": 32, "steps": 8, "hidden_size": 8}
    plain, plain_accuracy = eqx_jax.main(**sizes)
    ported, ported_accuracy = eqx_pw.main(**sizes)
    np.testing.assert_allclose(ported, plain, rtol=1e-5)
    assert ported_accuracy == plain_accuracy


# -- JAX's shard_map tutorial ("Neural networks": DP, FSDP, TP, FSDP + TP, an SPMD pipeline) ------------------


def test_shard_map_port_changes_only_the_porting_tables_lines():
    changed, diff = shard_map.changed_lines()
    added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:].strip() for line in diff if line.startswith("-") and not line.startswith("---")]
    new = ["import pathways as pw", "pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=8))",
           "pw.shutdown()"]
    assert [line for line in added if line in new] == new, diff
    replaced = [line for line in added if line not in new]
    assert len(replaced) == len(removed), diff
    kinds = []
    for old, line in zip(removed, replaced):
        if "pw.jit(" in line:  # jax.jit -> pw.jit, nothing else on the line
            assert line.replace("pw.jit(", "jax.jit(") == old, (old, line)
            kinds.append("jit")
        elif "pw.slice(" in line:  # each mesh a slice, with the axis types jax.make_mesh gives
            explicit = "axis_types=(Explicit,)" in line
            assert ("jax.make_mesh(" in old and explicit) or (old.startswith("mesh = Mesh(") and not explicit), old
            kinds.append("mesh")
        else:  # Mesh is not used any more
            assert (old, line) == ("from jax.sharding import Mesh, NamedSharding",
                                   "from jax.sharding import NamedSharding"), (old, line)
            kinds.append("import")
    assert (kinds.count("jit"), kinds.count("mesh"), kinds.count("import")) == (15, 5, 1)
    assert changed == len(new) + len(replaced) == 24


def test_shard_map_port_computes_what_jax_jit_computes(cluster):
    plain = shard_map_jax.main(4)  # this process's 4 CPU devices; the port on an island of 4 of the cluster's
    ported = shard_map_pw.main(4)
    assert [name for name, _ in ported] == [name for name, _ in plain]
    for (name, want), (_, got) in zip(plain, ported):
        if isinstance(want, bool):
            assert got is want is True, name
        elif isinstance(want, float):
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
        else:  # the pipeline's gradients, NaN where the tutorial's pipeline leaves them so
            for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
