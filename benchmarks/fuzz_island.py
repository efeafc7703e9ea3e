"""An island against a careless or hostile tenant: random valid-looking messages, and another tenant's work.

    python -m benchmarks.fuzz_island [--messages 300] [--seed 0]

One tenant (the fuzzer) sends N messages that pass the wire schema and carry
its own session's signature, but are wrong in meaning: calls whose inputs are
missing or someone else's, templates that read slots nobody wrote or free slot
-5, unknown or forged executables, shapes no host can hold, puts without (or
with the wrong) value, uploads that lie about their size, frees of ids it never
made; a fifth of them are valid.
After every message a second tenant runs a small program on the same island
and fetches its result. The last line counts what went wrong:

    island fuzz: N messages, W wedged, C crashed, E executor deaths, served S/N

W: the other tenant's program did not finish in time; C: a host process died
(the island restarted); E: a host's executor died. The goal is W = C = E = 0
and S = N.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from dataclasses import replace
from typing import Any

import numpy as np

import pathways as pw
from benchmarks.common import default_out, write_json
from pathways.messages import CLIENT_ID_BITS, Call, Free, Put
from pathways.ops import Aval, Exec, Recv, Route, Send, SliceDesc, Template
from pathways.requests import PutData, State

Upload = tuple[int, bytes, list]  # (host, a put_data message, the bytes after it)


class Fuzzer:
    """Messages of one session, wrong in meaning in every way a careless or hostile client could manage."""

    def __init__(self, session: Any, s: pw.VirtualSlice, seed: int) -> None:
        self.session, self.slice, self.rng = session, s, random.Random(seed)
        f = pw.jit(lambda a, b: a * b + 1.0, slice=s, name="fuzzed")
        x = np.zeros(8, np.float32)
        exported = f.export(s, f.bind((x, x), {}), [((8,), np.dtype(np.float32), False)] * 2)
        self.exe, self.blob = exported.exe, exported.blob
        desc = s.desc()
        op = Exec(self.exe, desc.key, (0, 1), (2,), ((), ()), ((),), "fuzzed")
        self.template = Template("fuzzed", 2, 3, {desc.key: desc}, (op,))
        self.value = np.arange(8, dtype=np.float32)

    def _id(self, k: int = 1) -> int:
        return self.session.mint(k)

    def upload(self, buffer_id: int, value: np.ndarray, dtype: str | None = None,
               data: np.ndarray | None = None) -> list[Upload]:
        """The uploads of ``value`` as put ``buffer_id`` to the slice's host (``dtype`` and ``data`` may lie)."""
        region = [[0, n] for n in value.shape]
        msg = PutData(buffer_id, [region], dtype or value.dtype.name).encode()
        return [(h, msg, [value if data is None else data]) for h in self.slice.hosts]

    def send(self, payload: bytes, uploads: list[Upload]) -> None:
        """What a client does with a message: its put values straight to their hosts, then the message in its
        stream to the island."""
        for host, msg, data in uploads:
            self.session.upload(self.slice.island, host, msg, data)
        self.session.outboxes.put(self.slice.island, payload)

    def message(self) -> tuple[str, bytes, list[Upload]]:
        """One message: (what it tries, payload, the uploads that go before it)."""
        kind = self.rng.choice(["call"] * 5 + ["template"] * 8 + ["put"] * 4 + ["free"] * 2 + ["valid"] * 5)
        return getattr(self, f"_{kind}")()

    # -- calls with valid templates but wrong ids or executables ------------------------------------------
    def _call_of(self, template: Template, **changes: Any) -> bytes:
        base = self._id(min(max(template.n_values, 1), 1 << 20))
        fields = {"template": template.encode(), "base": base, "inputs": self._inputs(),
                  "exes": {self.exe: self.blob}, "frees": ()}
        fields.update(changes)
        return Call(**fields).encode()

    def _inputs(self) -> tuple[int, int]:
        """Two fresh buffers of the fuzzer's own, put just now (valid inputs)."""
        ids = (self._id(), self._id())
        for buffer_id in ids:
            put = Put(buffer_id, self.slice.desc(), (), Aval((8,), "float32"))
            self.send(put.encode(), self.upload(buffer_id, self.value))
        return ids

    def _call(self) -> tuple[str, bytes, list[Upload]]:
        other = (self.session.client_id + 1) << CLIENT_ID_BITS
        what, changes = self.rng.choice([
            ("no inputs", {"inputs": ()}),
            ("three inputs for two", {"inputs": (self._id(), self._id(), self._id())}),
            ("another client's input ids", {"inputs": (other + 5, other + 6)}),
            ("a base outside its id space", {"base": other + 100}),
            ("a negative base", {"base": -7}),
            ("an executable whose bytes do not match its hash", {"exes": {self.exe: self.blob[:-1] + b"x"}}),
            ("garbage executable bytes under their own hash",
             {"exes": {hashlib.sha256(b"junk").hexdigest(): b"junk"}}),
            ("frees of another client's ids", {"frees": (other + 1, -5)}),
        ])
        return what, self._call_of(self.template, **changes), []

    # -- templates wrong in meaning -------------------------------------------------------------------------
    def _template(self) -> tuple[str, bytes, list[Upload]]:
        t = self.template
        op: Exec = t.ops[0]
        desc = next(iter(t.slices.values()))
        big = Aval((2**31, 2**31), "float32")
        other = 1 - self.slice.island
        expect = (Route(0, 0, (((0, 2),),)),)
        what, template = self.rng.choice([
            ("an exec with no inputs", replace(t, ops=(replace(op, inputs=()),))),
            ("an exec writing slot -3", replace(t, ops=(replace(op, outputs=(-3,)),))),
            ("an exec writing slot 10**6", replace(t, ops=(replace(op, outputs=(10**6,)),))),
            ("a read of a slot nobody wrote", replace(t, n_values=5, ops=(replace(op, inputs=(0, 4)),))),
            ("a free of slot -5", replace(t, ops=(replace(op, frees=(-5,)),))),
            ("a free of an input", replace(t, ops=(replace(op, frees=(0,)),))),
            ("an unknown executable hash", replace(t, ops=(replace(op, exe="ab" * 32),))),
            ("a non-hex executable hash", replace(t, ops=(replace(op, exe="not a hash"),))),
            ("an unknown slice", replace(t, ops=(replace(op, slice="nope"),))),
            ("a spec naming an unknown axis", replace(t, ops=(replace(op, in_specs=(("zz",), ())),))),
            ("devices that do not exist", replace(t, slices={desc.key: replace(desc, devices=((7, 99),) *
                                                                                 len(desc.devices))})),
            ("n_values of 2**40", replace(t, n_values=2**40)),
            ("a write of the same slot twice", replace(t, n_values=4, ops=(op, op))),
            ("a send to its own island", replace(t, n_values=4, ops=(op, Send(2, 3, self.slice.island, ())))),
            ("a send to island 99", replace(t, n_values=4, ops=(op, Send(2, 3, 99, ())))),
            ("a receive of 16 EiB", replace(t, n_values=4, ops=(op, Recv(3, desc.key, (), big, other, expect)))),
            ("a receive of dtype 'nope'",
             replace(t, n_values=4, ops=(op, Recv(3, desc.key, (), Aval((2,), "nope"), other, expect)))),
            ("a receive from island -1",
             replace(t, n_values=4, ops=(op, Recv(3, desc.key, (), Aval((2,), "float32"), -1, expect)))),
        ])
        return what, self._call_of(template), []

    # -- puts -----------------------------------------------------------------------------------------------
    def _put(self) -> tuple[str, bytes, list[Upload]]:
        desc: SliceDesc = self.slice.desc()
        good = Put(self._id(), desc, (), Aval((8,), "float32"))
        value = self.value
        what, put, uploads = self.rng.choice([
            ("a put without its value", good, []),
            ("a put whose value is sent twice", good, self.upload(good.id, value) * 2),
            ("an upload whose bytes are fewer than it announces", good, self.upload(good.id, value, data=value[:3])),
            ("a put whose value has another shape", good, self.upload(good.id, np.zeros(3, np.float32))),
            ("a put whose value has another dtype", good, self.upload(good.id, value, dtype="int32")),
            ("an upload of dtype 'nope'", good, self.upload(good.id, value, dtype="nope")),
            ("a put announcing 16 EiB", replace(good, aval=Aval((2**31, 2**31), "float32")),
             self.upload(good.id, value)),
            ("a put on a slice it does not hold", replace(good, slice=replace(desc, key="s999")),
             self.upload(good.id, value)),
            ("a put with another client's id", replace(good, id=((self.session.client_id + 1) << CLIENT_ID_BITS) + 3),
             self.upload(((self.session.client_id + 1) << CLIENT_ID_BITS) + 3, value)),
        ])
        return what, put.encode(), uploads

    def _free(self) -> tuple[str, bytes, list[Upload]]:
        what, ids = self.rng.choice([("a free of ids -1 and 0", (-1, 0)),
                                     ("a free of another client's ids", ((self.session.client_id + 1) << 40,)),
                                     ("a free of 10,000 unknown ids", tuple(range(10**6, 10**6 + 10**4)))])
        return what, Free(ids).encode(), []

    def _valid(self) -> tuple[str, bytes, list[Upload]]:
        if self.rng.random() < 0.5:
            buffer_id = self._id()
            return "a valid put", Put(buffer_id, self.slice.desc(), (), Aval((8,), "float32")).encode(), \
                self.upload(buffer_id, self.value)
        return "a valid call", self._call_of(self.template), []


def run(victim: Any, fuzz_session: Any, island: int, n: int, seed: int, timeout: float = 10.0,
        log: Any = None) -> dict:
    """Send ``n`` fuzzed messages from ``fuzz_session``; after each, ``victim`` (the current pw session) runs a
    small program on the same island. Returns the counts and every failure's description."""
    s = pw.slice((2,), ("x",), island=island)
    fs = _slice_for(fuzz_session, island)
    fuzzer = Fuzzer(fuzz_session, fs, seed)
    inc = pw.jit(lambda v: v + 1.0, slice=s, name="victim")
    x = pw.put(np.zeros(4, np.float32), s)
    epoch0 = victim.epoch(island)
    served, wedged, failures = 0, 0, []
    deaths = 0
    for k in range(n):
        what, payload, uploads = fuzzer.message()
        try:
            fuzzer.send(payload, uploads)
        except pw.PathwaysError as exc:  # the fuzzer's own connection was closed for what it sent: reconnect
            failures.append(f"message {k} ({what}): the fuzzer's connection ended: {exc}"[:300])
        try:
            x = inc(x)
            value = x.fetch(timeout=timeout)
            if value[0] == k + 1:
                served += 1
            else:
                failures.append(f"message {k} ({what}): the other tenant got {value[0]} instead of {k + 1}")
        except pw.PathwaysError as exc:
            wedged += 1
            failures.append(f"message {k} ({what}): {type(exc).__name__}: {exc}"[:300])
            x = pw.put(np.full(4, k + 1, np.float32), s)
        if log is not None and (k + 1) % 50 == 0:
            log(f"{k + 1} messages: served {served}, wedged {wedged}")
    stats = [victim.host_stats(island, h) for h in range(len(victim.islands[island].hosts))]
    deaths = sum(1 for st in stats if st["dead"])
    restarts = victim.request(lambda rid: State(rid), "state")["restarts"]
    crashed = sum(1 for r in restarts if r["island"] == island and r["epoch"] > epoch0)
    return {"messages": n, "wedged": wedged, "crashed": crashed, "executor_deaths": deaths, "served": served,
            "failures": failures, "refused_pieces": sum(st.get("refused_pieces", 0) for st in stats)}


def _slice_for(session: Any, island: int) -> pw.VirtualSlice:
    from client.slices import VirtualSlice
    from pathways.requests import Allocate

    return VirtualSlice(session, session.request(lambda rid: Allocate(rid, [2], ["x"], island), "allocate"),
                        platform=session.topology.jax_platform)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts-per-island", type=int, default=1,
                        help="2: a multi-host island, whose hosts run strictly in the island's order")
    parser.add_argument("--json", default=str(default_out("fuzz_island")))
    args = parser.parse_args()
    from client.session import Session

    victim = pw.init(topology=pw.Topology(2, args.hosts_per_island, 4 // args.hosts_per_island),
                     timeouts=pw.Timeouts(fetch=30.0, op=10.0))
    credential = pw.admin().add_tenant("fuzzer")
    fuzz = Session(victim.address, "fuzzer", victim.timeouts, credential)
    start = time.perf_counter()
    result = run(victim, fuzz, 0, args.messages, args.seed, log=lambda line: print(line, flush=True))
    took = time.perf_counter() - start
    for line in result["failures"][:20]:
        print("  " + line)
    fuzz.close()
    pw.shutdown()
    write_json(args.json, {**result, "seconds": took, "seed": args.seed, "hosts_per_island": args.hosts_per_island})
    print(f"island fuzz: {result['messages']} messages, {result['wedged']} wedged, {result['crashed']} crashed, "
          f"{result['executor_deaths']} executor deaths, served {result['served']}/{result['messages']}")


if __name__ == "__main__":
    main()
