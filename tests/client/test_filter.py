"""``pw.filter_jit``'s filtering, without a cluster: which leaves are traced, how the rest is held static (and
so in the export's signature), donation by argument, and the errors a careless call gets before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from client.filter import FilteredFunction, Static, _hold, _release, filter_jit, is_array
from pathways.errors import ProgramError


def test_arrays_are_traced_and_everything_else_is_static():
    assert all(is_array(x) for x in (jnp.ones(2), np.ones(2), np.float32(1.0)))
    assert not any(is_array(x) for x in (1.0, 3, "relu", jnp.tanh, None, True))


def test_static_leaves_compare_by_type_and_value_and_are_part_of_the_structure():
    assert Static(1) == Static(1) and hash(Static(1)) == hash(Static(1))
    assert Static(1) != Static(1.0) and Static(True) != Static(1)  # 1 == 1.0 == True in Python, not here
    tree = {"w": np.ones(2), "act": jnp.tanh, "rate": 0.1}
    held = _hold(tree)
    leaves, structure = jax.tree.flatten(held)
    assert len(leaves) == 1 and leaves[0] is tree["w"]  # only the array is a leaf: the rest is the structure
    _, other = jax.tree.flatten(_hold({**tree, "rate": 0.2}))
    assert structure != other  # another static value is another signature (another export)
    assert _release(held)["act"] is jnp.tanh and _release(held)["rate"] == 0.1


@pytest.mark.parametrize("donate, args, kwargs, nums, names", [
    ("none", 3, ("b",), None, None),
    ("all", 3, ("b",), (0, 1, 2), ("b",)),
    ("all-except-first", 3, (), (1, 2), None),
])
def test_donation_is_by_argument_as_equinox_has_it(donate, args, kwargs, nums, names):
    def step(model, x, y, b=None):
        return model

    compiled = FilteredFunction(step, None, None, None, donate)._compiled(args, kwargs)
    assert compiled._options["donate_argnums"] == nums and compiled._options["donate_argnames"] == names


def test_bad_uses_are_refused_with_what_to_do_before_anything_runs():
    with pytest.raises(ProgramError, match="donate must be one of"):
        filter_jit(lambda x: x, donate="some")
    with pytest.raises(ProgramError, match="needs a function"):
        filter_jit(3)
    with pytest.raises(ProgramError, match="slice must be a VirtualSlice"):
        filter_jit(lambda x: x, slice="island 0")

    class Module:  # a module used as the function: its arrays would be baked into the export
        w = jnp.ones(3)

        def __call__(self, x):
            return x * self.w

    jax.tree_util.register_pytree_node(Module, lambda m: ((m.w,), None), lambda _, c: Module())
    with pytest.raises(ProgramError, match="pass the module as an argument"):
        filter_jit(Module())
    f = filter_jit(lambda x, opts: x)
    with pytest.raises(ProgramError, match="not hashable"):
        f(np.ones(2), {"opts": {1, 2}})  # a set is a leaf, not a pytree: held static, it must hash


def test_as_a_method_the_instance_is_the_first_argument():
    class Model:
        @filter_jit
        def __call__(self, x):
            return x

    m = Model()
    assert isinstance(Model.__call__, FilteredFunction)
    bound = m.__call__
    assert bound.func is Model.__dict__["__call__"] and bound.args == (m,)
    assert "on the slice of its first argument" in repr(Model.__dict__["__call__"])
