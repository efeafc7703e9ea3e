"""The wire format's validation: what it accepts, and errors that name the field that was wrong."""

from __future__ import annotations

import pytest

from pathways import wire
from pathways.errors import WireFormatError

DELIVER = {"key": 7, "src": 0, "shards": [[[0, 1024], [0, 512]]],
           "direct": {"pid": 11, "host": 0, "lease": 3, "addrs": [4096], "channel": "\0h"}}


def test_a_valid_message_round_trips():
    msg = wire.decode(wire.encode("deliver", DELIVER), "deliver", "returned")
    assert {k: msg[k] for k in DELIVER} == DELIVER
    fetch = {"tenant": "t", "id": 1, "timeout": 2, "ready_only": False}  # msgpack sends a whole float as an int
    assert wire.decode(wire.encode("fetch", fetch))["timeout"] == 2


@pytest.mark.parametrize("kind,body,error", [
    ("deliver", dict(DELIVER, key=True), "deliver.key: expected int, got bool"),
    ("deliver", dict(DELIVER, shards=[[[0, "8"]]]), r"deliver.shards\[0\]\[0\]\[1\]: expected int, got str"),
    ("deliver", {k: v for k, v in DELIVER.items() if k != "src"}, "deliver: missing field 'src'"),
    ("deliver", dict(DELIVER, direct=dict(DELIVER["direct"], addrs=[1, 2.5])),
     r"deliver.direct.addrs\[1\]: expected int, got float"),
    ("call", {"tenant": "t", "client": 1, "template": b"", "base": 0, "inputs": [], "exes": {"e": 3}, "frees": []},
     r"call.exes\['e'\]: expected bytes, got int"),
    ("fetch", {"tenant": "t", "id": 1, "timeout": "soon", "ready_only": False},
     "fetch.timeout: expected float, got str"),
])
def test_a_malformed_message_names_the_field(kind, body, error):
    with pytest.raises(WireFormatError, match=error):
        wire.encode(kind, body)


def test_template_ops_are_checked_by_their_kind():
    op = {"op": "exec", "exe": "e", "slice": "s", "in": [], "out": [1], "in_specs": [[None, ["a", 3]]],
          "out_specs": [], "name": "f"}
    template = {"program": "p", "n_inputs": 0, "n_values": 2, "slices": {}, "ops": [op]}
    with pytest.raises(WireFormatError, match=r"template.ops\[0\]\(exec\).in_specs\[0\]\[1\]: expected str, got list"):
        wire.decode(wire.encode("template", template))
    with pytest.raises(WireFormatError, match=r"template.ops\[0\]: unknown op 'jump'"):
        wire.decode(wire.encode("template", dict(template, ops=[{"op": "jump"}])))
    ok = dict(op, in_specs=[[None, ["a", "b"], "c"]])
    assert wire.decode(wire.encode("template", dict(template, ops=[ok])))["ops"][0]["in_specs"] == ok["in_specs"]
