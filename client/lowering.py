"""Lowering: a location-agnostic Program -> one Fragment template per island.

A fragment lists its island's ops in order: computations, the sends and
receives of every value crossing islands, and local reshards; each op
carries the intermediates to free right after it (their last use there). Ops name values by *slot*; each
call supplies the ids (inputs, plus a fresh block minted by the client), so
one encoded template serves every call until the slice placement changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pathways import wire
from pathways.graph import Compute, Program, Transfer, Value
from pathways.sharding import plan_transfer, spec_to_wire


@dataclass(frozen=True)
class Fragment:
    """One island's share of a program: encoded ops plus the executables they call."""

    island: int
    template: bytes
    exes: dict[str, bytes]
    ops: list[dict]


@dataclass(frozen=True)
class Lowered:
    n_inputs: int
    n_values: int
    fragments: dict[int, Fragment]
    placement: tuple


def placement_of(program: Program) -> tuple:
    """What lowering depends on: every slice's island and devices."""
    slices = {v.slice.key: v.slice for v in program.values}
    return tuple(sorted((k, s.island, s.devices) for k, s in slices.items()))


def _same_host(a: Value, b: Value) -> bool:
    hosts = {h for h, _ in a.slice.devices} | {h for h, _ in b.slice.devices}
    return a.slice.island == b.slice.island and len(hosts) == 1


def lower(program: Program, exes: dict[str, bytes]) -> Lowered:
    ops: dict[int, list[dict]] = {}
    slices: dict[int, dict[str, dict]] = {}
    used_exes: dict[int, dict[str, bytes]] = {}
    produced_at: dict[tuple[int, int], int] = {}  # (island, slot) -> index of the op that produced it
    sends_after: dict[int, dict[int, list[dict]]] = {}  # island -> op index (-1: start) -> sends

    def emit(island: int, op: dict, *values: Value) -> None:
        island_ops = ops.setdefault(island, [])
        for v in values:
            slices.setdefault(island, {})[v.slice.key] = v.slice.desc()
            produced_at[(island, v.slot)] = len(island_ops)
        island_ops.append(op)

    def emit_send(island: int, op: dict, source: Value) -> None:
        """Sends run on a background thread, so each goes right after its value's producer."""
        ops.setdefault(island, [])
        position = produced_at.get((island, source.slot), -1)
        sends_after.setdefault(island, {}).setdefault(position, []).append(op)

    for node in program.nodes:
        if isinstance(node, Compute):
            island = node.slice.island
            emit(island, {"op": "exec", "exe": node.exe, "slice": node.slice.key, "name": node.name,
                          "in": [v.slot for v in node.inputs], "out": [v.slot for v in node.outputs],
                          "in_specs": [spec_to_wire(s) for s in node.in_specs],
                          "out_specs": [spec_to_wire(s) for s in node.out_specs]}, *node.outputs)
            used_exes.setdefault(island, {})[node.exe] = exes[node.exe]
        elif isinstance(node, Transfer):
            src, dst = node.source, node.target
            if _same_host(src, dst):
                emit(dst.slice.island, {"op": "reshard", "in": src.slot, "out": dst.slot, "slice": dst.slice.key,
                                        "spec": spec_to_wire(dst.spec)}, dst)
                continue
            routes, expect = plan_transfer(src.shape, src.slice.desc(), src.spec, dst.slice.desc(), dst.spec)
            emit_send(src.slice.island, {"op": "send", "in": src.slot, "key": dst.slot,
                                         "island": dst.slice.island, "routes": routes}, src)
            emit(dst.slice.island, {"op": "recv", "out": dst.slot, "slice": dst.slice.key,
                                    "spec": spec_to_wire(dst.spec), "src": src.slice.island, "expect": expect,
                                    "routes": routes,  # which source host may send which shards to which host
                                    "aval": {"shape": list(dst.shape), "dtype": dst.dtype.name}}, dst)
    n_inputs = len(program.inputs)
    keep = {v.slot for v in program.outputs} | set(range(n_inputs))
    fragments = {}
    for island, island_ops in ops.items():
        after = sends_after.get(island, {})
        placed = list(after.get(-1, []))
        for i, op in enumerate(island_ops):
            placed.append(op)
            placed.extend(after.get(i, []))
        island_ops = _with_frees(placed, keep)
        template = wire.encode("template", {"program": program.name, "n_inputs": n_inputs,
                                            "n_values": len(program.values),
                                            "slices": slices.get(island, {}), "ops": island_ops})
        fragments[island] = Fragment(island, template, used_exes.get(island, {}), island_ops)
    return Lowered(n_inputs, len(program.values), fragments, placement_of(program))


def _reads(op: dict) -> list[int]:
    if op["op"] == "exec":
        return op["in"]
    if op["op"] in ("send", "reshard"):
        return [op["in"]]
    return []


def _writes(op: dict) -> list[int]:
    out = op.get("out", [])
    return out if isinstance(out, list) else [out]


def _with_frees(ops: list[dict], keep: set[int]) -> list[dict]:
    """Attach to each op the intermediates whose last touch on this island it is: freed right after it."""
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for slot in _reads(op) + _writes(op):
            if slot not in keep:
                last[slot] = i
    frees: dict[int, list[int]] = {}
    for slot, i in last.items():
        frees.setdefault(i, []).append(slot)
    return [{**op, "frees": sorted(frees[i])} if i in frees else op for i, op in enumerate(ops)]
