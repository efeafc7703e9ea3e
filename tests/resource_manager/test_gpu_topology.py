"""GPU topologies, checked without a GPU: hosts that share a GPU (Ray's fractional GPUs) with each host's XLA
client at its share of the memory, what hosts say about their devices, and the sizes the GPU check picks."""

from __future__ import annotations

import types

import pytest

import pathways as pw
from benchmarks import gpu_check
from examples import quickstart
from examples.palm import peak
from resource_manager.host.devices import LocalDevices
from resource_manager.island import host_runtime_env
from resource_manager.nodes import Node, host_bundle, plan


def test_hosts_share_a_gpu_each_at_its_share_of_the_memory():
    half = pw.Topology(islands=2, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=0.5)
    assert (half.gpus_per_host, half.host_memory_fraction) == (0.5, 0.375)  # JAX's 0.75, times the share
    assert host_runtime_env(half)["env_vars"] == {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.375"}
    assert host_bundle(half, 1) == {"memory": 1, "GPU": 0.5}
    assert pw.Topology.from_wire(half.to_wire()) == half
    assert str(half) == "2 island(s) x 1 host(s) x 1 gpu device(s) (0.5 of a GPU each)"
    whole = pw.Topology(islands=1, hosts_per_island=1, devices_per_host=4, platform="gpu")
    assert (whole.gpus_per_host, whole.host_memory_fraction) == (4, None)  # JAX's own default
    assert host_runtime_env(whole)["env_vars"] == {"JAX_PLATFORMS": "cuda"}
    assert "gpu_share" not in whole.to_wire()  # a whole-GPU topology keeps its wire form
    given = pw.Topology(islands=1, devices_per_host=1, platform="gpu", gpu_memory_fraction=0.9)
    assert host_runtime_env(given)["env_vars"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    cpu = pw.Topology()
    assert (cpu.gpus_per_host, cpu.host_memory_fraction) == (0, None) and "memory" not in str(cpu)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in host_runtime_env(cpu)["env_vars"]


def test_two_islands_at_half_a_gpu_go_on_a_node_with_one():
    gpu_node = Node("g", "10.0.0.1", {}, {"CPU": 16, "GPU": 1, "memory": 2**36}, True)
    half = pw.Topology(islands=2, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=0.5)
    assert plan(half, [gpu_node]) == ["g", "g"]
    three = pw.Topology(islands=3, hosts_per_island=1, devices_per_host=1, platform="gpu", gpu_share=0.5)
    assert plan(three, [gpu_node]) == ["g", "g", None]  # a third half does not fit on the node


@pytest.mark.parametrize("options,words", [
    ({"gpu_share": 0.5}, "are for platform='gpu'"),
    ({"platform": "gpu", "gpu_share": 0}, "gpu_share must be a number in (0, 1]"),
    ({"platform": "gpu", "gpu_share": 1.5}, "gpu_share must be a number in (0, 1]"),
    ({"platform": "gpu", "gpu_share": 0.5, "devices_per_host": 2}, "each host has one device"),
    ({"platform": "gpu", "gpu_share": 0.5, "devices_per_host": 1, "gpu_memory_fraction": 0.6},
     "must fit in its memory together"),
    ({"platform": "gpu", "gpu_memory_fraction": 0}, "gpu_memory_fraction must be a number"),
])
def test_bad_gpu_options_say_what_is_wrong(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        pw.Topology(**options)


def test_the_quickstart_on_one_gpu_is_two_islands_sharing_it():
    assert quickstart.GPU.islands == 2 and quickstart.GPU.gpus_per_host == 0.5


def test_hosts_name_their_gpus_kind_for_the_datasheet(monkeypatch):
    devices = LocalDevices(0)
    assert devices.describe()[0] == "cpu:0"
    gpu = types.SimpleNamespace(platform="gpu", id=0, device_kind="NVIDIA H200", process_index=0)
    monkeypatch.setattr(devices, "_devices", {0: [gpu]})
    assert devices.describe() == ["gpu:0 NVIDIA H200"]
    host = types.SimpleNamespace(devices=["gpu:0 NVIDIA H200"])
    monkeypatch.setattr(pw, "status", lambda: types.SimpleNamespace(islands=[types.SimpleNamespace(index=0,
                                                                                                    hosts=[host])]))
    assert peak._device(0) == ("gpu", "NVIDIA H200")
    assert peak.pods_peak([types.SimpleNamespace(size=1, island=0)], "bfloat16") == (
        989e12, "datasheet: NVIDIA H200 bfloat16 dense x 1")


@pytest.mark.parametrize("mib,batch", [(81559, 32), (143771, 64), (None, 4)])
def test_the_gpu_check_fills_the_gpus_memory_with_palms_batch(monkeypatch, mib, batch):
    monkeypatch.setattr(gpu_check, "_nvidia_smi", lambda query: [[str(mib)]] if mib else [])
    assert gpu_check.palm_batch("gpu", None) == batch
    assert gpu_check.palm_batch("gpu", 8) == 8 and gpu_check.palm_batch("cpu", None) == 4
