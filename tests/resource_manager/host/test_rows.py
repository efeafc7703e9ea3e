"""The rows host 0 sends its island's other hosts: each item's form, how it travels, and what the runtime key's MAC
covers."""

from __future__ import annotations

import pytest

from pathways.messages import CLIENT_ID_BITS, Call, decode_request
from pathways.ops import Template
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import Failure
from resource_manager.host.rows import Grouped, Landed, Message, Row, decode_row, encode, signed_parts
from resource_manager.host.scheduler import Continue, Group, Resume

TEMPLATE = Template("p", 0, 1, {}, ()).encode()


def call(k: int) -> Call:
    return Call(TEMPLATE, (1 << CLIENT_ID_BITS) + k, (), {}, ())


def test_a_message_row_carries_what_another_host_decodes_and_a_refusal_as_kind_and_message():
    alone = call(1)
    row = Message.of(Admitted(1, "t", alone.encode(), alone, end=3))
    assert (row.client, row.tenant, row.refusal, row.end) == (1, "t", None, 3)
    assert decode_request(row.payload) == alone
    second = Message.of(Admitted(1, "t", b"", call(2)))  # a call of a merged message has no payload of its own
    assert decode_request(second.payload) == call(2)
    refused = Message.of(Admitted(1, "t", b"x", None, refusal=Failure("ResourceError", "over"), fail_lo=4, fail_hi=6))
    assert (refused.refusal, refused.fail_lo, refused.fail_hi, refused.end) == (("ResourceError", "over"), 4, 6, None)


def test_released_items_travel_as_plain_tuples_and_come_back_typed_one_row_each_in_their_place():
    a, b = (Admitted(1, "t", call(k).encode(), call(k)) for k in (1, 2))
    wire = encode([(0, a), (1, Group((a, b))), (2, Resume(0, 3)), (3, Continue(0, 4, 8))])
    assert type(wire) is list and all(type(row) is tuple for row in wire)
    rows = [decode_row(row) for row in wire]
    assert rows == [Row(0, Message.of(a)), Row(1, Grouped((Message.of(a), Message.of(b)))), Row(2, Resume(0, 3)),
                    Row(3, Continue(0, 4, 8))]
    with pytest.raises(ValueError, match="never sends"):
        decode_row((4, "shrug", 1))


def test_the_mac_covers_every_field_and_each_rows_kind():
    m = Admitted(1, "t", b"p", None)
    assert signed_parts(encode([(0, m)])) == [0, "msg", 1, "t", b"p", 0, 0, -1]
    assert signed_parts(encode([(0, Group((m,)))])) == [0, "group", 1, 1, "t", b"p", 0, 0, -1]
    assert signed_parts(encode([(5, Resume(1, 2))])) == [5, "resume", 1, 2]
    assert signed_parts(encode([(5, Continue(1, 2, 3))])) == [5, "part", 1, 2, 3]
    refused = Admitted(1, "t", b"p", None, refusal=Failure("ResourceError", "over"), fail_lo=4, fail_hi=6, end=2)
    assert signed_parts(encode([(0, refused)])) == [0, "msg", 1, "t", b"p", "ResourceError", "over", 4, 6, 2]
    assert Landed(1, ((7, 2), (8, 0))).signed_parts() == [7, 2, 8, 0, 1]


@pytest.mark.parametrize("rows", [[(0, "resume", 1)], "rows", ((0, "resume", 1, 0),), [[0, "resume", 1, 0]],
                                  [(0, "msg", ("x",))], [(0, "msg", (1, "t", b"p", ("only a kind",), 0, 0, None))],
                                  [(0, "group", ((1, "t", b"p", None, 0, 0, None),))], [(0, "call", 1, 2)]])
def test_anything_but_host_0s_rows_is_refused_before_a_mac_is_checked(rows):
    with pytest.raises((TypeError, ValueError)):
        signed_parts(rows)
