"""Op kinds declared once: one declaration gives an op its fields, its wire form, its schema and its validation."""

from __future__ import annotations

import msgpack
import pytest

import pathways as pw
from pathways import op_wire
from pathways.op_wire import FREES, INT, SLOTS, TEXT, Codec, many, on_wire, optional
from pathways.ops import Exec, Op, Recv, Reshard, Send, Template


@op_wire.declare("gather")
class Gather(Op):
    """An op kind declared here only: nothing outside this declaration knows it."""

    sources: tuple[int, ...] = on_wire(SLOTS, "in")
    out: int = on_wire(INT)
    label_: str = on_wire(TEXT, "label")
    scales: tuple[float, ...] = on_wire(many(Codec(float)))
    frees: tuple[int, ...] = on_wire(FREES, default=())
    axes: tuple[int, ...] = on_wire(optional(SLOTS), default=())

    def reads(self) -> tuple[int, ...]:
        return self.sources

    def writes(self) -> tuple[int, ...]:
        return (self.out,)


GATHER = Gather((0, 1), 2, "g", (0.5, 2.0), frees=(), axes=(1,))


def test_a_declared_op_round_trips_its_wire_form_with_frees_last_and_empty_options_left_out():
    d = op_wire.to_wire(Gather((0, 1), 3, "g", (1.0,), frees=(2,)))
    assert list(d) == ["op", "in", "out", "label", "scales", "frees"]  # "axes" is empty: left out
    assert d == {"op": "gather", "in": [0, 1], "out": 3, "label": "g", "scales": [1.0], "frees": [2]}
    assert list(op_wire.to_wire(GATHER)) == ["op", "in", "out", "label", "scales", "axes"]
    assert op_wire.decode(op_wire.to_wire(GATHER), "op") == GATHER
    assert Gather in op_wire.classes() and op_wire.classes()[:4] == (Exec, Send, Recv, Reshard)


def test_a_declared_op_travels_in_a_template_and_its_slots_are_checked():
    t = Template("p", 2, 3, {}, (GATHER,))
    back = Template.decode(t.encode())
    assert back.ops == (GATHER,) and not back.receives and back.executables == frozenset()
    with pytest.raises(pw.ProgramError, match=r"op 0 \(gather\): writes slot 1, which is an input"):
        Template.decode(Template("p", 2, 3, {}, (Gather((0,), 1, "g", ()),)).encode())


@pytest.mark.parametrize("change, words", [
    ({"in": [0, "1"]}, r"ops\[0\]\(gather\).in\[1\]: expected int, got str"),
    ({"out": True}, r"ops\[0\]\(gather\).out: expected int, got bool"),
    ({"scales": None}, r"ops\[0\]\(gather\).scales: expected a list, got NoneType"),
    ({"axes": [[1]]}, r"ops\[0\]\(gather\).axes\[0\]: expected int, got list"),
])
def test_a_malformed_field_of_a_declared_op_is_a_wire_error_naming_it(change, words):
    with pytest.raises(pw.WireFormatError, match=words):
        op_wire.decode({**op_wire.to_wire(GATHER), **change}, "ops[0]")
    missing = {k: v for k, v in op_wire.to_wire(GATHER).items() if k != "label"}
    with pytest.raises(pw.WireFormatError, match=r"ops\[0\]\(gather\): missing field 'label'"):
        op_wire.decode(missing, "ops[0]")


@pytest.mark.parametrize("kind", ["jump", ["exec"], None, 3])
def test_an_unknown_or_malformed_kind_is_a_wire_error_listing_the_known_ones(kind):
    with pytest.raises(pw.WireFormatError, match=r"ops\[4\]: unknown op .*; known: exec, send, recv, reshard"):
        op_wire.decode({"op": kind}, "ops[4]")


def test_a_declaration_must_be_complete_and_a_kind_declared_once():
    with pytest.raises(ValueError, match="'gather' is declared twice"):
        op_wire.declare("gather")(type("Again", (Op,), {}))
    with pytest.raises(TypeError, match="field 'n' is not declared with on_wire"):
        op_wire.declare("bare")(type("Bare", (Op,), {"__annotations__": {"n": "int"}}))
    with pytest.raises(TypeError, match="every op has a field 'frees'"):
        op_wire.declare("nofrees")(type("NoFrees", (Op,), {"__annotations__": {"n": "int"}, "n": on_wire(INT)}))
    with pytest.raises(TypeError, match="not a declared fragment op"):
        op_wire.to_wire(object())


def test_the_wire_form_of_the_runtime_ops_is_a_map_per_op():
    exec_ = Exec("ab" * 32, "s", (0,), (1,), ((),), ((("x", "y"), None),), "f", donate=(0,))
    d = op_wire.to_wire(exec_)
    assert list(d) == ["op", "exe", "slice", "in", "out", "in_specs", "out_specs", "name", "donate"]
    assert d["out_specs"] == [[["x", "y"], None]]
    assert op_wire.decode(msgpack.unpackb(msgpack.packb(d)), "op") == exec_
