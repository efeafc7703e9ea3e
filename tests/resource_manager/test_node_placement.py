"""Placement of islands on Ray nodes, decided on made-up nodes: round robin over nodes, hosts of an island kept
together, pins by label and by custom resource, GPU islands, and topologies that carry their pins."""

from __future__ import annotations

import json

import pytest

import pathways as pw
from pathways.errors import ResourceError
from resource_manager.nodes import Node, host_bundle, matches, plan


def node(name: str, cpus: float = 2, gpus: float = 0, head: bool = False, extra: dict | None = None,
         **labels: str) -> Node:
    resources = {"CPU": cpus, "memory": 2**33, f"node:{name}": 1.0, **({"GPU": gpus} if gpus else {}), **(extra or {})}
    return Node(name, "127.0.0.1", {"ray.io/node-id": name, **labels}, resources, head)


def test_islands_go_round_robin_over_nodes_and_hosts_stay_together():
    nodes = [node("a", head=True), node("b"), node("c")]
    assert plan(pw.Topology(2, 2, 4), nodes) == ["a", "b"]
    assert plan(pw.Topology(4, 1, 4), nodes) == ["a", "b", "c", "a"]
    assert plan(pw.Topology(2, 1, 4), nodes[:1]) == ["a", "a"]  # one node: everything there, as before


def test_nodes_without_cpus_are_a_last_resort():
    assert plan(pw.Topology(2, 1, 4), [node("head", cpus=0, head=True), node("w")]) == ["w", "w"]
    assert plan(pw.Topology(1, 1, 4), [node("head", cpus=0, head=True)]) == ["head"]


def test_pins_by_label_and_by_custom_resource():
    nodes = [node("a", head=True, zone="x"), node("b", zone="y"), node("c", extra={"pod": 4}, zone="y")]
    topology = pw.Topology(3, 2, 4, node_labels={0: {"zone": "y"}, 1: {"zone": "!y"}},
                           host_resources={2: {"pod": 2}})
    assert plan(topology, nodes) == ["b", "a", "c"]
    assert host_bundle(topology, 2) == {"memory": 1, "pod": 2}
    with pytest.raises(ResourceError, match="island 0 needs a node with labels"):
        plan(pw.Topology(1, 1, 4, node_labels={0: {"zone": "z"}}), nodes)
    with pytest.raises(ResourceError, match="island 0"):
        plan(pw.Topology(1, 1, 4, host_resources={0: {"pod": 8}}), nodes)


def test_gpu_islands_fill_nodes_and_spill_when_none_can_hold_one():
    nodes = [node("a", gpus=8, head=True), node("b", gpus=4)]
    gpu = pw.Topology(3, 1, 4, platform="gpu")
    assert host_bundle(gpu, 0) == {"memory": 1, "GPU": 4}
    assert plan(gpu, nodes) == ["a", "b", "a"]
    assert plan(pw.Topology(1, 2, 8, platform="gpu"), nodes) == [None]  # 16 GPUs: Ray packs it over nodes


def test_label_selector_syntax():
    labels = {"zone": "a", "tier": "gold"}
    assert matches(labels, {"zone": "a"}) and not matches(labels, {"zone": "b"})
    assert matches(labels, {"zone": "!b"}) and not matches(labels, {"zone": "!a"})
    assert matches(labels, {"zone": "in(a, b)"}) and not matches(labels, {"zone": "!in(a,b)"})
    assert matches(labels, {"missing": "!x"}) and not matches(labels, {"missing": "x"})


def test_topology_pins_round_trip_and_stay_positional():
    plain = pw.Topology(2, 1, 4)
    assert plain.to_wire() == {"islands": 2, "hosts_per_island": 1, "devices_per_host": 4, "platform": "cpu"}
    pinned = pw.Topology(2, 2, 2, "cpu", {1: {"zone": "b"}}, {0: {"pod_a": 1}})
    assert pw.Topology.from_wire(json.loads(json.dumps(pinned.to_wire()))) == pinned
    assert hash(pinned) == hash(pw.Topology(2, 2, 2, node_labels={1: {"zone": "b"}},
                                            host_resources={0: {"pod_a": 1}}))
    assert pinned.labels_of(1) == {"zone": "b"} and pinned.labels_of(0) == {}
    assert "island 1 on nodes zone=b" in str(pinned)
    for bad in ({"node_labels": {2: {"a": "b"}}}, {"node_labels": {0: {"a": 1}}},
                {"host_resources": {0: {"pod": 0}}}):
        with pytest.raises(ValueError):
            pw.Topology(2, **bad)
