"""Lowering (client/lowering.py) on hand-built programs: one fragment per island, sends right after their
producer, receives with their send's routes, local reshards, and each intermediate freed right after its last
use on its island (never an input or an output)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from client.lowering import lower, placement_of, with_frees
from client.slices import VirtualSlice
from pathways.graph import Compute, Program, Transfer, Value
from pathways.ops import Exec, Limits, Recv, Reshard, Route, Send, Template
from pathways.sharding import plan_transfer

REPLICATED = P()
ONE_HOST = ((0, 0), (0, 1))
TWO_HOSTS = ((0, 0), (1, 0))


def vslice(key: str, island: int, devices=ONE_HOST, shape=(2,), axes=("x",)) -> VirtualSlice:
    return VirtualSlice(None, {"key": key, "shape": list(shape), "axes": list(axes), "island": island,
                               "devices": [list(d) for d in devices], "tenant": "t"})


def exe_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


class Builder:
    """A program built by hand, as the tracer would: inputs first, then nodes in program order."""

    def __init__(self, n_inputs: int, s: VirtualSlice, spec=REPLICATED) -> None:
        self.program = Program("p")
        self.slots = 0
        self.inputs = [self.value(s, spec) for _ in range(n_inputs)]
        self.program.inputs.extend(self.inputs)

    def value(self, s: VirtualSlice, spec=REPLICATED, shape=(8,)) -> Value:
        self.slots += 1
        return Value(self.slots - 1, shape, np.dtype("float32"), s, spec)

    def call(self, name: str, s: VirtualSlice, *inputs: Value, spec=REPLICATED, donate=()) -> Value:
        out = self.value(s, spec)
        self.program.nodes.append(Compute(name, exe_of(name), s, inputs, (out,), tuple(v.spec for v in inputs),
                                          (spec,), donate))
        return out

    def transfer(self, source: Value, s: VirtualSlice, spec=REPLICATED) -> Value:
        out = self.value(s, spec)
        self.program.nodes.append(Transfer(source, out))
        return out

    def lower(self, *outputs: Value):
        self.program.outputs.extend(outputs)
        exes = {n.exe: n.name.encode() for n in self.program.nodes if isinstance(n, Compute)}
        return lower(self.program, exes)


def ops_of(lowered, island: int) -> list[tuple]:
    """A fragment's ops, readable: (kind, what, frees)."""
    out = []
    for op in lowered.fragments[island].ops:
        if isinstance(op, Exec):
            out.append(("exec", op.name, op.frees))
        elif isinstance(op, Send):
            out.append(("send", op.source, op.frees))
        elif isinstance(op, Recv):
            out.append(("recv", op.out, op.frees))
        else:
            out.append(("reshard", op.source, op.frees))
    return out


A, B, C = vslice("a", 0), vslice("b", 1), vslice("c", 2)


def test_one_fragment_per_island_the_program_touches():
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    z = p.call("g", C, p.transfer(y, C))
    lowered = p.lower(z)
    assert sorted(lowered.fragments) == [0, 2]
    assert (lowered.n_inputs, lowered.n_values) == (1, 4)
    only = Builder(1, B)
    assert sorted(only.lower(only.call("f", B, *only.inputs)).fragments) == [1]


def test_each_fragment_carries_only_the_executables_its_island_calls():
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    lowered = p.lower(p.call("g", B, p.transfer(y, B)))
    assert lowered.fragments[0].exes == {exe_of("f"): b"f"}
    assert lowered.fragments[1].exes == {exe_of("g"): b"g"}


def test_a_send_goes_right_after_its_producer_not_where_the_program_transfers():
    p = Builder(1, A)
    x = p.inputs[0]
    y = p.call("produce", A, x)
    later = p.call("unrelated", A, x)
    moved = p.transfer(y, B)  # the program transfers y only after "unrelated"
    lowered = p.lower(p.call("consume", B, moved), later)
    assert [kind for kind, *_ in ops_of(lowered, 0)] == ["exec", "send", "exec"]
    assert ops_of(lowered, 0)[0][1] == "produce" and ops_of(lowered, 0)[1][1] == y.slot


def test_a_send_of_an_input_goes_first():
    p = Builder(1, A)
    local = p.call("local", A, *p.inputs)
    moved = p.transfer(p.inputs[0], B)
    lowered = p.lower(p.call("remote", B, moved), local)
    assert ops_of(lowered, 0) == [("send", 0, ()), ("exec", "local", ())]


def test_sends_of_one_producer_keep_program_order():
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    to_b, to_c = p.transfer(y, B), p.transfer(y, C)
    lowered = p.lower(p.call("g", B, to_b), p.call("h", C, to_c))
    sends = [op for op in lowered.fragments[0].ops if isinstance(op, Send)]
    assert [s.island for s in sends] == [1, 2] and [s.key for s in sends] == [to_b.slot, to_c.slot]


def test_a_receive_carries_the_routes_of_its_send_and_they_are_the_transfer_plan():
    src, dst = vslice("src", 0, TWO_HOSTS), vslice("dst", 1, TWO_HOSTS)
    p = Builder(1, src, P("x"))
    moved = p.transfer(p.inputs[0], dst, P("x"))
    lowered = p.lower(p.call("g", dst, moved, spec=P("x")))
    (send,) = [op for op in lowered.fragments[0].ops if isinstance(op, Send)]
    (recv,) = [op for op in lowered.fragments[1].ops if isinstance(op, Recv)]
    plan = plan_transfer((8,), src.desc(), P("x"), dst.desc(), P("x"))
    assert send.routes == recv.routes == tuple(Route(h, to, tuple(shards)) for h, to, shards in plan)
    assert send.routes == (Route(0, 0, (((0, 4),),)), Route(1, 1, (((4, 8),),)))  # host i to host i
    assert (send.key, send.island) == (recv.out, 1) and recv.src == 0 and recv.slice == "dst"
    assert recv.aval.shape == (8,) and recv.aval.dtype == "float32" and recv.spec == ("x",)


def test_a_transfer_between_slices_of_one_host_is_a_local_reshard():
    here, there = vslice("here", 0), vslice("there", 0, ((0, 2), (0, 3)))
    p = Builder(1, here, P("x"))
    moved = p.transfer(p.inputs[0], there, P())
    lowered = p.lower(p.call("g", there, moved))
    assert sorted(lowered.fragments) == [0]
    (reshard,) = [op for op in lowered.fragments[0].ops if isinstance(op, Reshard)]
    assert (reshard.source, reshard.out, reshard.slice, reshard.spec) == (0, moved.slot, "there", ())
    assert not any(isinstance(op, Send | Recv) for op in lowered.fragments[0].ops)


@pytest.mark.parametrize("target", ["another slice", "the same slice"])
def test_a_transfer_within_a_two_host_island_lowers_to_a_fragment_the_island_admits(target):
    both = vslice("both", 0, TWO_HOSTS)
    p = Builder(1, both, P("x"))
    there = vslice("one", 0, ((1, 0), (1, 1))) if target == "another slice" else both
    moved = p.transfer(p.inputs[0], there, P())  # e.g. f's output P("x") read by g with in_specs P()
    lowered = p.lower(p.call("g", there, moved))
    Template.decode(lowered.fragments[0].encoded).check(Limits(0, 2, 2, 2, 1 << 30, 1 << 30))


def test_each_intermediate_is_freed_right_after_its_last_use_on_its_island():
    p = Builder(2, A)
    x0, x1 = p.inputs
    a = p.call("a", A, x0)
    b = p.call("b", A, a, x1)
    c = p.call("c", A, a)  # a's last use
    d = p.call("d", A, b, c)  # b's and c's last use
    unused = p.call("unused", A, x0)  # never read: freed right after it is made
    lowered = p.lower(d)
    assert ops_of(lowered, 0) == [("exec", "a", ()), ("exec", "b", ()), ("exec", "c", (a.slot,)),
                                  ("exec", "d", (b.slot, c.slot)), ("exec", "unused", (unused.slot,))]


def test_inputs_and_outputs_are_never_freed():
    p = Builder(2, A)
    x0, x1 = p.inputs
    y = p.call("f", A, x0, x1)
    z = p.call("g", A, y)  # y is read after it is made, and it is an output too
    lowered = p.lower(y, z, x0)
    freed = {s for op in lowered.fragments[0].ops for s in op.frees}
    assert freed == set()


def test_a_value_sent_away_is_freed_on_its_island_after_its_last_local_use():
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    moved = p.transfer(y, B)
    after = p.call("h", A, y)  # read here after the send was placed
    remote = p.call("g", B, moved)
    lowered = p.lower(after, remote)
    assert ops_of(lowered, 0) == [("exec", "f", ()), ("send", y.slot, ()), ("exec", "h", (y.slot,))]
    assert ops_of(lowered, 1) == [("recv", moved.slot, ()), ("exec", "g", (moved.slot,))]


def test_a_value_only_sent_is_freed_right_after_its_send():
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    lowered = p.lower(p.call("g", B, p.transfer(y, B)))
    assert ops_of(lowered, 0) == [("exec", "f", ()), ("send", y.slot, (y.slot,))]


def test_frees_are_per_island():
    """A value received on two islands is freed on each after its own last use there."""
    p = Builder(1, A)
    y = p.call("f", A, *p.inputs)
    on_b, on_c = p.transfer(y, B), p.transfer(y, C)
    b1 = p.call("b1", B, on_b)
    b2 = p.call("b2", B, on_b, b1)
    c1 = p.call("c1", C, on_c)
    lowered = p.lower(b2, c1)
    assert ops_of(lowered, 1) == [("recv", on_b.slot, ()), ("exec", "b1", ()), ("exec", "b2", (on_b.slot, b1.slot))]
    assert ops_of(lowered, 2) == [("recv", on_c.slot, ()), ("exec", "c1", (on_c.slot,))]


def test_with_frees_attaches_each_slot_to_its_last_touch_and_keeps_what_it_is_told():
    ops = [Exec("e" * 64, "a", (0,), (1,), ((),), ((),), "f"),
           Exec("e" * 64, "a", (1,), (2,), ((),), ((),), "g"),
           Send(2, 5, 1, ()),
           Exec("e" * 64, "a", (1, 0), (3,), ((), ()), ((),), "h")]
    freed = [op.frees for op in with_frees(ops, keep={0, 3})]
    assert freed == [(), (), (2,), (1,)]


def test_every_fragment_passes_the_islands_structural_checks():
    """What lowering makes decodes on an island: slots in range, reads after writes, frees of its own."""
    p = Builder(2, A)
    x0, x1 = p.inputs
    y = p.call("f", A, x0, x1)
    z = p.call("g", B, p.transfer(y, B))
    w = p.call("h", A, p.transfer(z, A), y)
    lowered = p.lower(w)
    for island, fragment in lowered.fragments.items():
        template = Template.decode(fragment.encoded)
        template.check(Limits(island, 2, 1, 4, 1 << 30, 1 << 30))
        assert template.ops == fragment.ops


def test_donated_inputs_reach_the_exec_op():
    p = Builder(1, A)
    lowered = p.lower(p.call("f", A, *p.inputs, donate=(0,)))
    assert lowered.fragments[0].ops[0].donate == (0,)


@pytest.mark.parametrize("change", ["devices", "island"])
def test_the_placement_changes_when_a_slice_moves(change):
    p = Builder(1, A)
    p.lower(p.call("f", A, *p.inputs))
    moved = vslice("a", 1) if change == "island" else vslice("a", 0, ((0, 2), (0, 3)))
    q = Builder(1, moved)
    q.lower(q.call("f", moved, *q.inputs))
    assert placement_of(p.program) != placement_of(q.program)
    same = Builder(1, vslice("a", 0))
    same.lower(same.call("f", same.inputs[0].slice, *same.inputs))
    assert placement_of(p.program) == placement_of(same.program)
