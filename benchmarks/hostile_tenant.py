"""A hostile tenant against a victim tenant on one cluster: every abuse in turn, while the victim runs a small
program every 100 ms and measures how long each takes.

The hostile tenant holds nothing but its own credential, as any tenant does: it runs in a process of its own
that speaks the runtime's protocol (no Ray), and tries to act for the victim, read or change its data, or
starve it: claiming the victim's session, the admin's operations, the hosts' data ports without the runtime's
key, a guessed job ticket, frames replayed to another island, fetches that never return, programs of 65,536
ops, bursts of long computations, fresh long programs (and programs that compile long) one after another under
its op_ms budget, a gigabyte of host memory, sessions and connections by the dozen, ten
thousand cheap requests, job archives announced without a credential, and its session after the admin rotated
its credential. Its jobs' hostile processes (reading another tenant's job, the runtime's files, Ray) need a
runtime started by `pathways up` as root, where each tenant's jobs run as a user of its own:
tests/command/test_cli.py and tests/resource_manager/test_job_runner.py try those. The victim's latency alone is
measured first. The last line:

    hostile tenant: A abuses, victim served S/N, worst victim latency L ms (alone M ms), lost 0

The goal: S = N, nothing lost, and L within 3x of M plus the victim's fair share of one abuse's op: a running
computation cannot be stopped, so a victim that arrives just after one started waits for it; the line before
the last compares L with 3 M plus the longest computation an abuse ran, as the hosts measured it. The hostile
tenant's op_ms budget (100 ms) refuses a program once one of its computations ran longer, and holds the tenant,
whatever programs it makes, to its share of the island once one of its places (compiling included) ran longer.

    python -m benchmarks.hostile_tenant [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Table, default_out, median, write_json

PERIOD_S = 0.1
HOSTILE_BUDGETS = {"host_bytes": 256 << 20, "parked_bytes": 256 << 20, "op_ms": 100}
LONG_OP_S = 0.2  # one of the hostile tenant's long computations


# -- the hostile tenant's process ---------------------------------------------------------------------------

def _refused(fn: Any) -> str:
    """What happened when the hostile tenant tried ``fn``: the error that refused it, or that it went through."""
    try:
        fn()
    except Exception as exc:  # every refusal counts, whatever its kind
        return f"refused: {type(exc).__name__}: {str(exc)[:140]}"
    return "went through"


def _connect(session: Any, island: int | None, client: int, key: bytes | None) -> Any:
    from pathways.protocol.connection import connect

    address = session.address if island is None else session.islands[island].hosts[0]["client"]
    return connect(address, client if key else 0, key, lambda identity: None, 1 << 30, 1 << 30)


def _host_rss(session: Any, island: int = 0) -> int:
    import psutil

    return psutil.Process(session.host_stats(island)["pid"]).memory_info().rss


def _raise_answer(frame: Any) -> None:
    """The error an endpoint answered with (a refusal of no request of ours), raised."""
    from pathways import wire
    from pathways.errors import from_wire
    from pathways.requests import Answer

    answer = wire.parse(frame.payload, Answer)
    if not answer.ok:
        raise from_wire(*answer.value)


def _newcomer(session: Any, crowd: str) -> str:
    """How long a new session of this tenant takes to open while ``crowd`` waits at the door."""
    from client.session import Session

    start = time.monotonic()
    try:
        Session(session.address, session.tenant, session.timeouts, os.environ["PATHWAYS_CREDENTIAL"]).close()
    except Exception as exc:  # a refusal is the outcome
        return f"with {crowd}, a new session was refused: {type(exc).__name__}: {str(exc)[:100]}"
    return f"with {crowd}, a new session opened in {(time.monotonic() - start) * 1e3:.0f} ms"


def abuse(name: str, victim_client: int) -> dict:
    """Run one abuse as the hostile tenant; returns what happened, as the runtime answered it."""
    import jax
    import jax.numpy as jnp

    import pathways as pw
    from client.array import Array
    from pathways import wire
    from pathways.messages import Call
    from pathways.ops import Send, Template
    from pathways.protocol import frames
    from pathways.protocol.address import parse_address
    from pathways.requests import AdminOp, Answer, Fetch, Open, Ping, State

    session = pw.init(timeouts=pw.Timeouts(fetch=60.0))
    s = pw.slice((2,), ("x",), island=0)
    out: dict = {"abuse": name}
    if name == "claim the victim's session":
        out["outcome"] = "; ".join(_refused(lambda i=i: _connect(session, i, victim_client, session._key))
                                   for i in (None, 0, 1))
    elif name == "the admin's operations":
        out["outcome"] = "; ".join(_refused(lambda op=op: session.rm.call(
            lambda rid: AdminOp(rid, "guessed", op, {"name": "hostile", "weight": 1e6}), 30))
            for op in ("tenant_set", "state", "reclaim"))
    elif name == "a host's data port without the runtime key":
        results = []
        for host in (h for isl in pw.status().islands for h in isl.hosts if h.data):
            ip, port = host.data.rsplit(":", 1)
            with socket.create_connection((ip, int(port)), timeout=10) as conn:
                conn.recv(4096)
                conn.sendall(os.urandom(80) + b"\x00" * (1 << 16))  # a forged hello, then "data"
                conn.settimeout(10)
                try:
                    results.append("closed" if conn.recv(1) == b"" else "answered")
                except OSError:
                    results.append("closed")
        out["outcome"] = f"refused: {results.count('closed')} of {len(results)} data ports closed the connection"
    elif name == "a guessed job ticket":
        from client.link import Link, expect_role

        def redeem() -> Any:
            link = Link(session.address, 0, None, expect_role(None, "rm"), "the resource manager")
            return link.call(lambda rid: Open(rid, "victim", None, "guessed-ticket", os.getpid(), "someone's-job"), 30)

        out["outcome"] = _refused(redeem)
    elif name == "a frame replayed to another island":
        conn = _connect(session, 0, session.client_id, session._key)
        payload = Ping(1).encode()
        frame = frames.head(conn._key, frames.TO_SERVER, 1, payload, 0) + payload
        conn.send(payload)
        conn.recv()
        other = _connect(session, 1, session.client_id, session._key)
        other.sock.sendall(frame)
        out["outcome"] = _refused(other.recv)
    elif name == "fetches of a buffer that never comes, 300 of them":
        conn = _connect(session, 0, session.client_id, session._key)
        never = session.mint()
        for rid in range(300):
            conn.send(Fetch(rid, never, 3600.0, False).encode())
        frame = conn.recv()
        conn.skip(frame.data)
        out["outcome"] = str(wire.parse(frame.payload, Answer).value)[:160]
        time.sleep(2.0)  # they wait meanwhile, holding no thread
    elif name in ("a program of 65,536 sends", "ten programs of 131,072 ops"):
        n, count = (65536, 1) if name.startswith("a program") else (131072, 10)
        desc = s.desc()
        template = Template("flood", 1, 2, {desc.key: desc}, tuple(Send(0, 1, 1, ()) for _ in range(n))).encode()
        x = pw.put(np.ones(2, np.float32), s)
        outs = []
        for _ in range(count):
            base = session.mint(2)
            session.outboxes.put(0, Call(template, base, (x.id,), {}, ()).encode())
            outs.append(Array(session, base + 1, (2,), np.float32, s, x.spec, frozenset({0})))
        out["outcome"] = _refused(lambda: outs[-1].fetch(timeout=60))
    elif name == "bursts of long computations with a low cost estimate":
        cheap = pw.jit(lambda v: v + 1.0, slice=s)
        iters = int(LONG_OP_S * 1.4e11 / (2 * 256**3))
        long = pw.jit(lambda m: jax.lax.fori_loop(0, iters, lambda i, a: jnp.tanh(a @ m) * 0.5, m), slice=s)
        x, m = pw.put(np.ones(2, np.float32), s), pw.put(np.eye(256, dtype=np.float32), s)
        ran, refusals = 0, []
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        with pw.trace(trace):  # its own spans, as the hosts measured them: how long each computation ran
            for _ in range(3):
                ys = [cheap(x) for _ in range(64)]  # teach the scheduler that this tenant's work is cheap
                ys[-1].block_until_ready()
                for y in [long(m) for _ in range(20)]:  # then 20 long ones at once
                    try:
                        y.block_until_ready(timeout=120)
                        ran += 1
                    except pw.ResourceError as exc:
                        refusals.append(str(exc))
        spans = json.loads(trace.read_text())["traceEvents"]
        out["longest_op_ms"] = max(e["dur"] / 1e3 for e in spans if e.get("cat") == "exec")
        out["outcome"] = (f"{ran} long computations ran, the longest {out['longest_op_ms']:.0f} ms, charged to it; "
                          f"{len(refusals)} refused: {refusals[0][:60] if refusals else '-'}")
    elif name in ("fresh long programs under its op_ms, 12 at once", "fresh programs that compile long, 4 at once"):
        # A refused program is no obstacle: the same loop with another constant is a program never seen. Each runs
        # (or compiles) past its op_ms; the tenant, not the program, is held to its share from the first one on.
        compiling = name.startswith("fresh programs that compile")
        iters = int(LONG_OP_S * 1.4e11 / (2 * 256**3))

        def fresh(c: float) -> Any:
            if compiling:  # an unrolled chain compiles for long and runs in a moment
                def unrolled(a):
                    for k in range(30):
                        a = jnp.tanh(a[:64, :64] @ a[:64, :64].T + c * k)
                    return a
                return pw.jit(unrolled, slice=s)
            return pw.jit(lambda m: jax.lax.fori_loop(0, iters, lambda i, a: jnp.tanh(a @ m) * c, m), slice=s)

        m = pw.put(np.eye(256, dtype=np.float32), s)
        start, ran, refusals = time.monotonic(), 0, []
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        with pw.trace(trace):
            for y in [fresh(0.5 + k * 1e-3)(m) for k in range(4 if compiling else 12)]:
                try:
                    y.block_until_ready(timeout=120)
                    ran += 1
                except pw.ResourceError as exc:
                    refusals.append(str(exc))
        took = time.monotonic() - start
        spans = json.loads(trace.read_text())["traceEvents"]
        out["longest_op_ms"] = max(e["dur"] / 1e3 for e in spans if e.get("cat") == "exec")
        out["outcome"] = (f"{ran} ran in {took:.1f}s, the longest {out['longest_op_ms']:.0f} ms "
                          f"({'compiling' if compiling else 'computing'}), each over op_ms and held to its share "
                          f"after it; {len(refusals)} refused")
    elif name == "a gigabyte of host memory":
        out["outcome"] = _refused(lambda: pw.put(np.ones(1 << 28, np.float32), s).block_until_ready(timeout=60))
    elif name == "sessions and connections by the dozen":
        from client.session import Session

        opened, refusals = [], []
        for _ in range(20):
            try:
                opened.append(Session(session.address, session.tenant, session.timeouts,
                                      os.environ["PATHWAYS_CREDENTIAL"]))
            except pw.PathwaysError as exc:
                refusals.append(str(exc)[:100])
        conns, closed = [], 0
        for _ in range(100):
            try:
                conn = _connect(session, 0, session.client_id, session._key)
                conn.send(Ping(1).encode())
                conn.recv()
                conns.append(conn)
            except (OSError, pw.PathwaysError):
                closed += 1
        for extra in opened:
            extra.close()
        out["outcome"] = (f"{len(opened)} more sessions opened, then refused: {refusals[:1]}; "
                          f"{closed} of 100 connections refused")
    elif name == "ten thousand cheap requests":
        conn = _connect(session, 0, session.client_id, session._key)
        start = time.monotonic()
        for rid in range(10000):
            conn.send(Ping(rid).encode())
        for _ in range(10000):
            frame = conn.recv()
            conn.skip(frame.data)
        out["outcome"] = f"answered in {time.monotonic() - start:.1f}s"
        session.rm.call(lambda rid: State(rid), 30)
    elif name == "slow handshakes at every endpoint, 200 each":
        half_open = []
        for address in (session.address, session.islands[0].hosts[0]["client"]):
            for _ in range(200):
                sock = socket.create_connection(parse_address(address), timeout=10)
                sock.sendall(b"P")  # one byte of a hello, and nothing more
                half_open.append(sock)
        out["outcome"] = _newcomer(session, f"{len(half_open)} connections half-open")
        for sock in half_open:
            sock.close()
    elif name == "idle anonymous connections, 150":
        idle = [_connect(session, None, 0, None) for _ in range(150)]
        out["outcome"] = _newcomer(session, f"{len(idle)} anonymous connections idle")
        for conn in idle:
            conn.close()
    elif name == "unauthenticated connections to a data port, 300":
        import psutil

        host = psutil.Process(session.host_stats(0)["pid"])
        ip, port = pw.status().islands[0].hosts[0].data.rsplit(":", 1)
        threads = host.num_threads()
        socks = [socket.create_connection((ip.strip("[]"), int(port)), timeout=10) for _ in range(300)]
        time.sleep(1.0)  # the host had time to start a thread for each, had it wanted to
        grew = host.num_threads() - threads
        for sock in socks:
            sock.close()
        out["outcome"] = f"the host's threads grew by {grew} for 300 connections that never proved themselves"
    elif name == "three messages announcing a gigabyte each":
        rss = _host_rss(session)
        answers = []
        for _ in range(3):
            conn = _connect(session, 0, session.client_id, session._key)
            prefix = frames.PREFIX.pack(1 << 30, 0, 1)
            conn.sock.sendall(prefix + frames.mac(conn._key, frames.TO_SERVER, prefix, b"") + b"x" * (1 << 20))
            answers.append(_refused(lambda c=conn: _raise_answer(c.recv())))
        out["outcome"] = f"host memory +{(_host_rss(session) - rss) >> 20} MiB; {answers[-1]}"
    elif name == "24 batches of 64 MiB far ahead of its stream":
        from pathways.requests import Batch

        conn = _connect(session, 0, session.client_id, session._key)
        rss, refusals = _host_rss(session), []
        template = Template("ahead", 0, 1, {}, ()).encode()
        for k in range(24):
            msg = Call(template, session.mint(1), (), {}, ()).encode() + bytes(64 << 20)
            conn.send(Batch(k + 1, (1 << 40) + k, [msg]).encode())
            frame = conn.recv()
            answer = wire.parse(frame.payload, Answer)
            if not answer.ok:
                refusals.append(answer.value[1])
        out["outcome"] = (f"host memory +{(_host_rss(session) - rss) >> 20} MiB; {len(refusals)} of 24 refused: "
                          f"{refusals[0][:60] if refusals else '-'}")
    elif name == "anonymous job archives announcing 256 MiB, 4 at once":
        from pathways.requests import SubmitJob

        start, conns = time.monotonic(), []
        for _ in range(4):  # each announces 256 MiB of archive and sends none of it
            conn = _connect(session, None, 0, None)
            payload = SubmitJob(1, "victim", "guessed", ["python", "x.py"], None).encode()
            conn.sock.sendall(frames.head(None, frames.TO_SERVER, 1, payload, 256 << 20) + payload)
            conns.append(conn)
        answers = []
        for conn in conns:
            conn.sock.settimeout(30)
            answers.append(_refused(lambda c=conn: _raise_answer(c.recv())))
            conn.close()
        out["outcome"] = (f"{sum(a.startswith('refused') for a in answers)} of 4 refused unread in "
                          f"{(time.monotonic() - start) * 1e3:.0f} ms: {answers[0]}")
    elif name == "its session after the admin rotated its credential":
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the admin rotates the credential now
        out["outcome"] = _refused(lambda: pw.slice((1,), ("x",)))
    else:
        raise SystemExit(f"no abuse named {name!r}")
    return out


ABUSES = ["claim the victim's session", "the admin's operations", "a host's data port without the runtime key",
          "a guessed job ticket", "a frame replayed to another island",
          "fetches of a buffer that never comes, 300 of them", "a program of 65,536 sends",
          "ten programs of 131,072 ops", "bursts of long computations with a low cost estimate",
          "fresh long programs under its op_ms, 12 at once", "fresh programs that compile long, 4 at once",
          "a gigabyte of host memory", "sessions and connections by the dozen", "ten thousand cheap requests",
          "slow handshakes at every endpoint, 200 each", "idle anonymous connections, 150",
          "unauthenticated connections to a data port, 300", "three messages announcing a gigabyte each",
          "24 batches of 64 MiB far ahead of its stream", "anonymous job archives announcing 256 MiB, 4 at once",
          "its session after the admin rotated its credential"]


# -- the benchmark: the admin and the victim ----------------------------------------------------------------

class Victim:
    """The victim's small program, every ``PERIOD_S`` on island 0; latencies by phase, failures counted."""

    def __init__(self) -> None:
        import pathways as pw

        self.slice = pw.slice((2,), ("x",), island=0)
        self.step = pw.jit(lambda v: v * 2.0 - v + 1.0, slice=self.slice, name="victim")
        self.keep = pw.put(np.arange(1024, dtype=np.float32), self.slice)
        self.x = pw.put(np.zeros(4, np.float32), self.slice)
        self.expected = 0.0
        self.phase = "alone"
        self.latency: dict[str, list[float]] = {}
        self.failed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import pathways as pw

        while not self._stop.wait(PERIOD_S):
            phase, start = self.phase, time.monotonic()
            try:
                self.x = self.step(self.x)
                self.expected += 1.0
                value = self.x.fetch(timeout=60)
                ok = value[0] == self.expected
            except pw.PathwaysError:
                ok = False
            if ok:
                self.latency.setdefault(phase, []).append(time.monotonic() - start)
            else:
                self.failed[phase] = self.failed.get(phase, 0) + 1
                self.x, self.expected = pw.put(np.zeros(4, np.float32), self.slice), 0.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def lost(self) -> int:
        """Whether the victim's kept array is still what it put there (0: nothing lost)."""
        import pathways as pw

        try:
            ident = pw.jit(lambda v: v, slice=self.slice)(self.keep).fetch(timeout=60)
            return int(not np.array_equal(ident, np.arange(1024, dtype=np.float32)))
        except pw.PathwaysError:
            return 1


def run_abuse(name: str, env: dict, victim_client: int, rotate: Any) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.hostile_tenant", "--abuse", name,
                             "--victim-client", str(victim_client)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if name.startswith("its session after"):
        assert json.loads(proc.stdout.readline()).get("ready")
        rotate()
        proc.stdin.write("go\n")
        proc.stdin.flush()
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{") and "abuse" in line]
    return lines[-1] if lines else {"abuse": name, "outcome": f"the hostile process failed: {err.strip()[-300:]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="skip the two heaviest abuses (the 131k-op programs, the "
                   "gigabyte)")
    p.add_argument("--out", default=str(default_out("hostile_tenant")))
    p.add_argument("--abuse", help=argparse.SUPPRESS)
    p.add_argument("--victim-client", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.abuse:
        print(json.dumps(abuse(args.abuse, args.victim_client)), flush=True)
        return

    import pathways as pw

    session = pw.init(topology=pw.Topology(2, 1, 4), timeouts=pw.Timeouts(fetch=60.0, op=30.0, grace=3.0))
    admin = pw.admin()
    credential = admin.add_tenant("hostile", weight=1.0, quota=4, budgets=HOSTILE_BUDGETS)
    env = {**os.environ, "PATHWAYS_ADDRESS": session.address, "PATHWAYS_TENANT": "hostile",
           "PATHWAYS_CREDENTIAL": credential}
    victim = Victim()
    victim.start()
    time.sleep(5.0)  # the victim alone
    abuses = [a for a in ABUSES if not (args.quick and a in ("ten programs of 131,072 ops",
                                                              "a gigabyte of host memory"))]
    results = []
    for name in abuses:
        victim.phase = name
        started = time.monotonic()
        result = run_abuse(name, env, session.client_id,
                           lambda: admin.set_tenant("hostile", new_credential=True))
        result["seconds"] = time.monotonic() - started
        results.append(result)
        print(f"{name}: {result['outcome']}", flush=True)
    victim.phase = "after"
    time.sleep(2.0)
    victim.stop()
    lost = victim.lost()
    alone = median(victim.latency.get("alone", [])) * 1e3
    table = Table(["abuse", "victim served", "victim latency median / worst (ms)", "outcome"])
    served = total = 0
    worst = 0.0
    for r in results:
        lat = victim.latency.get(r["abuse"], [])
        failed = victim.failed.get(r["abuse"], 0)
        served, total = served + len(lat), total + len(lat) + failed
        worst = max([worst, *[v * 1e3 for v in lat]])
        table.add(r["abuse"], f"{len(lat)}/{len(lat) + failed}",
                  f"{median(lat) * 1e3:.0f} / {max(lat, default=0) * 1e3:.0f}" if lat else "-", r["outcome"][:70])
    print(table.render())
    pw.shutdown()
    longest = max(r.get("longest_op_ms", 0.0) for r in results)
    goal = 3 * alone + longest
    write_json(Path(args.out), {"alone_ms": alone, "worst_ms": worst, "goal_ms": goal, "served": served,
                                "total": total, "lost": lost, "results": results,
                                "latency_ms": {k: [x * 1e3 for x in v] for k, v in victim.latency.items()}})
    print(f"goal: worst victim latency <= 3 x alone + the longest computation an abuse ran, compiling included "
          f"({longest:.0f} ms: it cannot be stopped once it runs) = {goal:.0f} ms: "
          f"{'met' if worst <= goal else 'NOT met'}")
    print(f"hostile tenant: {len(results)} abuses, victim served {served}/{total}, worst victim latency "
          f"{worst:.0f} ms (alone {alone:.0f} ms), lost {lost}")


if __name__ == "__main__":
    main()
