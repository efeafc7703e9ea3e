"""Every shared resource a tenant can grow has a budget the admin sets: over it, that tenant's message fails
alone with a ResourceError naming the budget, and nothing of another tenant's changes. Each test plays
"greedy", a tenant of its own with small budgets, against this session ("default")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import answer_to, on_island, raw_connection, tenant_env

import pathways as pw
from client.session import Session
from pathways.budgets import Budgets
from pathways.requests import Fetch

SMALL = {"pending_fetches": 8, "host_bytes": 1 << 20, "sessions": 2, "parked_bytes": 4 << 20, "connections": 4,
         "op_ms": 300}


@pytest.fixture(scope="module")
def greedy(cluster):
    env = tenant_env("greedy")
    pw.admin().set_tenant("greedy", budgets=SMALL)
    session = Session(cluster.address, "greedy", cluster.timeouts, env["PATHWAYS_CREDENTIAL"])
    yield session, env["PATHWAYS_CREDENTIAL"]
    session.close()


@pytest.fixture(scope="module")
def victim(cluster):
    s = pw.slice((2,), ("x",), island=0)
    x = pw.put(np.arange(4.0, dtype=np.float32), s)
    x.block_until_ready()
    yield s, x
    s.release()


def served(victim) -> None:
    """The victim's data and work, unchanged and prompt."""
    s, x = victim
    start = time.monotonic()
    np.testing.assert_array_equal(on_island(x), np.arange(4.0, dtype=np.float32))
    assert time.monotonic() - start < 10


def test_the_admin_sets_budgets_and_the_hosts_learn_them(cluster, greedy):
    listing = {t["name"]: t for t in pw.admin().tenants()}
    assert listing["greedy"]["budgets"]["pending_fetches"] == 8 and listing["default"]["budgets"] == \
        Budgets().to_wire()
    with pytest.raises(pw.ResourceError, match="no budget named 'threads'"):
        pw.admin().set_tenant("greedy", budgets={"threads": 1})


def test_fetches_waiting_for_a_value_hold_no_thread_and_have_a_budget(cluster, greedy, victim):
    """Fetches of a buffer that will never exist, with a long timeout: they wait without holding any of the
    host's threads; past the budget they are refused; the host answers its health checks and everyone else."""
    session, _ = greedy
    never = session.mint()
    conn = raw_connection(session, 0)
    for rid in range(1, 9):
        conn.send(Fetch(rid, never, 3600.0, False).encode())
    answer = answer_to(conn, Fetch(99, never, 3600.0, False).encode())
    assert not answer.ok and answer.value[0] == "ResourceError" and "over your pending_fetches budget" in \
        answer.value[1], answer
    assert session.host_stats(0)["fetches_pending"] == 8
    served(victim)
    assert pw.status().islands[0].healthy and pw.status().islands[0].epoch == 0
    conn.close()  # its waits end with its connection
    deadline = time.monotonic() + 10
    while cluster.host_stats(0)["fetches_pending"] and time.monotonic() < deadline:
        time.sleep(0.1)


def test_host_bytes_over_the_budget_fail_that_tenants_put_or_computation_only(cluster, greedy, victim):
    session, credential = greedy
    from jax.sharding import PartitionSpec as P

    from client.array import put_host
    from client.host_values import as_host_data
    from client.slices import VirtualSlice
    from pathways.requests import Allocate

    s = VirtualSlice(session, session.request(lambda rid: Allocate(rid, [1], ["x"], 0), "allocate"))
    big = put_host(session, as_host_data(np.ones(1 << 19, np.float32), "put"), s, P(), "put")  # 2 MiB
    with pytest.raises(pw.ResourceError, match="over your host_bytes budget"):
        big.fetch(timeout=30)
    small = put_host(session, as_host_data(np.ones(1 << 16, np.float32), "put"), s, P(), "put")  # 256 KiB
    small.block_until_ready(timeout=30)
    with pytest.raises(pw.ResourceError, match="over your parked_bytes budget"):  # refused before it is sent
        put_host(session, as_host_data(np.ones(2 << 20, np.float32), "put"), s, P(), "put")  # 8 MiB
    window, session.parked.limit = session.parked.limit, 1 << 40  # a client that sends it anyway
    try:
        huge_upload = put_host(session, as_host_data(np.ones(2 << 20, np.float32), "put"), s, P(), "put")
    finally:
        session.parked.limit = window
    with pytest.raises(pw.ResourceError, match="over your parked_bytes budget"):  # the host refuses it
        huge_upload.fetch(timeout=30)
    served(victim)


def test_a_client_puts_a_tree_over_its_parked_bytes_by_waiting_for_the_island_to_take_its_first_leaves(cluster):
    """A model's state put at once is more than the bytes a host parks for a tenant: the client sends the rest as the
    island takes the first leaves, and every leaf arrives."""
    from jax.sharding import PartitionSpec as P

    from client.array import put_host
    from client.host_values import as_host_data
    from client.slices import VirtualSlice
    from pathways.requests import Allocate

    env = tenant_env("putter")
    pw.admin().set_tenant("putter", budgets={"parked_bytes": 1 << 20})
    session = Session(cluster.address, "putter", cluster.timeouts, env["PATHWAYS_CREDENTIAL"])
    try:
        s = VirtualSlice(session, session.request(lambda rid: Allocate(rid, [1], ["x"], 0), "allocate"))
        leaves = [put_host(session, as_host_data(np.full(1 << 16, k, np.float32), "put"), s, P(), "put")
                  for k in range(24)]  # 6 MiB back to back, 256 KiB each
        assert [float(leaf.fetch(timeout=60)[-1]) for leaf in leaves] == list(range(24))
    finally:
        session.close()


def test_a_computation_whose_outputs_go_over_host_bytes_never_runs(cluster, greedy, victim):
    _, credential = greedy
    script = textwrap.dedent("""
        import numpy as np, jax.numpy as jnp, pathways as pw
        pw.init()
        s = pw.slice((1,), ("x",), island=0)
        x = pw.put(np.ones(1 << 16, np.float32), s)          # 256 KiB: within the budget of 1 MiB
        y = pw.jit(lambda v: jnp.tile(v, 8), slice=s)(x)     # 2 MiB of outputs: refused before it runs
        try:
            y.fetch(timeout=30)
            print("RAN")
        except pw.ResourceError as exc:
            print("REFUSED", exc)
        print("STILL", float(pw.jit(lambda v: v.sum(), slice=s)(x).fetch(timeout=30)))
    """)
    env = {**os.environ, "PATHWAYS_ADDRESS": cluster.address, "PATHWAYS_TENANT": "greedy",
           "PATHWAYS_CREDENTIAL": credential}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED over your host_bytes budget" in out.stdout and "STILL 65536.0" in out.stdout, \
        out.stdout + out.stderr[-2000:]
    served(victim)


def test_a_program_whose_computation_ran_over_op_ms_runs_no_more(cluster, greedy, victim):
    """A computation cannot be stopped once it runs; one that ran past the tenant's op_ms budget (300 ms here)
    keeps its result, and its program is refused from then on, naming the budget, while the tenant's other
    programs and everyone else's run."""
    _, credential = greedy
    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp, pathways as pw
        pw.init()
        s = pw.slice((1,), ("x",), island=0)
        m = pw.put(np.eye(256, dtype=np.float32), s)
        long = pw.jit(lambda a: jax.lax.fori_loop(0, 4000, lambda i, b: jnp.tanh(b @ a) * 0.5, a), slice=s)
        first = long(m)
        first.block_until_ready(timeout=120)
        print("FIRST RAN")
        try:
            long(m).fetch(timeout=60)
            print("RAN AGAIN")
        except pw.ResourceError as exc:
            print("REFUSED", exc)
        print("STILL", float(pw.jit(lambda v: v.sum(), slice=s)(m).fetch(timeout=30)))
    """)
    env = {**os.environ, "PATHWAYS_ADDRESS": cluster.address, "PATHWAYS_TENANT": "greedy",
           "PATHWAYS_CREDENTIAL": credential}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert "FIRST RAN" in out.stdout and "REFUSED over your op_ms budget" in out.stdout and \
        "STILL 256.0" in out.stdout, out.stdout + out.stderr[-2000:]
    served(victim)


def test_sessions_over_the_budget_are_refused(cluster, greedy):
    session, credential = greedy
    second = Session(cluster.address, "greedy", cluster.timeouts, credential)  # greedy now holds 2
    with pytest.raises(pw.ResourceError, match="over your sessions budget"):
        Session(cluster.address, "greedy", cluster.timeouts, credential)
    second.close()
    Session(cluster.address, "greedy", cluster.timeouts, credential).close()  # a freed place is usable again


def test_connections_over_the_budget_are_closed_and_others_connect(cluster, greedy, victim):
    session, _ = greedy
    held = [raw_connection(session, 1) for _ in range(6)]
    alive = 0
    for conn in held:
        try:
            alive += answer_to(conn, Fetch(1, session.mint(), 0.0, True).encode()) is not None
        except (ConnectionError, OSError, pw.PathwaysError):
            pass
    assert alive <= SMALL["connections"]  # those over the budget were closed at once
    for conn in held:
        conn.close()
    served(victim)


def host_rss(session, island: int = 0) -> int:
    import psutil

    return psutil.Process(session.host_stats(island)["pid"]).memory_info().rss


def test_messages_announcing_a_gigabyte_are_refused_by_frame_bytes_and_cost_the_host_nothing(cluster, greedy, victim):
    """Three connections each announce a 1 GiB message and send a megabyte of it: the host takes bytes only as
    they come and within the tenant's frame_bytes budget, says which budget refused, and ends those connections."""
    from pathways import wire
    from pathways.errors import from_wire
    from pathways.protocol import frames
    from pathways.requests import Answer

    session, _ = greedy
    rss = host_rss(session)
    conns = []
    for _ in range(3):
        conn = raw_connection(session, 0)
        prefix = frames.PREFIX.pack(1 << 30, 0, 1)
        conn.sock.sendall(prefix + frames.mac(conn._key, frames.TO_SERVER, prefix, b""))
        try:
            conn.sock.sendall(b"x" * (1 << 20))
        except OSError:  # the host may have refused the message already
            pass
        conns.append(conn)
    for conn in conns:
        answer = wire.parse(conn.recv().payload, Answer)
        error = from_wire(*answer.value)
        assert answer.rid == -1 and isinstance(error, pw.ResourceError) and "frame_bytes" in str(error), error
        with pytest.raises((ConnectionError, OSError, pw.PathwaysError)):
            conn.recv()
    assert host_rss(session) - rss < 256 << 20  # not the 3 GiB announced
    served(victim)


def test_batches_far_ahead_of_their_stream_count_against_the_ahead_budgets(cluster, greedy, victim):
    """Batches numbered far beyond the tenant's stream wait for a gap that never fills: past ahead_bytes they are
    refused, and what the host holds for them stays within the budget."""
    from pathways import wire
    from pathways.messages import Call
    from pathways.ops import Template
    from pathways.requests import Answer, Batch

    session, _ = greedy
    pw.admin().set_tenant("greedy", budgets={**SMALL, "ahead_bytes": 32 << 20})
    conn = raw_connection(session, 0)
    template = Template("ahead", 0, 1, {}, ()).encode()
    filler = b"\0" * (4 << 20)
    rss = host_rss(session)
    first = 1 << 40  # far beyond anything greedy's client sent (these are the module's last uses of its stream)
    for k in range(12):  # 48 MiB to hold ahead, over the 32 MiB budget, sent at once (the gap is 5 s here)
        conn.send(Batch(k + 1, first + k, [Call(template, session.mint(1), (), {}, ()).encode() + filler]).encode())
    answers = [wire.parse(conn.recv().payload, Answer) for _ in range(12)]
    refused = [a.value[1] for a in answers if not a.ok]
    assert refused and all("over your ahead_bytes budget" in r for r in refused), refused
    assert host_rss(session) - rss < (32 << 20) + (96 << 20)
    served(victim)
    conn.close()
