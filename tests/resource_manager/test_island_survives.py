"""An island keeps serving every tenant whatever one client sends, or however it dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_stats, tenant_env
from jax.sharding import PartitionSpec as P

import pathways as pw
from benchmarks.fuzz_island import Fuzzer, run
from client.array import Array
from client.session import Session
from client.slices import VirtualSlice
from pathways.messages import Call, Put
from pathways.ops import Aval, Recv, Route, Send
from pathways.requests import Allocate, Batch


@pytest.fixture(scope="module")
def intruder(cluster):
    """A second session in this process, of tenant "careless": it sends what a buggy or hostile client would."""
    session = Session(cluster.address, "careless", cluster.timeouts, tenant_env("careless")["PATHWAYS_CREDENTIAL"])
    wire = session.request(lambda rid: Allocate(rid, [2], ["x"], 0), "allocate")
    yield session, VirtualSlice(session, wire)
    session.close()


def put_inputs(fuzzer: Fuzzer) -> tuple[int, int]:
    """Two fresh buffers of the fuzzer's session on its slice, holding its value: valid inputs of its template."""
    ids = (fuzzer.session.mint(), fuzzer.session.mint())
    for buffer_id in ids:
        put = Put(buffer_id, fuzzer.slice.desc(), (), Aval((8,), "float32"))
        fuzzer.send(put.encode(), fuzzer.upload(buffer_id, fuzzer.value))
    return ids


def its_output(session: Session, s: VirtualSlice, buffer_id: int) -> Array:
    """A handle on a buffer the session's raw message should have produced (or failed)."""
    return Array(session, buffer_id, (8,), np.float32, s, P(), frozenset({0}))


@pytest.mark.parametrize("case, error, words", [
    ("free of slot -5", pw.ProgramError, r"slot\(s\) \[-5\] out of range"),
    ("read of an unwritten slot", pw.ProgramError, "which no earlier op wrote"),
    ("unknown executable", pw.ProgramError, "was never sent"),
    ("receive of 16 EiB", pw.ResourceError, "GiB"),
    ("send to island 7", pw.ResourceError, "island 7 is not an island of this cluster"),
    ("another client's inputs", pw.TenantAccessError, "not one of your client's ids"),
    ("empty inputs", pw.ProgramError, "takes 2 inputs"),
])
def test_a_meaningless_call_fails_alone_with_its_reason(cluster, intruder, case, error, words):
    session, s = intruder
    fuzzer = Fuzzer(session, s, seed=0)
    t, op = fuzzer.template, fuzzer.template.ops[0]
    from dataclasses import replace
    desc = s.desc()
    variants = {
        "free of slot -5": (replace(t, ops=(replace(op, frees=(-5,)),)), {}),
        "read of an unwritten slot": (replace(t, n_values=5, ops=(replace(op, inputs=(0, 4)),)), {}),
        "unknown executable": (replace(t, ops=(replace(op, exe="ab" * 32),)), {"exes": {}}),
        "receive of 16 EiB": (replace(t, n_values=4, ops=(op, Recv(3, desc.key, (), Aval((2**31, 2**31), "float32"),
                                                                   1, (Route(0, 0, (((0, 1), (0, 1)),)),)))), {}),
        "send to island 7": (replace(t, n_values=4, ops=(op, Send(2, 3, 7, ()))), {}),
        "another client's inputs": (t, {"inputs": ((session.client_id + 7) << 40, (session.client_id + 7) << 40)}),
        "empty inputs": (t, {"inputs": ()}),
    }
    template, changes = variants[case]
    base = session.mint(template.n_values)
    body = {"template": template.encode(), "base": base, "inputs": put_inputs(fuzzer),
            "exes": {fuzzer.exe: fuzzer.blob}, "frees": (), **changes}
    session.outboxes.put(0, Call(**body).encode())
    with pytest.raises(error, match=words):
        its_output(session, s, base + 2).fetch(timeout=20)
    with pw.slice((2,), ("x",), island=0) as mine:  # everyone else's work runs
        np.testing.assert_allclose(np.asarray(pw.jit(lambda v: v * 3.0, slice=mine)(pw.put(np.ones(2), mine))), 3.0)


def test_a_put_whose_upload_lies_fails_that_put_only(cluster, intruder):
    session, s = intruder
    fuzzer = Fuzzer(session, s, seed=0)
    cases = [("its bytes are fewer than its shards", pw.WireFormatError, "the shards take 32 bytes",
              {"data": fuzzer.value[:3]}),
             ("another dtype", pw.ProgramError, "does not match", {"dtype": "int32"}),
             ("an unknown dtype", pw.WireFormatError, "unknown dtype", {"dtype": "nope"})]
    for _, error, words, lie in cases:
        buffer_id = session.mint()
        put = Put(buffer_id, s.desc(), (), Aval((8,), "float32"))
        fuzzer.send(put.encode(), fuzzer.upload(buffer_id, fuzzer.value, **lie))
        with pytest.raises(error, match=words):
            its_output(session, s, buffer_id).fetch(timeout=20)
    without = session.mint()  # no upload at all: the put waits for its value for the op timeout, then fails
    session.outboxes.put(0, Put(without, s.desc(), (), Aval((8,), "float32")).encode())
    with pw.slice((2,), ("x",), island=0) as mine:  # meanwhile everyone else's work runs
        np.testing.assert_allclose(np.asarray(pw.jit(lambda v: v * 3.0, slice=mine)(pw.put(np.ones(2), mine))), 3.0)


def test_hundreds_of_fuzzed_messages_never_stop_another_tenants_work(cluster, intruder):
    session, _ = intruder
    result = run(cluster, session, island=0, n=300, seed=1, timeout=20.0)
    assert (result["wedged"], result["crashed"], result["executor_deaths"]) == (0, 0, 0), result["failures"][:5]
    assert result["served"] == result["messages"] == 300
    assert all(h.alive for h in pw.status().islands[0].hosts) and pw.status().islands[0].healthy


def test_an_absurd_output_shape_is_a_resource_error_not_an_abort(cluster, intruder):
    with pw.slice((1,), ("x",), island=0) as s:
        for shape in ((2**31, 2**31), (2**17, 2**17)):  # overflows XLA's size; 64 GiB, more than this host
            huge = pw.jit(lambda shape=shape: jnp.zeros(shape, jnp.float32), slice=s, name="huge")
            with pytest.raises(pw.ResourceError, match="needs .* GiB on a host of island 0"):
                huge()
    # a client that skips its own check: the host refuses before it compiles, and lives
    session, mine = intruder
    huge = pw.jit(lambda: jnp.zeros((2**31, 2**31), jnp.float32), slice=mine, name="huge")
    exported = huge.export(mine, huge.bind((), {}), [])
    from pathways.ops import Exec, Template
    desc = mine.desc()
    template = Template("huge", 0, 1, {desc.key: desc}, (Exec(exported.exe, desc.key, (), (0,), (), ((),), "huge"),))
    base = session.mint(1)
    session.outboxes.put(0, Call(template.encode(), base, (), {exported.exe: exported.blob}, ()).encode())
    with pytest.raises(pw.ResourceError, match="overflows"):
        its_output(session, mine, base).fetch(timeout=30)
    assert pw.status().islands[0].healthy and pw.status().islands[0].epoch == 0
    with pw.slice((2,), ("x",), island=0) as s:
        np.testing.assert_allclose(np.asarray(pw.jit(lambda v: v - 1.0, slice=s)(pw.put(np.ones(2), s))), 0.0)


CRASH_AFTER_PUT = textwrap.dedent("""
    import os, sys, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import pathways as pw
    pw.init()
    s = pw.slice((2,), ("x",), island=0)
    slow = pw.jit(lambda m: jax.lax.fori_loop(0, 30, lambda i, a: jnp.tanh(a @ m), m), slice=s)
    m = pw.put(np.eye(256, dtype=np.float32), s)
    outs = [slow(m) for _ in range(80)]  # the island is busy: the put below waits behind them
    x = pw.put(np.ones((512, 512), np.float32), s)
    y = slow(x)
    session = pw.init()
    session.flush()  # the island has the put (queued behind the work), not yet its value
    print("sent", flush=True)
    os._exit(0)  # gone before the island fetched the put's value
""")


def test_a_client_that_dies_right_after_a_put_leaves_the_island_serving(cluster):
    before = pw.admin().state()["reclaimed"]
    proc = subprocess.run([sys.executable, "-c", CRASH_AFTER_PUT], env=tenant_env("crasher"), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0 and "sent" in proc.stdout, proc.stderr[-2000:]
    with pw.slice((2,), ("x",), island=0) as s:  # another tenant's work runs, in bounded time
        np.testing.assert_allclose(pw.jit(lambda v: v + 2.0, slice=s)(pw.put(np.ones(2), s)).fetch(timeout=60), 3.0)
    script = ("import numpy as np, pathways as pw\npw.init()\ns = pw.slice((2,), ('x',), island=0)\n"
              "print(float(pw.jit(lambda v: v.sum(), slice=s)(pw.put(np.ones(4), s)).fetch(timeout=60)))\n")
    new_client = subprocess.run([sys.executable, "-c", script], env=tenant_env("newcomer"), capture_output=True,
                                text=True, timeout=180)
    assert new_client.returncode == 0 and new_client.stdout.strip().endswith("4.0"), new_client.stderr[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(pw.admin().state()["reclaimed"]) == len(before):
        time.sleep(0.5)
    assert any(r["tenant"] == "crasher" for r in pw.admin().state()["reclaimed"])
    assert pw.status().islands[0].healthy and host_stats(cluster, 0)["dead"] == ""


def test_a_stream_gap_that_never_fills_holds_back_only_its_own_client(cluster):
    session = Session(cluster.address, "gappy", cluster.timeouts, tenant_env("gappy")["PATHWAYS_CREDENTIAL"])
    s = VirtualSlice(session, session.request(lambda rid: Allocate(rid, [2], ["x"], 0), "allocate"))
    fuzzer = Fuzzer(session, s, seed=3)
    inputs = put_inputs(fuzzer)  # messages 0 and 1 of its stream
    session.flush()
    base = session.mint(3)
    payload = Call(fuzzer.template.encode(), base, inputs, {fuzzer.exe: fuzzer.blob}, ()).encode()
    # message 5, as if 2 to 4 were lost on the way: it waits for them
    session.link(0, 0).send(Batch(0, 5, [payload]).encode())
    with pw.slice((2,), ("x",), island=0) as mine:  # meanwhile everyone else is served at once
        start = time.monotonic()
        np.testing.assert_allclose(pw.jit(lambda v: v * 2.0, slice=mine)(pw.put(np.ones(2), mine)).fetch(timeout=20),
                                   2.0)
        assert time.monotonic() - start < 10
    stats = host_stats(cluster, 0)
    assert stats["stream_gaps_waiting"] >= 1
    # after the gap timeout the island gives up on the missing messages and runs the rest
    out = its_output(session, s, base + 2).fetch(timeout=cluster.timeouts.gap + 30)
    np.testing.assert_allclose(out, np.arange(8, dtype=np.float32) ** 2 + 1.0)
    session.close()


def test_a_connection_from_outside_the_runtime_is_refused_by_the_hosts_socket(cluster):
    import socket as sockets

    from resource_manager.host.transport.channel import HEADER
    path = cluster.islands[1].hosts[0].get("channel")
    if not path:
        pytest.skip("no same-node channel on this platform")
    before = host_stats(cluster, 1)["channel_refused"]
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.settimeout(10)
        try:
            conn.sendall(HEADER.pack(1 << 30, 0))
            assert conn.recv(1) == b""  # closed without reading a byte
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed before it read what was sent
    assert host_stats(cluster, 1)["channel_refused"] == before + 1
    assert pw.status().islands[1].healthy


def test_weights_must_be_finite_and_positive(cluster):
    admin = pw.admin()
    for weight in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(pw.ResourceError, match="finite number"):
            admin.set_tenant(cluster.tenant, weight=weight)
    assert json.dumps([t for t in admin.tenants() if t["name"] == cluster.tenant][0]["weight"]) == "1.0"
    assert os.environ.get("PATHWAYS_WEIGHT") is None
