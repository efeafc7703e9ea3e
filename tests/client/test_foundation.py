"""The basics on a live cluster: starting it, slices, compiled functions on slices, arrays and their frees,
refused messages, and errors."""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import answer_to, host_stats, raw_connection, settle, tenant_env
from jax.sharding import PartitionSpec as P

import pathways as pw
from pathways import wire


def test_quickstart_matches_numpy(cluster):
    s = pw.slice((2, 2), ("data", "model"))
    a = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    x = pw.put(a, s, P("data", None))
    f = pw.jit(lambda v: jnp.tanh(v) @ v.T, slice=s, in_specs=(P("data", None),), out_specs=P())
    y = f(x)
    assert isinstance(y, pw.Array) and y.shape == (4, 4) and y.dtype == np.float32
    np.testing.assert_allclose(np.asarray(y), np.tanh(a) @ a.T, rtol=1e-5)
    s.release()


def test_init_is_idempotent(cluster):
    assert pw.init() is cluster
    assert pw.init(topology=pw.Topology(2, 1, 4)) is cluster


def test_slices_balance_across_islands_and_release(cluster):
    before = {a["key"] for a in pw.status().allocations}
    with pw.slice((4,), ("x",)) as a, pw.slice((4,), ("x",)) as b:
        assert {a.island, b.island} == {0, 1}
        assert len(set(a.devices)) == 4 and all(h == 0 for h, _ in a.devices)
        keys = {x["key"] for x in pw.status().allocations}
        assert {a.key, b.key} <= keys
    assert {x["key"] for x in pw.status().allocations} == before
    c = pw.slice((2,), ("x",), island=1)
    assert c.island == 1 and len(c.devices) == 2
    pw.release(c)
    assert c.key not in {x["key"] for x in pw.status().allocations}


@pytest.mark.parametrize("shape, axes, island, words", [
    ((4, 4), ("a", "b"), None, ["16 devices", "largest island has 4"]),
    ((2,), ("x",), 7, ["island 7", "does not exist"]),
    ((2, 2), ("x",), None, ["axis names", "one name per dimension"]),
])
def test_impossible_slices_raise_resource_error(cluster, shape, axes, island, words):
    with pytest.raises(pw.ResourceError) as info:
        pw.slice(shape, axes, island=island)
    for word in words:
        assert word in str(info.value)
    assert "the cluster has 2 island(s)" in str(info.value) or "axis names" in str(info.value)


def test_compile_once_per_shape_and_reexport_on_new_shape(cluster):
    with pw.slice((2,), ("x",), island=0) as s:
        f = pw.jit(lambda v: v * 3.0 + 1.0, slice=s, in_specs=(P("x"),), out_specs=P("x"))
        x = pw.put(np.ones(8, np.float32), s, P("x"))
        np.testing.assert_allclose(np.asarray(f(x)), 4.0)
        compiles = host_stats(cluster, 0)["compiles"]
        hits = host_stats(cluster, 0)["cache_hits"]
        np.testing.assert_allclose(np.asarray(f(x)), 4.0)
        assert host_stats(cluster, 0)["compiles"] == compiles
        assert host_stats(cluster, 0)["cache_hits"] > hits
        y = pw.put(np.ones(6, np.float32), s, P("x"))
        np.testing.assert_allclose(np.asarray(f(y)), 4.0)
        assert host_stats(cluster, 0)["compiles"] == compiles + 1
        assert len(f._exports) == 2


def test_mismatches_raise_program_error(cluster):
    with pw.slice((2,), ("x",), island=0) as s, pw.slice((2,), ("x",), island=1) as t:
        f = pw.jit(lambda a, b: a @ b, slice=s)
        a = pw.put(np.ones((3, 4), np.float32), s)
        with pytest.raises(pw.ProgramError, match="cannot run on arguments"):
            f(a, a)
        g = pw.jit(lambda v: v + 1, slice=s, in_specs=(P("x"),))
        with pytest.raises(pw.ProgramError, match="not divisible"):
            g(pw.put(np.ones(3, np.float32), s))
        elsewhere = pw.put(np.ones(4, np.float32), t)
        with pytest.raises(pw.ProgramError, match="lives on"):
            g(elsewhere)
        with pytest.raises(pw.ProgramError, match="in_specs has 1 entries"):
            pw.jit(lambda a, b: a + b, slice=s, in_specs=(P(),))(a, a)


def test_array_handle_properties_and_fetch(cluster):
    with pw.slice((2, 2), ("data", "model"), island=1) as s:
        value = np.arange(24, dtype=np.int32).reshape(4, 6)
        x = pw.put(value, s, P("data", "model"))
        assert x.shape == (4, 6) and x.dtype == np.int32 and x.slice is s and x.spec == P("data", "model")
        assert x.block_until_ready(timeout=30) is x
        np.testing.assert_array_equal(x.fetch(timeout=30), value)
        np.testing.assert_array_equal(np.asarray(x), value)
        f64 = pw.put(np.ones(2), s)
        assert f64.dtype == np.float32  # canonicalized the way JAX would
        scalar = pw.put(np.int32(7), s)
        assert scalar.shape == () and np.asarray(scalar).shape == () and int(np.asarray(scalar)) == 7


def test_buffers_are_freed_when_handles_are_dropped(cluster):
    start = settle(cluster)
    with pw.slice((2,), ("x",), island=0) as s:
        f = pw.jit(lambda v: v * 2.0, slice=s)
        arrays = [pw.put(np.full(4, i, np.float32), s) for i in range(10)]
        outs = [f(a) for a in arrays]
        np.testing.assert_allclose(np.asarray(outs[-1]), 18.0)
        assert settle(cluster)[0] == start[0] + 20
        del arrays, outs
        gc.collect()
        assert settle(cluster, expect=start) == start


def test_garbage_and_unauthenticated_messages_are_refused_and_endpoints_keep_serving(cluster):
    from pathways.protocol.connection import connect

    fetch = wire.encode("fetch", {"rid": 1, "id": 1, "timeout": 1.0, "ready_only": True})
    assert fetch[:2] == bytes([0x96, wire.VERSION])  # an array of 6: the version, the kind, four fields
    wrong_version = fetch[:1] + b"\x07" + fetch[2:]
    for where in (0, None):  # a host, then the resource manager
        conn = raw_connection(cluster, where)
        for bad in (b"garbage", b"\x81\xa1v\x63", wire.encode("free", {"ids": []})[:-2], wrong_version):
            answer = answer_to(conn, bad)  # the connection is authenticated; the message is not one
            assert not answer.ok and answer.value[0] == "WireFormatError" and answer.rid == -1, answer
        assert "unsupported wire version 7" in answer.value[1]
        conn.close()
    with pytest.raises(pw.TenantAccessError, match="unknown or expired session"):  # a session with the wrong key
        raw_connection(cluster, 0, key=b"x" * 32)
    with pytest.raises(pw.TenantAccessError, match="takes only sessions"):  # a host takes no anonymous client
        raw_connection(cluster, 0, key=b"")
    addr = cluster.islands[0].hosts[0]["client"].removeprefix("pathways://")
    with socket.create_connection(tuple([addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1])]), timeout=10) as raw:
        raw.recv(4096)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)  # not the protocol at all: dropped
    with pytest.raises(pw.PathwaysError, match="does not speak the pathways protocol"):
        connect(_http_server(), 0, None, lambda i: None, 1, 1, timeout=5)
    with pw.slice((2,), ("x",), island=0) as s:
        np.testing.assert_allclose(np.asarray(pw.jit(lambda v: v - 1.0, slice=s)(pw.put(np.ones(2), s))), 0.0)


def _http_server() -> str:
    """An address where something that is not the runtime answers (a client pointed at the wrong port)."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 64)
        conn.close()
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def test_a_fetch_that_times_out_says_where_the_program_stopped(cluster):
    def slow(v):  # 0.5 TFLOP: 1.5 s at this machine's peak, far longer than the fetch waits
        return jax.lax.fori_loop(0, 2000, lambda _, a: jnp.tanh(a @ a), v)

    with pw.slice((1,), ("x",), island=0) as s0, pw.slice((1,), ("x",), island=1) as s1:
        grind, inc = pw.jit(slow, slice=s0, name="grind"), pw.jit(lambda v: v + 1.0, slice=s1, name="inc")
        out = pw.program(lambda v: inc(pw.transfer(grind(v), s1)))(pw.put(np.eye(512, dtype=np.float32), s0))
        with pytest.raises(pw.IslandFailedError, match="timed out") as info:
            out.block_until_ready(timeout=0.2)
        message = str(info.value)
        assert "island 1 host 0: program" in message and "from island 0" in message, message
        out.block_until_ready(timeout=60)


def test_a_second_process_sees_the_same_cluster_but_not_another_tenants_slices(cluster):
    with pw.slice((3,), ("x",), island=1) as mine:
        script = textwrap.dedent("""
            import json, numpy as np, pathways as pw
            pw.init()  # address, tenant and credential from the environment
            st = pw.status()
            other = pw.slice((1,), ("x",), island=0)
            kept = [pw.jit(lambda v: v * 2, slice=other)(pw.put(np.ones(3), other)) for _ in range(4)]
            kept[-1].block_until_ready()
            print(json.dumps({"islands": len(st.islands), "keys": [a["key"] for a in st.allocations],
                              "others": st.others, "topology": str(st.topology), "other": other.key,
                              "tenants": sorted(st.tenants)}))
            pw.shutdown()
        """)
        proc = subprocess.run([sys.executable, "-c", script], env=tenant_env("visitor"), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen["islands"] == 2 and seen["topology"] == str(cluster.topology)
        assert seen["keys"] == [] and seen["tenants"] == ["visitor"]  # our slice is a count to it, not a name
        assert seen["others"]["slices"] >= 1 and seen["others"]["devices"] >= 3
        assert mine.key not in json.dumps(seen) or mine.key == seen["other"]
        # the other client's slice and buffers went away with its session, and the cluster is still ours
        assert seen["other"] not in {a["key"] for a in pw.admin().state()["allocations"]}
        deadline = time.monotonic() + 20
        while "visitor" in pw.admin().usage()[0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "visitor" not in pw.admin().usage()[0]  # its buffer count is back to zero
    assert pw.status().islands[1].healthy
