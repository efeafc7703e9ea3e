"""Islands on their own Ray nodes: the same results as on one node, transfers over the network path, and a
lost node failing only its own island.

The multi-node scenarios run in one subprocess (tests/support/multinode_scenarios.py) on a two-node
``ray.cluster_utils.Cluster`` (separate raylets and object stores); it starts when the first test here
needs it, and the PaLM test computes its single-node reference on the session cluster meanwhile.
The placement logic itself is tested on made-up nodes, in test_node_placement.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_spmd_checks, compile_cache_env
from multinode_scenarios import ELASTIC_STEPS, palm_fingerprint, readme_example
from suite_paths import ROOT, script

import pathways as pw

pytestmark = pytest.mark.cluster  # starts its own cluster



class Scenarios:
    """The scenario script, started at once and read when a test first needs its results."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_TMPDIR stays: its cluster goes there
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # it imports examples
        env.update(compile_cache_env())  # the restarted island's warm-up, and PaLM's step, compile what others did
        self.proc = subprocess.Popen([sys.executable, script("multinode_scenarios.py")], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._results: dict | None = None

    def __getitem__(self, scenario: str) -> dict:
        if self._results is None:
            try:  # about 80 s on an idle 2-core machine, beside the other tests; a busy one takes many times that
                out, err = self.proc.communicate(timeout=1200)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            self._results = {line.get("scenario", "done"): line for line in lines}
            self._results["stderr"] = {"tail": err[-4000:], "rc": self.proc.returncode}
        if scenario not in self._results:
            reported = {k: v.get("seconds") for k, v in self._results.items() if k != "stderr"}
            pytest.fail(f"scenario {scenario!r} did not report (exit {self.proc.returncode}; reported, with their "
                        f"seconds: {reported}):\n{self._results['stderr']['tail']}")
        return self._results[scenario]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def scenarios():
    runs = Scenarios()
    yield runs
    runs.stop()


def assert_spread(nodes: list[list[str]]) -> None:
    """Each island's hosts on one node, and no two islands on the same node."""
    assert all(len(set(hosts)) == 1 for hosts in nodes), nodes
    assert len({hosts[0] for hosts in nodes}) == len(nodes), nodes


# -- on two nodes, the same results as on one ------------------------------------------------------------------

def test_palm_two_pods_on_two_nodes_match_one_node(scenarios, cluster):
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    try:
        one_node = palm_fingerprint(pods)
    finally:
        for s in pods:
            s.release()
    two_nodes = scenarios["palm"]
    assert_spread(two_nodes["nodes"])
    assert two_nodes["params"][0] == two_nodes["params"][1]  # both pods bitwise identical
    assert two_nodes["opt_state"][0] == two_nodes["opt_state"][1]
    for key in ("params", "opt_state", "losses"):
        assert two_nodes[key] == one_node[key], key  # bitwise the single-node run


def test_a_pod_on_another_node_rejoins_over_the_network_with_the_same_bits(scenarios, cluster):
    pods = [pw.slice((2, 2), ("data", "model"), island=i) for i in range(2)]
    try:
        one_node = palm_fingerprint(pods, steps=ELASTIC_STEPS)  # the ordinary two-pod step, no failure
    finally:
        for s in pods:
            s.release()
    r = scenarios["elastic"]
    assert_spread(r["nodes"])  # the restarted island is back on its node
    assert r["rejoined"] and r["pods"] == [[0, 1], [0], [0, 1], [0, 1]], r["pods"]
    assert [k for k in r["events"] if k[0] in ("pod_lost", "rejoined")] == [["pod_lost", 1], ["rejoined", 1]]
    assert r["losses"] == one_node["losses"]
    assert r["params"] == one_node["params"] and r["opt_state"] == one_node["opt_state"]
    assert r["net_bytes_in"] >= r["state_bytes"], r  # the new host's counter: the copy came over the network


def test_readme_example_on_two_nodes(scenarios, cluster):
    s1, s2 = pw.slice((2,), ("x",), island=0), pw.slice((2,), ("x",), island=1)
    try:
        one_node = readme_example(s1, s2)
    finally:
        s1.release()
        s2.release()
    r = scenarios["readme"]
    assert (r["y"], r["z"]) == ([3.0, 5.0], [2.0, 4.0]) == tuple(one_node)
    assert_spread(r["nodes"])
    head = scenarios["cluster"]["head"]
    assert scenarios["where"]["resource_manager"] == head  # so removing the worker leaves the control plane


def test_transfers_across_nodes_go_over_the_network_path_not_the_object_store(scenarios):
    r = scenarios["network"]
    for name in ("matching", "reshard", "still_works"):  # bitwise what numpy computes
        assert r[name].get("unequal") == 0 and r[name]["elements"] == 1024 * 512, (name, r[name])
    assert all(r["addresses"]), r  # every host advertises its data server
    assert r["net_bytes_in"] == r["bytes_in"] == r["net_bytes_out"] == r["moved"], r  # all of it, over the path
    assert r["fallbacks"] == 0, r


def test_a_cross_node_transfer_streams_while_the_sender_computes(scenarios):
    r = scenarios["network"]
    # 32 MiB at the worker's 16 MB/s cap (four chunks, 0.5 s apart) takes 1.5 s or more; the sender's next
    # computation does not wait for it
    assert r["overlap_moved_s"] > 1.2, r
    assert r["overlap_local_s"] < r["overlap_moved_s"] / 2, r


def test_a_connection_without_the_runtime_secret_is_refused(scenarios):
    r = scenarios["network"]
    assert r["refused"] == [True, True] and r["auth_refused"] == 2, r


def test_multihost_islands_pinned_to_their_nodes(scenarios):
    r, nodes = scenarios["multihost"], scenarios["cluster"]
    assert_spmd_checks(r["checks"])
    assert_spread(r["nodes"])
    assert r["nodes"][0] == [nodes["worker"]] * 2  # pinned by a custom resource only the worker offers
    assert r["nodes"][1] == [nodes["head"]] * 2  # pinned by a node label


def test_losing_a_node_fails_its_island_fast_and_spares_the_other(scenarios):
    r = scenarios["node_loss"]
    assert r["y_on_island0"].startswith("IslandFailedError"), r
    assert r["z_on_island1"].startswith("IslandFailedError"), r  # it waited for island 0's transfer
    assert r["after_removal_s"] < 30, r
    assert r["island1_still_works"] == 4.0
    assert r["healthy"] == [False, True] and r["dead_island"] == [0] and "host" in r["reason"]
    assert scenarios["done"]["done"] > 0  # the script tore its cluster down and exited
    assert scenarios["stderr"]["rc"] == 0, scenarios["stderr"]["tail"]


def test_a_node_dying_mid_transfer_fails_the_receive_and_releases_what_had_landed(scenarios):
    r = scenarios["node_loss"]
    assert r["landed_before_removal"] > 0, r  # the transfer was streaming when the node went
    assert r["shipped_to_island1"].startswith("IslandFailedError"), r
    assert r["shipped_to_island1_s"] < 30, r
    assert r["partial_after"] == 0 and r["released"] > 0, r  # the partial landing buffer went back
    assert r["island1_still_works"] == 4.0


def test_single_node_cluster_keeps_islands_together(cluster):
    st = pw.status()
    assert len({h.node for isl in st.islands for h in isl.hosts}) == 1
