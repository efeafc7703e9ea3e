"""Lowering: a location-agnostic Program -> one fragment template per island.

A fragment lists its island's ops (``pathways.ops``) in order: computations,
the sends and receives of every value crossing islands, and local reshards;
each op carries the intermediates to free right after it (their last use
there). Ops name values by *slot*; each call supplies the ids (inputs, plus a
fresh block minted by the client), so one encoded template serves every call
until the slice placement changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pathways.graph import Compute, Program, Transfer, Value
from pathways.ops import Exec, Op, Recv, Reshard, Route, Send, SliceDesc, Template, spec_of
from pathways.sharding import plan_transfer, spec_to_wire


@dataclass(frozen=True)
class Fragment:
    """One island's share of a program: its template (typed and encoded) plus the executables it calls."""

    island: int
    template: Template
    encoded: bytes
    exes: dict[str, bytes]

    @property
    def ops(self) -> tuple[Op, ...]:
        """The template's ops, in order."""
        return self.template.ops


@dataclass(frozen=True)
class Lowered:
    """A lowered program: its value counts, one fragment per island, the placement it was lowered for, its
    slices (in the placement's order) and the islands its values live on."""

    n_inputs: int
    n_values: int
    fragments: dict[int, Fragment]
    placement: tuple
    slices: tuple = ()
    islands: frozenset[int] = frozenset()

    def still_placed(self) -> bool:
        """Whether every slice is where it was when this was lowered (a restart or a rejoin may move one): what
        each call checks before it sends these fragments."""
        if len(self.slices) == 1:  # an op-by-op call's
            s, (_, island, devices) = self.slices[0], self.placement[0]
            return s.island == island and s.devices == devices
        return all((s.island, s.devices) == (island, devices)
                   for s, (_, island, devices) in zip(self.slices, self.placement))


def placement_of(program: Program) -> tuple:
    """What lowering depends on: every slice's island and devices."""
    return tuple((k, s.island, s.devices) for k, s in _slices(program))


def _slices(program: Program) -> list[tuple[str, Any]]:
    return sorted({v.slice.key: v.slice for v in program.values}.items(), key=lambda kv: kv[0])


def _same_host(a: Value, b: Value) -> bool:
    hosts = {h for h, _ in a.slice.devices} | {h for h, _ in b.slice.devices}
    return a.slice.island == b.slice.island and len(hosts) == 1


def lower(program: Program, exes: dict[str, bytes]) -> Lowered:
    """One fragment per island the program touches; sends go right after their value's producer."""
    ops: dict[int, list[Op]] = {}
    slices: dict[int, dict[str, SliceDesc]] = {}
    used_exes: dict[int, dict[str, bytes]] = {}
    produced_at: dict[tuple[int, int], int] = {}  # (island, slot) -> index of the op that produced it
    sends_after: dict[int, dict[int, list[Op]]] = {}  # island -> op index (-1: start) -> sends

    def emit(island: int, op: Op, *values: Value) -> None:
        island_ops = ops.setdefault(island, [])
        for v in values:
            slices.setdefault(island, {})[v.slice.key] = v.slice.desc()
            produced_at[(island, v.slot)] = len(island_ops)
        island_ops.append(op)

    def emit_send(island: int, op: Send, source: Value) -> None:
        """Sends run on a background thread, so each goes right after its value's producer."""
        ops.setdefault(island, [])
        position = produced_at.get((island, source.slot), -1)
        sends_after.setdefault(island, {}).setdefault(position, []).append(op)

    for node in program.nodes:
        if isinstance(node, Compute):
            island = node.slice.island
            emit(island, Exec(node.exe, node.slice.key, tuple(v.slot for v in node.inputs),
                              tuple(v.slot for v in node.outputs),
                              tuple(spec_of(spec_to_wire(s)) for s in node.in_specs),
                              tuple(spec_of(spec_to_wire(s)) for s in node.out_specs), node.name,
                              donate=node.donate), *node.outputs)
            used_exes.setdefault(island, {})[node.exe] = exes[node.exe]
        elif isinstance(node, Transfer):
            src, dst = node.source, node.target
            dst_spec = spec_of(spec_to_wire(dst.spec))
            if _same_host(src, dst):
                emit(dst.slice.island, Reshard(src.slot, dst.slot, dst.slice.key, dst_spec), dst)
                continue
            routes = plan_transfer(src.shape, src.slice.desc(), src.spec, dst.slice.desc(), dst.spec)
            plan = tuple(Route(h, to, tuple(shards)) for h, to, shards in routes)
            emit_send(src.slice.island, Send(src.slot, dst.slot, dst.slice.island, plan), src)
            emit(dst.slice.island, Recv(dst.slot, dst.slice.key, dst_spec, dst.aval(), src.slice.island, plan), dst)
    n_inputs = len(program.inputs)
    keep = {v.slot for v in program.outputs} | set(range(n_inputs))
    fragments = {}
    for island, island_ops in ops.items():
        after = sends_after.get(island, {})
        placed = list(after.get(-1, []))
        for i, op in enumerate(island_ops):
            placed.append(op)
            placed.extend(after.get(i, []))
        template = Template(program.name, n_inputs, len(program.values), slices.get(island, {}),
                            tuple(with_frees(placed, keep)))
        fragments[island] = Fragment(island, template, template.encode(), used_exes.get(island, {}))
    return Lowered(n_inputs, len(program.values), fragments, placement_of(program),
                   tuple(s for _, s in _slices(program)), program.islands)


def with_frees(ops: list[Op], keep: set[int]) -> list[Op]:
    """Attach to each op the intermediates whose last touch on this island it is: freed right after it."""
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for slot in op.touches():
            if slot not in keep:
                last[slot] = i
    frees: dict[int, list[int]] = {}
    for slot, i in last.items():
        frees.setdefault(i, []).append(slot)
    return [replace(op, frees=tuple(sorted(frees[i]))) if i in frees else op for i, op in enumerate(ops)]
