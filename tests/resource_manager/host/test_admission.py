"""Admission on host 0: each client's stream back in order, gaps skipped, each message checked in meaning."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pathways as pw
from pathways.budgets import Budgets
from pathways.messages import CLIENT_ID_BITS, MAX_BATCH, MAX_CALLS, Call, Calls, Free, Put, decode_request
from pathways.ops import Aval, Exec, Limits, SliceDesc, Template
from resource_manager.host.admission import Admission
from resource_manager.host.executables import ExecutableCache
from resource_manager.host.grants import Grants
from resource_manager.host.rows import Message

LIMITS = Limits(0, 2, 1, 4, 1 << 30, 1 << 30)
DESC = SliceDesc("s1", (2,), ("x",), ((0, 0), (0, 1)))
CLIENT = 3


def admission(gap_timeout: float = 60.0) -> Admission:
    grants = Grants()
    grants.add_session(CLIENT, "alice", b"k" * 32)
    grants.grant("s1", "alice", DESC)
    grants.grant("s2", "bob", SliceDesc("s2", (1,), ("x",), ((0, 2),)))
    return Admission(LIMITS, grants, ExecutableCache(LIMITS), gap_timeout)


def ids(k: int) -> int:
    return (CLIENT << CLIENT_ID_BITS) + k


def empty_call(k: int, **changes) -> bytes:
    template = Template("p", 0, 1, {}, ())
    fields = {"template": template.encode(), "base": ids(k), "inputs": (), "exes": {}, "frees": ()}
    return Call(**{**fields, **changes}).encode()


def test_a_batch_that_overtook_an_earlier_one_waits_for_it():
    a = admission()
    assert a.accept(CLIENT, "alice", 2, [empty_call(20)]) == []
    assert a.waiting() == 1
    done = a.accept(CLIENT, "alice", 0, [empty_call(0), empty_call(10)])
    assert [e.request.base for e in done] == [ids(0), ids(10), ids(20)] and a.waiting() == 0
    with pytest.raises(pw.WireFormatError, match="a message is sent once"):
        a.accept(CLIENT, "alice", 1, [empty_call(30)])


def test_a_gap_that_never_fills_is_skipped_after_its_timeout_or_when_the_client_is_revoked():
    a = admission(gap_timeout=0.2)
    assert a.accept(CLIENT, "alice", 5, [empty_call(50)]) == []
    assert a.expire() == []
    time.sleep(0.3)
    assert [e.request.base for e in a.expire()] == [ids(50)] and a.skipped == 5
    a.accept(CLIENT, "alice", 9, [empty_call(90)])
    a.revoke(CLIENT)
    assert a.waiting() == 0 and a.expire() == []


@pytest.mark.parametrize("payload, error, words", [
    (b"garbage", pw.WireFormatError, "undecodable"),
    (empty_call(1, base=(7 << CLIENT_ID_BITS)), pw.TenantAccessError, "not one of your client's ids"),
    (empty_call(1, inputs=(5,)), pw.ProgramError, "takes 0 inputs"),
    (empty_call(1, template=Template("p", 0, 2, {"s2": SliceDesc("s2", (1,), ("x",), ((0, 2),))}, ()).encode()),
     pw.TenantAccessError, "slice s2 on island 0 is not yours"),
    (empty_call(1, template=Template("p", 0, 2, {"s1": DESC}, (Exec("cd" * 32, "s1", (), (1,), (), ((),), "f"),)
                                     ).encode()), pw.ProgramError, "f: executable cdcdcdcdcdcd"),
    (empty_call(1, exes={"ab" * 32: b"junk"}), pw.WireFormatError, "do not match their hash"),
    (Put(ids(1), DESC, (), Aval((2**31, 2**31), "float32")).encode(), pw.ResourceError, "GiB"),
    (Put(ids(1), DESC, ("y",), Aval((8,), "float32")).encode(), pw.ProgramError, "axes"),
])
def test_a_message_wrong_in_meaning_is_refused_alone_with_the_ids_it_would_have_made(payload, error, words):
    a = admission()
    done = a.accept(CLIENT, "alice", 0, [payload, empty_call(9)])
    refused, fine = done
    assert fine.refusal is None and fine.request.base == ids(9)
    assert refused.refusal is not None and refused.refusal.kind == error.__name__, refused.refusal
    assert words in refused.refusal.message or __import__("re").search(words, refused.refusal.message)
    if refused.fail_hi:  # its outputs' ids fail, and never ids outside the sender's space
        assert refused.fail_lo >> CLIENT_ID_BITS == CLIENT


def test_merged_calls_are_checked_one_by_one_and_refused_alone():
    """A ``Calls`` message is what its calls would say alone: each is admitted or refused on its own (a wrong id
    fails only that call's outputs), and a call of it goes to the island's other hosts as the message it would be
    alone."""
    template = Template("p", 0, 1, {}, ()).encode()
    calls = [Call(template, ids(10), (), {}, ()), Call(template, 7 << CLIENT_ID_BITS, (), {}, ()),
             Call(template, ids(30), (), {}, (ids(10),))]
    a = admission()
    good, bad, last = a.accept(CLIENT, "alice", 0, [Calls.merge(calls).encode(), empty_call(40)])[:3]
    assert good.refusal is None and good.request == calls[0] and last.request == calls[2]
    assert bad.refusal.kind == "TenantAccessError" and bad.fail_hi == 0  # never fails ids outside its space
    assert decode_request(Message.of(last).payload) == calls[2]  # another host decodes it as the call alone
    assert a.position(CLIENT) == 2  # a merged message is one message of the stream


@pytest.mark.parametrize("merged, words", [
    (Calls(b"t", [ids(1), ids(3)], [ids(0)], [], [0, 0]), "do not make 2 calls"),  # inputs not a multiple
    (Calls(b"t", [ids(1)], [], [ids(0)], [0]), "do not make 1 calls"),  # frees not counted
    (Calls(b"t", [ids(1)], [], [ids(0)], [-1]), "do not make 1 calls"),
    (Calls(b"t", [ids(k) for k in range(MAX_CALLS + 1)], [], [], [0] * (MAX_CALLS + 1)), "a message merges 1 to"),
    (Calls(b"t", [], [], [], []), "a message merges 1 to"),
])
def test_a_merged_message_that_does_not_add_up_is_refused_whole(merged, words):
    a = admission()
    refused, fine = a.accept(CLIENT, "alice", 0, [merged.encode(), empty_call(9)])
    assert refused.refusal.kind == "WireFormatError" and words in refused.refusal.message
    assert fine.refusal is None and fine.request.base == ids(9)


def test_a_batch_carries_at_most_max_batch_calls_counted_one_by_one():
    """Merging does not let a batch carry more calls than it could carry messages: past ``MAX_BATCH`` calls, a
    merged message is refused whole (one entry, whatever it announced)."""
    template = Template("p", 0, 1, {}, ()).encode()
    n = MAX_BATCH // MAX_CALLS
    merged = [Calls(template, [ids(k * MAX_CALLS + j + 1) for j in range(MAX_CALLS)], [], [], [0] * MAX_CALLS).encode()
              for k in range(n + 1)]
    done = admission().accept(CLIENT, "alice", 0, merged)
    assert len(done) == MAX_BATCH + 1 and all(e.refusal is None for e in done[:MAX_BATCH])
    assert "more than 65536 calls" in done[-1].refusal.message


def test_frees_of_ids_outside_the_clients_space_are_dropped():
    a = admission()
    (entry,) = a.accept(CLIENT, "alice", 0, [Free((ids(1), -4, 7 << CLIENT_ID_BITS)).encode()])
    assert entry.request.ids == (ids(1),)


def test_an_executable_budget_refuses_what_would_go_over_it():
    import jax
    import jax.numpy as jnp

    cache = ExecutableCache(LIMITS, blob_budget=10_000)
    blobs = [bytes(jax.export.export(jax.jit(lambda v, k=k: jnp.sin(v) * k))(
        jax.ShapeDtypeStruct((4,), np.float32)).serialize()) for k in range(1, 8)]
    from resource_manager.host.executables import content_hash

    with pytest.raises(pw.ResourceError, match="over your executable_bytes budget"):
        for blob in blobs:
            cache.add("alice", content_hash(blob), blob)
    assert cache.has("alice", content_hash(blobs[0])) and not cache.has("bob", content_hash(blobs[0]))
    cache.add("bob", content_hash(blobs[0]), blobs[0])  # another tenant's budget is its own
    cache.drop_tenant("alice")
    assert not cache.has("alice", content_hash(blobs[0])) and cache.has("bob", content_hash(blobs[0]))


def test_a_program_over_the_tenants_program_ops_budget_is_refused_before_it_is_decoded():
    from pathways.budgets import Budgets
    from pathways.ops import Send

    a = admission()
    a.grants.set_budgets("alice", Budgets(program_ops=10))
    ops = tuple(Send(0, 1, 1, ()) for _ in range(20))
    many = Template("many", 1, 2, {"s1": DESC}, ops).encode()
    (refused,) = a.accept(CLIENT, "alice", 0, [empty_call(1, template=many, inputs=(ids(100),))])
    assert refused.refusal.kind == "ResourceError" and "over your program_ops budget" in refused.refusal.message
    import msgpack

    from pathways import wire

    header = msgpack.packb([wire.VERSION, "template", "p", 1, 2, {}, [1] * 3])[:-2]  # ops: announcing 3, cut short
    calls = [Template("huge", 1, 2, {"s1": DESC}, tuple(Send(0, 1, 1, ()) for _ in range(5000))).encode(), header]
    for k, blob in enumerate(calls):  # counted without decoding: a cut-off header is enough to know
        (refused,) = a.accept(CLIENT, "alice", 1 + k, [empty_call(2 + k, template=blob, inputs=(ids(100),))])
        assert ("over your program_ops budget" in refused.refusal.message) == (k == 0), refused.refusal


def test_a_huge_program_is_refused_fast_and_alone():
    """Ten programs of 131k ops each once took the island's admission 4.7 s apiece to decode, and another tenant's
    one-op program waited behind them. Over ``program_ops`` a call is refused alone with a ResourceError naming
    the budget, read from the template's bytes without decoding it, its outputs failed; the next message, and
    another tenant's, go on."""
    a = admission()
    a.grants.add_session(4, "bob", b"b" * 32)
    limit = Budgets().program_ops
    noop = Exec("cd" * 32, "s1", (0,), (1,), ((),), ((),), "f")
    huge = Template("huge", 1, 2, {"s1": DESC}, (noop,) * (limit + 1)).encode()
    start = time.perf_counter()
    refused, fine = a.accept(CLIENT, "alice", 0, [empty_call(1, template=huge, inputs=(ids(0),)),
                                                 empty_call(9)])
    assert time.perf_counter() - start < 0.5  # decoding it would take seconds
    assert refused.refusal.kind == "ResourceError" and "program_ops budget" in refused.refusal.message
    assert f"needs {limit + 1} ops more, over the limit of {limit} ops" in refused.refusal.message
    assert (refused.fail_lo, refused.fail_hi) == (ids(1), ids(3)) and fine.refusal is None
    (other,) = a.accept(4, "bob", 0, [Call(Template("p", 0, 1, {}, ()).encode(), 4 << CLIENT_ID_BITS, (), {},
                                           ()).encode()])
    assert other.refusal is None


def test_batches_held_ahead_of_the_stream_count_against_their_tenants_budgets():
    a = admission(gap_timeout=60.0)
    a.grants.set_budgets("alice", Budgets(ahead_batches=3, ahead_bytes=1 << 20))
    for k in range(1, 3):  # message 0 never comes: each batch after it waits
        assert a.accept(CLIENT, "alice", k, [empty_call(k)]) == []
    big = [empty_call(10 + k) + b"\0" * (300 << 10) for k in range(4)]  # 1.2 MiB in one batch
    with pytest.raises(pw.ResourceError, match="ahead_bytes"):
        a.accept(CLIENT, "alice", 10, big)
    assert a.accept(CLIENT, "alice", 3, [empty_call(3)]) == []
    with pytest.raises(pw.ResourceError, match="ahead_batches"):
        a.accept(CLIENT, "alice", 4, [empty_call(4)])
    assert a.ahead("alice")[0] == 3 and a.waiting() == 3
    done = a.accept(CLIENT, "alice", 0, [empty_call(0)])  # the gap fills: what waited goes, and counts no more
    assert len(done) == 4 and a.ahead("alice") == (0, 0)
    a.accept(CLIENT, "alice", 6, [empty_call(6)])
    a.revoke(CLIENT)
    assert a.ahead("alice") == (0, 0)
