"""Shard arithmetic: which region of a global array each mesh device holds, which host sends each distinct
shard, and the routes of a transfer between two slices (pathways/sharding.py), checked against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pathways as pw
from pathways.ops import SliceDesc
from pathways.sharding import (
    check_spec,
    coords,
    device_indices,
    intersection,
    overlaps,
    owned_shards,
    plan_transfer,
    shard_index,
)


def desc(shape: tuple[int, ...], axes: tuple[str, ...], hosts: int) -> SliceDesc:
    """A slice whose mesh devices fill ``hosts`` hosts in order, the same number on each."""
    n = math.prod(shape)
    per_host = n // hosts
    return SliceDesc("s", shape, axes, tuple((k // per_host, k % per_host) for k in range(n)))


def size(region) -> int:
    return math.prod(b - a for a, b in region)


def cut(array: np.ndarray, region) -> np.ndarray:
    return array[tuple(slice(a, b) for a, b in region)]


# -- regions -----------------------------------------------------------------------------------------------

def test_mesh_coordinates_are_row_major():
    assert [coords(k, (2, 3)) for k in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert coords(7, (2, 2, 2)) == (1, 1, 1) and coords(0, (4,)) == (0,)


def test_each_device_holds_its_block_of_a_sharded_dimension():
    assert [shard_index((8, 2), (4,), ("x",), P("x"), k) for k in range(4)] == [
        ((0, 2), (0, 2)), ((2, 4), (0, 2)), ((4, 6), (0, 2)), ((6, 8), (0, 2))]


def test_an_unnamed_or_missing_dimension_is_whole_and_a_replicated_value_is_everywhere():
    assert shard_index((4, 6), (2,), ("x",), P(None, "x"), 1) == ((0, 4), (3, 6))
    assert shard_index((4, 6), (2,), ("x",), P("x"), 1) == ((2, 4), (0, 6))  # spec shorter than the rank
    assert {shard_index((4, 6), (2, 2), ("x", "y"), P(), k) for k in range(4)} == {((0, 4), (0, 6))}


def test_a_dimension_over_two_axes_is_split_major_axis_first():
    # mesh (x=2, y=2): device k has x = k // 2, y = k % 2; P(("x", "y")) numbers the blocks x * 2 + y
    blocks = [shard_index((8,), (2, 2), ("x", "y"), P(("x", "y")), k) for k in range(4)]
    assert blocks == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)]
    swapped = [shard_index((8,), (2, 2), ("x", "y"), P(("y", "x")), k) for k in range(4)]
    assert swapped == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


def test_an_axis_left_out_of_the_spec_replicates_along_it():
    regions = device_indices((4, 4), desc((2, 2), ("x", "y"), 1), P("y"))
    assert regions == [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 2), (0, 4)), ((2, 4), (0, 4))]


@pytest.mark.parametrize("mesh, axes, spec", [
    ((4,), ("x",), P("x")), ((2, 2), ("x", "y"), P("x", "y")), ((2, 2), ("x", "y"), P("y", "x")),
    ((2, 2), ("x", "y"), P(("x", "y"))), ((2, 2), ("x", "y"), P(None, ("y", "x"))),
    ((2, 2), ("x", "y"), P("x")), ((2, 2), ("x", "y"), P()), ((2, 3), ("a", "b"), P("b", "a")),
])
def test_the_distinct_regions_of_a_sharding_tile_the_array(mesh, axes, spec):
    shape = (12, 12)
    check_spec(spec, shape, mesh, axes)
    regions = device_indices(shape, desc(mesh, axes, 1), spec)
    distinct = set(regions)
    counts = np.zeros(shape, int)
    for region in distinct:
        counts[tuple(slice(a, b) for a, b in region)] += 1
    assert (counts == 1).all(), "distinct regions must cover every element exactly once"
    assert len({size(r) for r in regions}) == 1  # every device holds the same amount
    assert len(regions) // len(distinct) == math.prod(mesh) // len(distinct)  # each replicated equally often


def test_intersection_of_regions_and_touching_regions_do_not_overlap():
    assert intersection(((0, 4), (0, 4)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersection(((0, 2),), ((2, 4),)) is None and not overlaps(((0, 2),), ((2, 4),))
    assert overlaps(((0, 3), (0, 1)), ((2, 4), (0, 1)))


@pytest.mark.parametrize("spec, shape, words", [
    (P("z"), (4,), "names mesh axis 'z'"),
    (P("x", "x"), (4, 4), "uses mesh axis 'x' twice"),
    (P("x"), (3,), "dimension 0 of shape (3,) is not divisible by the 2 shards"),
    (P("x", None, None), (4, 4), "has 3 entries but the array has rank 2"),
    ("x", (4,), "expected a jax.sharding.PartitionSpec"),
])
def test_a_spec_that_cannot_shard_the_array_is_a_program_error(spec, shape, words):
    with pytest.raises(pw.ProgramError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_spec(spec, shape, (2,), ("x",), "value")


# -- who sends -------------------------------------------------------------------------------------------

def test_each_shard_is_sent_by_its_first_holder():
    two_hosts = desc((2, 2), ("x", "y"), 2)  # host 0 holds x = 0, host 1 holds x = 1
    assert owned_shards((4,), two_hosts, P("x")) == {((0, 2),): 0, ((2, 4),): 1}
    # sharded along y only: both hosts hold both halves; host 0, the first holder, sends both
    assert owned_shards((4,), two_hosts, P("y")) == {((0, 2),): 0, ((2, 4),): 0}
    assert owned_shards((4,), two_hosts, P()) == {((0, 4),): 0}


# -- routes ------------------------------------------------------------------------------------------------

def test_matching_shardings_on_equal_islands_go_host_i_to_host_i():
    src, dst = desc((4,), ("x",), 2), desc((4,), ("x",), 2)
    routes = plan_transfer((8, 2), src, P("x"), dst, P("x"))
    assert routes == [(0, 0, [((0, 2), (0, 2)), ((2, 4), (0, 2))]), (1, 1, [((4, 6), (0, 2)), ((6, 8), (0, 2))])]


def test_a_replicated_source_sends_from_one_holder_only():
    src, dst = desc((2, 2), ("x", "y"), 2), desc((4,), ("x",), 2)
    routes = plan_transfer((8,), src, P(), dst, P("x"))
    assert routes == [(0, 0, [((0, 8),)]), (0, 1, [((0, 8),)])]


def test_a_destination_host_gets_only_the_shards_its_devices_need():
    src, dst = desc((4,), ("x",), 1), desc((4,), ("x",), 2)
    routes = plan_transfer((8,), src, P("x"), dst, P("x"))
    assert routes == [(0, 0, [((0, 2),), ((2, 4),)]), (0, 1, [((4, 6),), ((6, 8),)])]


TRANSFERS = [
    # (shape, src mesh, src axes, src hosts, src spec, dst mesh, dst axes, dst hosts, dst spec)
    ((8, 4), (4,), ("x",), 2, P("x"), (4,), ("x",), 2, P("x")),
    ((8, 4), (4,), ("x",), 2, P("x"), (4,), ("x",), 2, P(None, "x")),
    ((8, 4), (2, 2), ("d", "m"), 2, P("d", "m"), (2, 2), ("d", "m"), 2, P("m", "d")),
    ((8, 4), (2, 2), ("d", "m"), 2, P("d", "m"), (4,), ("x",), 1, P("x")),
    ((8, 4), (4,), ("x",), 1, P(None, "x"), (2, 2), ("d", "m"), 2, P(("d", "m"))),
    ((8, 4), (2, 2), ("d", "m"), 2, P("m"), (2,), ("x",), 2, P("x")),
    ((8, 4), (2,), ("x",), 2, P(), (2, 2), ("d", "m"), 2, P("d", "m")),
    ((12, 6), (2, 3), ("a", "b"), 2, P("a", "b"), (3, 2), ("a", "b"), 3, P("a", "b")),
    ((12, 6), (3, 2), ("a", "b"), 3, P(("a", "b")), (2, 3), ("a", "b"), 1, P(None, "b")),
]


@pytest.mark.parametrize("shape, sm, sa, sh, sspec, dm, da, dh, dspec", TRANSFERS)
def test_every_destination_region_is_covered_exactly_once_by_shards_its_sender_holds(
        shape, sm, sa, sh, sspec, dm, da, dh, dspec):
    """Simulate the transfer with numpy: each destination device's region, filled from the shards routed to
    its host, is the global array's region, and every element of it is written by exactly one shard."""
    src, dst = desc(sm, sa, sh), desc(dm, da, dh)
    routes = plan_transfer(shape, src, sspec, dst, dspec)
    held = {}  # host -> the regions its devices hold
    for k, region in enumerate(device_indices(shape, src, sspec)):
        held.setdefault(src.devices[k][0], set()).add(region)
    received: dict[int, list] = {}
    for host, to, shards in routes:
        assert set(shards) <= held[host], f"host {host} sends shards it does not hold: {shards}"
        received.setdefault(to, []).extend(shards)
    array = np.arange(math.prod(shape)).reshape(shape)
    for k, want in enumerate(device_indices(shape, dst, dspec)):
        to = dst.devices[k][0]
        out, writes = np.full([b - a for a, b in want], -1), np.zeros([b - a for a, b in want], int)
        for shard in received.get(to, []):
            shared = intersection(shard, want)
            if shared is not None:
                into = tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(shared, want))
                out[into] = cut(array, shared)
                writes[into] += 1
        assert (writes == 1).all(), f"device {k} on host {to}: elements written {writes.tolist()} times"
        np.testing.assert_array_equal(out, cut(array, want))
    for host, to, shards in routes:  # nothing is sent that its destination host does not need
        wanted = [w for k, w in enumerate(device_indices(shape, dst, dspec)) if dst.devices[k][0] == to]
        assert all(any(overlaps(s, w) for w in wanted) for s in shards), (host, to, shards)
    assert routes == sorted(routes, key=lambda r: (r[0], r[1]))  # sorted by (source host, destination host)
