"""Parallel asynchronous dispatch: one message per island per program call, none awaited.

Output ids are minted here, so the call returns ``pw.Array`` futures at
once; islands accept fragments before their inputs exist and wait (bounded)
for them. The session's outboxes (``client.outbox``) carry the messages,
several per actor call while a scheduler is busy.

Host values a program takes (numpy arrays, scalars, jax.Arrays) are put on
their slices first, in the same order of messages, so each island has them
before the fragment that reads them. ``Placements`` keeps the ones it can
recognise, so a value passed on every call is sent once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

from client.array import Array, array_signature, check_usable, put_host
from client.host_values import HostData, as_host_data
from client.lowering import lower
from client.session import Session, current
from client.tracer import Placement, Traced
from pathways.graph import Program
from pathways.messages import Call
from pathways.ops import check_fits, spec_of
from pathways.sharding import norm_spec, spec_to_wire


class Placements:
    """Host values already on a slice, so that a value passed again is not sent again.

    Two kinds of values are recognised: small ones (``host_values.SMALL_BYTES``,
    64 KiB, or less) by content (dtype, shape and bytes), and ``jax.Array`` s,
    which are immutable, by identity for as long as they live. Larger numpy
    arrays may be changed in place between calls, so they are sent every time.
    At most ``capacity`` values are kept, least recently used first out; a kept
    value is freed on its island when it leaves.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[tuple, Array] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.sent = 0

    def _get(self, key: tuple, session: Session) -> Array | None:
        with self._lock:
            array = self._kept.get(key)
            if array is not None:
                if array.slice.released or session.epoch(array.slice.island) != array.epoch:  # gone with a restart
                    del self._kept[key]
                    return None
                self._kept.move_to_end(key)
                self.hits += 1
            return array

    def _keep(self, key: tuple, array: Array) -> None:
        with self._lock:
            self._kept[key] = array
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def _forget(self, key: tuple) -> None:
        with self._lock:
            self._kept.pop(key, None)

    def place(self, session: Session, where: Placement, value: Any, host: HostData | None, shareable: bool,
              what: str) -> Array:
        """``value`` (or the already converted ``host``) on ``where.slice`` as ``where.spec``."""
        at = (where.slice.key, norm_spec(where.spec))
        if shareable and isinstance(value, jax.Array):
            key = ("id", id(value), *at)
            array = self._get(key, session)
            if array is not None:
                return array
            host = as_host_data(value, what)
            array = put_host(session, host, where.slice, where.spec, what)
            self.sent += 1
            self._keep(key, array)
            weakref.finalize(value, self._forget, key)  # the id may be reused once the value is gone
            return array
        if host is None:
            host = as_host_data(value, what)
        content = host.content_key() if shareable else None
        if content is not None:
            key = ("content", content, *at)
            array = self._get(key, session)
            if array is not None:
                return array
        array = put_host(session, host, where.slice, where.spec, what)
        self.sent += 1
        if content is not None:
            self._keep(key, array)
        return array


_placements: weakref.WeakKeyDictionary[Session, Placements] = weakref.WeakKeyDictionary()


def placements(session: Session) -> Placements:
    """The session's cache of placed host values."""
    cache = _placements.get(session)
    if cache is None:
        cache = _placements[session] = Placements()
    return cache


def _inputs(session: Session, traced: Traced, leaves: list) -> list[Array]:
    """The program's inputs for this call: its pw.Array arguments, and its host values placed on their slices."""
    sources = traced.sources
    if len(sources) == 1 and type(sources[0]) is tuple:  # one pw.Array argument (op by op): nothing to place
        return [leaves[sources[0][1]]]
    cache = placements(session)
    returned = traced.returned
    inputs: list[Array] = []
    for k, source in enumerate(traced.sources):
        if isinstance(source, Placement):
            kind, index = source.source
            value = leaves[index] if kind == "arg" else None
            host = traced.constants[index] if kind == "const" else None
            what = f"{traced.program.name}: " + (f"argument {index}" if kind == "arg" else "a constant")
            placed = cache.place(session, source, value, host, k not in returned, what)
            check_usable(placed, f"{traced.program.name} got")
            inputs.append(placed)
        else:
            inputs.append(leaves[source[1]])  # checked with the call's signature (``ProgramFunction._signature``)
    return inputs


def check_sizes(program: Program, session: Session) -> None:
    """ResourceError before anything is sent if a value the program makes cannot fit the hosts it lands on."""
    for node in program.nodes:
        for value in node.outputs:
            check_fits(value.aval(), spec_of(spec_to_wire(value.spec)), value.slice.desc(),
                       session.islands.limits(value.slice.island, session.topology),
                       f"{node.name} in program {program.name!r} (output {value.describe()})")


def dispatch(traced: Traced, leaves: list) -> Any:
    """Send one call of a traced program: its host values first, then one message per island; returns the
    outputs as ``pw.Array`` futures at once. The pw.Arrays the program donates are gone afterwards. While the
    cluster is suspended, a call waits for the resume (``pw.Timeouts.suspend``); a call under way when a suspend
    begins reaches all its islands before the client stops sending."""
    session = current()
    gate = session.gate
    gate.enter(session.timeouts.suspend, traced.calling)
    try:
        return _send(session, traced, leaves)
    finally:
        gate.leave()


def _send(session: Session, traced: Traced, leaves: list) -> Any:
    program = traced.program
    inputs = _inputs(session, traced, leaves)
    lowered = traced.lowered
    if lowered is None or not lowered.still_placed():
        start = time.time()
        check_sizes(program, session)
        lowered = traced.lowered = lower(program, traced.exes)
        session.events.span(f"lower {program.name}", "lower", start, time.time(),
                            fragments=len(lowered.fragments))
    start = time.time() if session.events.enabled else 0.0
    base = session.mint(lowered.n_values)
    input_ids = tuple([a.id for a in inputs])
    for island, fragment in lowered.fragments.items():
        sent = session.islands.sent_exes[island]
        exes = {h: b for h, b in fragment.exes.items() if h not in sent} if fragment.exes.keys() - sent else {}
        session.submit(island, Call(fragment.encoded, base, input_ids, exes, tuple(session.frees.take(island))))
        if exes:
            sent.update(exes)
    for index, to in traced.donated.items():  # after the call is on its way: the free must follow it
        inputs[index]._donate(to)
    if session.events.enabled:
        session.events.span(f"dispatch {program.name}", "dispatch", start, time.time(),
                            islands=sorted(lowered.fragments), base=base)
    lineage = lowered.islands.union(*[a.islands for a in inputs]) if len(inputs) != 1 else \
        lowered.islands | inputs[0].islands
    made = traced.made
    if made is None:
        made = traced.made = _made(traced)
    outputs = [inputs[slot] if shape is None else
               Array(session, base + slot, shape, dtype, where, spec, lineage, weak_type=weak, key=key,
                     signature=token)
               for slot, shape, dtype, where, spec, weak, key, token in made]
    if len(outputs) == 1 and traced.program.out_tree.num_nodes == 1:
        return outputs[0]  # one array, as tree_unflatten would give it
    return jax.tree_util.tree_unflatten(program.out_tree, outputs)


def _made(traced: Traced) -> list[tuple]:
    """What each output of a call is made of: its slot, and for an output the program computes, the shape, dtype,
    slice, spec, weak type, key and trace signature of its array (shape None: it returns an input)."""
    program = traced.program
    n_inputs = len(program.inputs)
    out = []
    for value, (key, weak) in zip(program.outputs, traced.out_meta):
        if value.slot < n_inputs:
            out.append((value.slot, None, None, None, None, None, None, None))
            continue
        shape = tuple(value.shape[:len(value.shape) - len(key.data_shape)] if key is not None else value.shape)
        dtype = key.dtype if key is not None else np.dtype(value.dtype)
        out.append((value.slot, shape, dtype, value.slice, value.spec, weak, key,
                    array_signature(shape, dtype, weak, value.slice, value.spec)))
    return out
