"""Placement of a virtual slice onto one island's devices (``resource_manager.placement``), without Ray: the
request's rules, the islands it may use, load balancing, and the errors a careless caller gets."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pathways.errors import ResourceError
from pathways.ops import SliceDesc
from pathways.topology import Topology
from resource_manager.placement import Allocation, Inventory, place, validate_request


def allocation(key: str, island: int, devices: list[tuple[int, int]]) -> Allocation:
    return Allocation(key, "t", 1, island, (len(devices),), ("x",), devices)


def inventory(islands: int = 2, hosts: int = 2, devices: int = 4, unhealthy: dict[int, str] | None = None,
              allocations: list[Allocation] = ()) -> Inventory:
    return Inventory(Topology(islands, hosts, devices), dict(unhealthy or {}), {a.key: a for a in allocations})


@pytest.mark.parametrize("shape, axes, says", [
    ((2, 2), ("x",), "has 2 dimension\\(s\\) but axis names"),
    ((), (), "non-empty tuple of positive ints"),
    ((0,), ("x",), "non-empty tuple of positive ints"),
    ((-2,), ("x",), "non-empty tuple of positive ints"),
    ((2.0,), ("x",), "non-empty tuple of positive ints"),
    (("2",), ("x",), "non-empty tuple of positive ints"),
    ((2, 2), ("x", "x"), "must be distinct non-empty strings"),
    ((2,), ("",), "must be distinct non-empty strings"),
    ((2,), (3,), "must be distinct non-empty strings"),
])
def test_a_malformed_request_is_refused_with_what_was_wrong(shape, axes, says):
    with pytest.raises(ResourceError, match=says):
        validate_request(shape, axes)
    with pytest.raises(ResourceError, match=says):  # place checks the request before anything else
        place(inventory(), shape, axes, None)


def test_a_well_formed_request_passes():
    validate_request((1,), ("x",))
    validate_request((2, 3, 1), ("a", "b", "c"))


@pytest.mark.parametrize("island", [2, -1, 7, "0", 1.0, (0,)])
def test_an_island_that_does_not_exist_is_named_with_what_does(island):
    with pytest.raises(ResourceError, match=r"on island .* which does not exist; the cluster has 2 island\(s\)"):
        place(inventory(), (2,), ("x",), island)


def test_an_unhealthy_island_is_refused_with_its_reason_and_never_chosen():
    inv = inventory(islands=3, unhealthy={1: "host 0 died"})
    with pytest.raises(ResourceError, match=r"island 1, which is unhealthy \(host 0 died\).*healthy: \[0, 2\]"):
        place(inv, (2,), ("x",), 1)
    for k in range(6):  # whatever the load, island 1 is never a candidate
        island, devices = place(inv, (4,), ("x",), None)
        assert island != 1
        inv.allocations[f"s{k}"] = allocation(f"s{k}", island, devices)
    assert {a.island for a in inv.allocations.values()} == {0, 2}


def test_no_healthy_island_at_all_says_so():
    inv = inventory(unhealthy={0: "gone", 1: "gone too"})
    with pytest.raises(ResourceError, match=r"no island is healthy; .*healthy: \[\]"):
        place(inv, (1,), ("x",), None)


def test_a_slice_larger_than_an_island_names_the_largest_island():
    inv = inventory(islands=2, hosts=2, devices=4)
    with pytest.raises(ResourceError, match=r"\(9 devices\), but the largest island has 8 devices"):
        place(inv, (3, 3), ("x", "y"), None)
    with pytest.raises(ResourceError, match="largest island has 8 devices"):
        place(inv, (9,), ("x",), 0)
    island, devices = place(inv, (2, 4), ("x", "y"), None)  # exactly an island: every device of it, in order
    assert island == 0 and devices == [(h, d) for h in range(2) for d in range(4)]


def test_the_least_loaded_healthy_island_is_chosen_and_ties_go_to_the_lowest():
    inv = inventory(islands=3, hosts=1, devices=4)
    assert place(inv, (2,), ("x",), None)[0] == 0
    inv.allocations["a"] = allocation("a", 0, [(0, 0), (0, 1)])
    assert place(inv, (2,), ("x",), None)[0] == 1
    inv.allocations["b"] = allocation("b", 1, [(0, 0)])
    assert place(inv, (2,), ("x",), None)[0] == 2
    inv.allocations["c"] = allocation("c", 2, [(0, 0), (0, 1), (0, 2)])
    assert place(inv, (2,), ("x",), None)[0] == 1  # loads 2, 1, 3
    assert place(inv, (2,), ("x",), 2)[0] == 2  # an explicit island is kept, loaded or not


def test_a_slice_that_fits_on_one_host_takes_the_least_loaded_devices_of_the_least_loaded_host():
    inv = inventory(islands=1, hosts=2, devices=4)
    assert place(inv, (2,), ("x",), None) == (0, [(0, 0), (0, 1)])
    inv.allocations["a"] = allocation("a", 0, [(0, 0), (0, 1)])
    assert place(inv, (3,), ("x",), None) == (0, [(1, 0), (1, 1), (1, 2)])  # host 1 is empty
    inv.allocations["b"] = allocation("b", 0, [(1, 0), (1, 1), (1, 2)])
    # host 0 carries 2, host 1 carries 3: host 0, its two idle devices first, then the lowest loaded one
    assert place(inv, (3,), ("x",), None) == (0, [(0, 0), (0, 2), (0, 3)])


def test_a_slice_that_spans_hosts_takes_whole_least_loaded_hosts():
    inv = inventory(islands=1, hosts=4, devices=2)
    inv.allocations["a"] = allocation("a", 0, [(0, 0)])
    inv.allocations["b"] = allocation("b", 0, [(2, 1)])
    _, devices = place(inv, (3,), ("x",), None)  # two hosts needed: 1 and 3 are idle
    assert devices == [(1, 0), (1, 1), (3, 0)]
    _, devices = place(inv, (2, 3), ("x", "y"), None)  # three hosts: 1, 3 and then the lowest of the tied 0, 2
    assert devices == [(0, 0), (0, 1), (1, 0), (1, 1), (3, 0), (3, 1)]


def test_every_placement_is_distinct_devices_of_one_healthy_island_within_the_topology():
    """Whatever the cluster and its load, a slice gets exactly as many distinct, existing devices as it asks for."""
    rng = random.Random(7)
    for _ in range(200):
        t = Topology(rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 4))
        unhealthy = {i: "down" for i in range(t.islands) if rng.random() < 0.3}
        if len(unhealthy) == t.islands:
            unhealthy.pop(0)
        inv = Inventory(t, unhealthy)
        for k in range(rng.randint(1, 6)):
            dims = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]
            if math.prod(dims) > t.devices_per_island:
                continue
            axes = tuple("xy"[: len(dims)])
            island, devices = place(inv, tuple(dims), axes, None)
            assert island not in unhealthy and 0 <= island < t.islands
            assert len(devices) == len(set(devices)) == math.prod(dims)
            assert all(0 <= h < t.hosts_per_island and 0 <= d < t.devices_per_host for h, d in devices)
            inv.allocations[f"s{k}"] = Allocation(f"s{k}", "t", 1, island, tuple(dims), axes, devices)


def test_the_load_counts_each_device_of_each_slice_and_describe_names_the_cluster():
    a = allocation("a", 0, [(0, 0), (0, 1)])
    b = allocation("b", 0, [(0, 1)])
    c = allocation("c", 1, [(0, 1)])
    inv = inventory(islands=2, hosts=1, devices=2, unhealthy={1: "x"}, allocations=[a, b, c])
    assert inv.load() == {(0, 0, 0): 1, (0, 0, 1): 2, (1, 0, 1): 1}
    assert inv.describe() == ("the cluster has 2 island(s) (healthy: [0]), each of 1 host(s) x 2 device(s) = 2 "
                              "devices")


def test_an_allocation_reads_as_a_slice_and_as_its_wire_form():
    a = Allocation("s3", "acme", 7, 1, (2, 2), ("x", "y"), [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert a.desc() == SliceDesc("s3", (2, 2), ("x", "y"), ((0, 0), (0, 1), (1, 0), (1, 1)))
    wire = a.to_wire()
    assert wire == {"key": "s3", "shape": [2, 2], "axes": ["x", "y"], "devices": [[0, 0], [0, 1], [1, 0], [1, 1]],
                    "island": 1, "tenant": "acme", "client": 7}
    assert SliceDesc.from_wire(wire) == a.desc()  # what pw.slice receives reads back as the same slice


def test_placing_does_not_change_the_inventory():
    inv = inventory(allocations=[allocation("a", 0, [(0, 0)])])
    before = (dict(inv.allocations), dict(inv.unhealthy))
    for shape in itertools.islice(itertools.cycle([(1,), (4,), (2, 3)]), 6):
        place(inv, shape, tuple("xy"[: len(shape)]), None)
    assert (inv.allocations, inv.unhealthy) == before
