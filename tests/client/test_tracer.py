"""The tracer's parts a program body meets, without a cluster: traced values refuse to be read (naming the
user's line), host values are captured once, values of another trace or stray pw.Arrays are refused, and
arguments are named as the user wrote them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from client.tracer import HostValue, Trace, TracedValue, arg_path, current_trace, enter, user_line
from pathways.errors import ProgramError


def traced(trace: Trace) -> TracedValue:
    return TracedValue(trace.add_input((4, 2), np.float32, None, P(), ("array", 0)), trace)


@pytest.mark.parametrize("read, words", [
    (bool, "reading the truth value of"), (float, "converting to float"), (int, "converting to int"),
    (np.asarray, "converting to numpy"), (len, "taking the length of"), (list, "iterating over"),
    (lambda v: v + 1, "computing with"), (lambda v: v[0], "computing with"), (lambda v: v.item(), "reading an item"),
    (lambda v: range(10)[v], "using as an index"),
])
def test_a_traced_value_refuses_to_be_read_and_names_the_users_line(read, words):
    value = traced(Trace("p", op_by_op=False))
    with pytest.raises(ProgramError, match=words) as info:
        read(value)
    assert "test_tracer.py:" in str(info.value) and "compute with pw.jit functions" in str(info.value)


def test_a_traced_value_knows_its_shape_but_not_its_contents():
    value = traced(Trace("p", op_by_op=False))
    assert (value.shape, value.dtype, value.ndim, value.size) == ((4, 2), np.float32, 2, 8)


def test_host_values_are_captured_once_per_content():
    trace = Trace("p", op_by_op=False)
    a = trace.constant(np.arange(3.0), "scale")
    assert isinstance(a, HostValue) and trace.constant(np.arange(3.0), "scale") is a
    assert trace.constant(np.arange(4.0), "scale") is not a and len(trace.constants) == 2
    assert trace.operand(2.5, "f", "x").trace is trace  # a scalar is a host value too


def test_what_cannot_be_an_operand_is_refused_with_what_to_do():
    trace, other = Trace("p", op_by_op=False), Trace("q", op_by_op=False)
    with pytest.raises(ProgramError, match="another program being traced"):
        trace.operand(traced(other), "f", "x")
    with pytest.raises(ProgramError, match="mark the argument static"):
        trace.operand("relu", "f", "act")


def test_the_current_trace_is_the_one_entered_and_only_while_inside():
    trace = Trace("p", op_by_op=False)
    assert current_trace() is None
    with enter(trace):
        assert current_trace() is trace
    assert current_trace() is None


def test_arguments_are_named_as_the_user_wrote_them():
    args = ((np.ones(1), {"w": np.ones(1)}), {"scale": np.ones(1)})
    paths = [arg_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    assert paths == ["0", "1['w']", "scale"] and arg_path(()) == "value"


def test_the_users_line_is_the_first_frame_outside_the_runtime():
    assert user_line().startswith(__file__) and "user_line()" in user_line()
