"""Fragment templates: one definition of each op, and the checks every island runs before admitting one."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

import pathways as pw
from pathways import op_wire, wire
from pathways.ops import (
    Aval,
    Exec,
    Limits,
    Recv,
    Reshard,
    Route,
    Send,
    SliceDesc,
    Template,
    TemplateCache,
    check_fits,
    declared_values,
)

LIMITS = Limits(island=0, islands=2, hosts=2, devices_per_host=2, memory_bytes=1 << 30, device_bytes=1 << 30)
DESC = SliceDesc("s1", (2,), ("x",), ((0, 0), (0, 1)))
EXE = "ab" * 32
CALL = Exec(EXE, "s1", (0, 1), (2,), ((), ("x",)), (("x",),), "f")


def template(*ops, n_inputs=2, n_values=3, slices=None) -> Template:
    return Template("p", n_inputs, n_values, {"s1": DESC} if slices is None else slices, tuple(ops))


def roundtrip(t: Template) -> Template:
    return Template.decode(t.encode())


def test_every_op_survives_its_wire_form():
    ops = [CALL, Send(2, 3, 1, (Route(0, 1, (((0, 4),), ((4, 8),))),)),
           Recv(4, "s1", ("x",), Aval((8,), "float32"), 1, (Route(0, 0, (((0, 4),),)), Route(1, 0, (((4, 8),),))),
                frees=(3,)),
           Reshard(2, 5, "s1", (None, "x"))]
    for op in ops:
        assert op_wire.decode(op_wire.to_wire(op), "op") == op
    t = template(*ops, n_values=6)
    back = roundtrip(replace(t, ops=(CALL, replace(ops[2], out=3, frees=()))))
    assert back.ops[0] == CALL and back.program == "p" and back.slices["s1"] == DESC


def test_op_reads_and_writes_are_defined_once():
    assert CALL.reads() == (0, 1) and CALL.writes() == (2,)
    send = Send(2, 3, 1, ())
    assert send.reads() == (2,) and send.writes() == ()
    recv = Recv(4, "s1", (), Aval((2,), "float32"), 1, ())
    assert recv.reads() == () and recv.writes() == (4,)
    assert {f.name for f in fields(Exec)} >= {"exe", "inputs", "outputs", "frees", "donate"}


@pytest.mark.parametrize("ops, n_values, words", [
    ((replace(CALL, outputs=(-3,)),), 3, r"slot\(s\) \[-3\] out of range"),
    ((replace(CALL, outputs=(9,)),), 3, r"slot\(s\) \[9\] out of range"),
    ((replace(CALL, inputs=(0, 4)),), 5, "reads slot 4, which no earlier op wrote"),
    ((replace(CALL, outputs=(1,)),), 3, "writes slot 1, which is an input"),
    ((CALL, CALL), 3, "writes slot 2, which is an input or was already written"),
    ((replace(CALL, frees=(0,)),), 3, "frees slot 0, which is not a value this fragment produced"),
    ((replace(CALL, frees=(2,)), replace(CALL, inputs=(2, 2), outputs=(3,))), 4, "reads slot 2 after an earlier op"),
    ((CALL,), 2**40, "is not a valid program"),
])
def test_a_template_that_breaks_slot_rules_is_refused(ops, n_values, words):
    with pytest.raises(pw.ProgramError, match=words):
        roundtrip(template(*ops, n_values=n_values))


@pytest.mark.parametrize("op, error, words", [
    (replace(CALL, exe="not hex"), pw.WireFormatError, "is not a sha256 hex digest"),
    (replace(CALL, slice="s9"), pw.ProgramError, "slice 's9' is not one of this fragment's slices"),
    (replace(CALL, in_specs=(("y",), ())), pw.ProgramError, "must name each of the slice's axes"),
    (replace(CALL, in_specs=((),)), pw.ProgramError, "2 inputs and 1 outputs but 1 and 1 specs"),
    (replace(CALL, donate=(5,)), pw.ProgramError, "donated positions"),
    (Send(2, 0, 1, ()), pw.ProgramError, "receive slot 0 is not a value of this call"),
    (Send(2, 3, 7, ()), pw.ResourceError, "island 7 is not an island of this cluster"),
    (Send(2, 3, -1, ()), pw.ResourceError, "island -1 is not an island of this cluster"),
    (Send(2, 3, 1, (Route(5, 0, ()),)), pw.ProgramError, "route host 5 -> host 0"),
    (Recv(3, "s1", (), Aval((2**31, 2**31), "float32"), 1, (Route(0, 0, (((0, 1), (0, 1)),)),)), pw.ResourceError,
     "GiB"),
    (Recv(3, "s1", (), Aval((-2,), "float32"), 1, ()), pw.ProgramError, "not a valid array"),
    (Recv(3, "s1", (), Aval((2,), "nope"), 1, ()), pw.WireFormatError, "unknown dtype"),
    (Recv(3, "s1", ("x",), Aval((3,), "float32"), 1, ()), pw.ProgramError, "not divisible"),
    (Recv(3, "s1", (), Aval((2,), "float32"), 9, ()), pw.ResourceError, "source island 9 is not an island"),
    (Recv(3, "s1", (), Aval((2,), "float32"), 1, (Route(0, 9, (((0, 2),),)),)), pw.ProgramError,
     "route host 0 -> host 9"),
    (Recv(3, "s1", (), Aval((2,), "float32"), 1, (Route(0, 0, (((0, 5),),)),)), pw.ProgramError,
     "is not a region of an array of shape"),
])
def test_a_template_that_means_nothing_on_this_island_is_refused(op, error, words):
    t = roundtrip(template(CALL, op, n_values=4)) if not isinstance(op, Exec) else roundtrip(template(op))
    with pytest.raises(error, match=words):
        t.check(LIMITS)


def test_slices_must_exist_on_the_island():
    bad = SliceDesc("s1", (2,), ("x",), ((0, 0), (3, 1)))
    with pytest.raises(pw.ResourceError, match=r"device \(host 3, device 1\) does not exist"):
        roundtrip(template(CALL, slices={"s1": bad})).check(LIMITS)
    mismatch = SliceDesc("s1", (4,), ("x",), ((0, 0), (0, 1)))
    with pytest.raises(pw.ProgramError, match="does not match its 2 devices"):
        roundtrip(template(CALL, slices={"s1": mismatch})).check(LIMITS)


def test_unknown_ops_and_malformed_op_fields_are_wire_errors():
    blob = template(CALL).encode()
    msg = wire.decode(blob, "template")
    body = {k: v for k, v in msg.items() if k not in ("v", "kind")}
    with pytest.raises(pw.WireFormatError, match=r"template.ops\[0\]: unknown op 'jump'"):
        Template.decode(wire.encode("template", {**body, "ops": [{"op": "jump"}]}))
    bad = dict(body["ops"][0], in_specs=[[None, ["a", 3]]])
    with pytest.raises(pw.WireFormatError, match=r"template.ops\[0\]\(exec\).in_specs\[0\]\[1\]: expected str"):
        Template.decode(wire.encode("template", {**body, "ops": [bad]}))


def test_the_template_cache_decodes_once_and_remembers_refusals():
    checked = []
    cache = TemplateCache(check=checked.append)
    blob = template(CALL).encode()
    assert cache.get(blob) is cache.get(blob) and len(checked) == 1
    bad = template(replace(CALL, outputs=(-1,))).encode()
    for _ in range(2):
        with pytest.raises(pw.ProgramError):
            cache.get(bad)
    assert declared_values(bad) == 3 and declared_values(b"junk") == 1


def test_sizes_are_checked_per_host_and_per_device():
    two_hosts = SliceDesc("s", (4,), ("x",), ((0, 0), (0, 1), (1, 0), (1, 1)))
    limits = replace(LIMITS, memory_bytes=1000, device_bytes=500)
    check_fits(Aval((1000,), "int8"), ("x",), two_hosts, limits, "ok")  # 250 bytes a device, 500 a host
    with pytest.raises(pw.ResourceError, match="needs"):
        check_fits(Aval((1000,), "int8"), (), two_hosts, limits, "replicated")  # 1000 a device
