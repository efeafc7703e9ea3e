"""Where islands run: one Ray placement group per island, islands spread over nodes, optionally pinned.

The resource manager picks each island's node itself: the alive nodes that
match the island's pins (node labels, custom resources) and can still hold
all of its hosts, the one with the fewest islands so far first (so islands
go round robin over nodes). It then reserves the island with a STRICT_PACK
placement group whose bundles (one per host) carry a ``ray.io/node-id``
label selector for that node. An island's hosts thus share a node, and
islands spread over nodes deterministically, as far as the cluster has
nodes. A single SPREAD group would also scatter the hosts of one island,
and would not let each island be pinned on its own.

When no node can hold a whole island (a GPU island larger than any node),
its group is PACK with only the pins as selectors: Ray puts its hosts on as
few nodes as fit.

A bundle asks for one byte of ``memory`` (plus the host's GPUs and the
island's custom resources): Ray refuses bundles that ask for nothing, and a
byte reserves nothing that matters, where even a small fraction of a CPU
per host would stop two 1-CPU tasks from running at once on a 2-core node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pathways.errors import ResourceError
from pathways.topology import Topology

NODE_ID_LABEL = "ray.io/node-id"
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class Node:
    """An alive Ray node, as ``ray.nodes()`` reports it."""

    id: str
    ip: str
    labels: dict[str, str]
    resources: dict[str, float]  # totals
    head: bool


@dataclass
class IslandPlacement:
    """Where one island's hosts were reserved: its placement group, and the node chosen (None: Ray chose)."""

    island: int
    group: PlacementGroup
    node: str | None
    strategy: str

    def strategy_for(self, host: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts host ``host`` of the island in its bundle."""
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=host)


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes, head first, then by address and id (a stable order for round robin)."""
    nodes = [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Labels") or {}), dict(n["Resources"]),
                  HEAD_RESOURCE in n["Resources"])
             for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: (not n.head, n.ip, n.id))


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether node ``labels`` satisfy a Ray label selector: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``."""
    for key, want in selector.items():
        negate = want.startswith("!")
        want = want[1:] if negate else want
        allowed = {v.strip() for v in want[3:-1].split(",")} if want.startswith("in(") and want.endswith(")") \
            else {want}
        if (labels.get(key) in allowed) == negate:
            return False
    return True


def host_bundle(topology: Topology, island: int) -> dict[str, float]:
    """What each host of ``island`` reserves on its node."""
    bundle: dict[str, float] = {"memory": 1}
    if topology.platform == "gpu":
        bundle["GPU"] = topology.gpus_per_host
    bundle.update(topology.resources_of(island))
    return bundle


def plan(topology: Topology, nodes: Sequence[Node]) -> list[str | None]:
    """The node each island goes to (None where no single node can hold the whole island).

    Pure: it sees only ``nodes``' totals and what earlier islands of this plan took from them.
    """
    left = {n.id: dict(n.resources) for n in nodes}
    islands_on = {n.id: 0 for n in nodes}
    chosen: list[str | None] = []
    for island in range(topology.islands):
        selector, need = topology.labels_of(island), host_bundle(topology, island)
        eligible = [n for n in nodes if matches(n.labels, selector)
                    and all(n.resources.get(k, 0) >= v for k, v in need.items())]
        if not eligible:
            raise ResourceError(
                f"island {island} needs a node with labels {selector or 'any'} and, per host, resources {need}; "
                f"the alive nodes are: " + "; ".join(f"{n.id[:12]} {n.ip} labels {n.labels} resources "
                                                      f"{_short(n.resources)}" for n in nodes))
        eligible = [n for n in eligible if _computes(n)] or eligible  # a node that offers no CPU or GPU: last resort
        whole = {k: v * topology.hosts_per_island for k, v in need.items()}
        fits = [n for n in eligible if all(left[n.id].get(k, 0) >= v for k, v in whole.items())]
        if not fits:
            chosen.append(None)
            continue
        best = min(fits, key=lambda n: islands_on[n.id])  # min keeps the first of equals: head first
        islands_on[best.id] += 1
        for k, v in whole.items():
            left[best.id][k] -= v
        chosen.append(best.id)
    return chosen


def reserve(topology: Topology, timeout: float) -> list[IslandPlacement]:
    """Reserve every island's hosts (one placement group each), waiting at most ``timeout`` for all of them."""
    targets = plan(topology, alive_nodes())
    placements = []
    for island, node in enumerate(targets):
        bundle, selector = host_bundle(topology, island), topology.labels_of(island)
        strategy = "STRICT_PACK" if node else "PACK"
        if node:
            selector = {**selector, NODE_ID_LABEL: node}
        n = topology.hosts_per_island
        group = placement_group([dict(bundle) for _ in range(n)], strategy=strategy,
                                bundle_label_selector=[dict(selector) for _ in range(n)] if selector else None)
        placements.append(IslandPlacement(island, group, node, strategy))
    ready = {p.group.ready(): p for p in placements}
    _, pending = ray.wait(list(ready), num_returns=len(ready), timeout=timeout)
    if pending:
        for p in placements:
            remove_placement_group(p.group)
        late = sorted(ready[ref].island for ref in pending)
        raise ResourceError(f"could not reserve the hosts of island(s) {late} within {timeout:.0f}s: their nodes "
                            "lack free resources (see `ray status`)")
    return placements


def user_labels(node_id: str, nodes: Sequence[Node]) -> dict[str, str]:
    """A node's labels without Ray's own (``ray.io/...``): what a topology can pin islands to."""
    for n in nodes:
        if n.id == node_id:
            return {k: v for k, v in n.labels.items() if not k.startswith("ray.io/")}
    return {}


def _computes(node: Node) -> bool:
    return node.resources.get("CPU", 0) > 0 or node.resources.get("GPU", 0) > 0


def _short(resources: Mapping[str, float]) -> dict[str, float]:
    """Resources worth showing in an error: without per-node markers and byte counts."""
    hidden = ("memory", "object_store_memory")
    return {k: v for k, v in resources.items() if not k.startswith("node:") and k not in hidden}
