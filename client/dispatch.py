"""Parallel asynchronous dispatch: one message per island per program call, none awaited.

Output ids are minted here, so the call returns ``pw.Array`` futures at
once; islands accept fragments before their inputs exist and wait (bounded)
for them. The session's outboxes (``client.outbox``) carry the messages,
several per actor call while a scheduler is busy.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from client.array import Array
from client.lowering import lower, placement_of
from client.session import current
from client.tracer import Traced
from pathways.errors import ProgramError
from pathways.graph import Program
from pathways.messages import Call
from pathways.ops import check_fits, spec_of
from pathways.sharding import spec_to_wire


def check_sizes(program: Program, session: Any) -> None:
    """ResourceError before anything is sent if a value the program makes cannot fit the hosts it lands on."""
    for node in program.nodes:
        for value in node.outputs:
            desc = value.slice.desc()
            check_fits(value.aval(), spec_of(spec_to_wire(value.spec)), desc, session.limits(value.slice.island),
                       f"{node.name} in program {program.name!r} (output {value.describe()})")


def dispatch(traced: Traced, leaves: list) -> Any:
    session = current()
    program = traced.program
    inputs = [leaf for leaf in leaves if isinstance(leaf, Array)]
    for a in inputs:
        if a.slice.released:
            raise ProgramError(f"{a} lives on slice {a.slice.key}, which was released; its buffers are gone")
        a.check_alive()
    lowered = traced.lowered
    if lowered is None or lowered.placement != placement_of(program):
        start = time.time()
        check_sizes(program, session)
        lowered = traced.lowered = lower(program, traced.exes)
        session.events.span(f"lower {program.name}", "lower", start, time.time(),
                            fragments=len(lowered.fragments))
    start = time.time() if session.events.enabled else 0.0
    base = session.mint(lowered.n_values)
    input_ids = [a.id for a in inputs]
    for island, fragment in lowered.fragments.items():
        sent = session.sent_exes[island]
        exes = {h: b for h, b in fragment.exes.items() if h not in sent}
        payload = Call(fragment.encoded, base, tuple(input_ids), exes, tuple(session.frees.take(island))).encode()
        session.submit(island, payload)
        sent.update(exes)
    if session.events.enabled:
        session.events.span(f"dispatch {program.name}", "dispatch", start, time.time(),
                            islands=sorted(lowered.fragments), base=base)
    lineage = frozenset(program.islands).union(*(a.islands for a in inputs))
    outputs = []
    for value in program.outputs:
        if value.slot < lowered.n_inputs:
            outputs.append(inputs[value.slot])
        else:
            outputs.append(Array(session, base + value.slot, value.shape, value.dtype, value.slice, value.spec,
                                 lineage, session.epoch(value.slice.island)))
    return jax.tree_util.tree_unflatten(program.out_tree, outputs)
