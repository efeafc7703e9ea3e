"""The wire format: what it accepts, size limits, and errors that name the field that was wrong."""

from __future__ import annotations

import msgpack
import pytest

from pathways import wire
from pathways.errors import WireFormatError
from pathways.messages import Deliver, Lending, decode_request
from pathways.requests import Fetch

DELIVER = Deliver(7, 0, 1, (((0, 1024), (0, 512)),), direct=Lending(3, (4096,), "/tmp/x/host.sock"))


def body(msg: bytes) -> dict:
    return {k: v for k, v in wire.decode(msg).items() if k not in ("v", "kind")}


def test_typed_messages_round_trip():
    assert Deliver.from_wire(wire.decode(DELIVER.encode(), "deliver")) == DELIVER
    fetch = wire.encode("fetch", {"rid": 9, "id": 1, "timeout": 2, "ready_only": False})  # msgpack sends 2.0 as 2
    assert wire.parse(fetch, Fetch) == Fetch(9, 1, 2.0, False)
    with pytest.raises(WireFormatError, match="finite number of seconds"):  # checked in meaning, not only schema
        wire.parse(wire.encode("fetch", {"rid": 9, "id": 1, "timeout": float("inf"), "ready_only": False}), Fetch)


@pytest.mark.parametrize("kind,changes,error", [
    ("deliver", {"key": True}, "deliver.key: expected int, got bool"),
    ("deliver", {"shards": [[[0, "8"]]]}, r"deliver.shards\[0\]\[0\]\[1\]: expected int, got str"),
    ("deliver", {"src": None}, "deliver.src: expected int, got NoneType"),
    ("deliver", {"direct": {"lease": 3, "addrs": [1, 2.5], "channel": ""}},
     r"deliver.direct.addrs\[1\]: expected int, got float"),
    ("call", {"template": b"", "base": 0, "inputs": [], "exes": {"e": 3}, "frees": []},
     r"call.exes\['e'\]: expected bytes, got int"),
    ("fetch", {"rid": 1, "id": 1, "timeout": "soon", "ready_only": False}, "fetch.timeout: expected float, got str"),
])
def test_a_malformed_message_names_the_field(kind, changes, error):
    base = body(DELIVER.encode()) if kind == "deliver" else {}
    with pytest.raises(WireFormatError, match=error):
        wire.encode(kind, {**base, **changes})


def test_a_missing_field_and_an_unknown_kind_are_named():
    with pytest.raises(WireFormatError, match="deliver: missing field 'src'"):
        wire.encode("deliver", {k: v for k, v in body(DELIVER.encode()).items() if k != "src"})
    with pytest.raises(WireFormatError, match="unexpected message kind 'jump'"):
        wire.decode(msgpack.packb({"v": wire.VERSION, "kind": "jump"}))
    with pytest.raises(WireFormatError, match="expected one of: fetch"):
        wire.decode(DELIVER.encode(), "fetch")


def test_garbage_and_other_versions_are_refused():
    for bad in (b"garbage", b"\x81\xa1v\x63", msgpack.packb([1, 2])):
        with pytest.raises(WireFormatError):
            decode_request(bad)
    old = msgpack.packb({"v": 1, "kind": "free", "ids": []})
    with pytest.raises(WireFormatError, match="unsupported wire version 1"):
        decode_request(old)


def test_sizes_have_ceilings(monkeypatch):
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(WireFormatError, match="over the limit of 1000"):
        wire.decode(b"\x00" * 1001)
    with pytest.raises(WireFormatError, match="undecodable"):  # a list announcing more items than allowed
        wire.decode(b"\xdd" + (wire.MAX_ITEMS + 1).to_bytes(4, "big"))
    with pytest.raises(WireFormatError, match="a finite number of seconds"):
        wire.parse(wire.encode("fetch", {"rid": 1, "id": 1, "timeout": float("inf"), "ready_only": False}), Fetch)


def test_a_kind_is_declared_once():
    with pytest.raises(ValueError, match="declared twice"):
        wire.register("fetch", {"id": int})
