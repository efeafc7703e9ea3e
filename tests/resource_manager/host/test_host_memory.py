"""How much memory a host's arrays may take (``resource_manager.host.memory``): the fixed budget per platform,
what the machine has free now, and the fallbacks when the system does not say."""

from __future__ import annotations

import os

import pytest

from resource_manager.host import memory
from resource_manager.host.memory import BUDGET_SHARE, LARGE, available_bytes, fits_now, host_budget, physical_bytes


class Device:
    """A device as ``host_budget`` reads it: only its memory stats (a GPU's, which this machine has none of)."""

    def __init__(self, stats: dict | None) -> None:
        self._stats = stats

    def memory_stats(self) -> dict | None:
        return self._stats


def meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_physical_memory_is_what_the_system_reports():
    assert physical_bytes() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert physical_bytes() > 1 << 28


def test_physical_memory_is_a_tebibyte_when_the_system_does_not_say(monkeypatch):
    def unknown(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(os, "sysconf", unknown)
    assert physical_bytes() == 1 << 40


def test_available_memory_is_memavailable_and_at_most_physical():
    before = meminfo_available()
    got = available_bytes()
    after = meminfo_available()
    slack = 256 << 20  # other processes allocate and free meanwhile
    assert min(before, after) - slack <= got <= max(before, after) + slack
    assert 0 < got <= physical_bytes()


def test_available_memory_falls_back_to_physical_without_meminfo(monkeypatch, tmp_path):
    def missing(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(memory, "open", missing, raising=False)
    assert available_bytes() == physical_bytes()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\n")  # an old kernel: no MemAvailable
    real_open = open
    monkeypatch.setattr(memory, "open", lambda path, *a, **k: real_open(meminfo, *a, **k), raising=False)
    assert available_bytes() == physical_bytes()
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n")
    assert available_bytes() == 1234 * 1024


@pytest.mark.parametrize("devices", [[], [Device({"bytes_limit": 8})], [object(), object()]])
def test_on_cpu_a_host_and_each_device_may_take_a_share_of_physical_memory(devices):
    expected = int(physical_bytes() * BUDGET_SHARE)
    assert host_budget("cpu", devices) == (expected, expected)  # the CPU devices share one memory


def test_on_gpu_each_device_takes_the_smallest_device_limit_and_the_host_all_of_them():
    devices = [Device({"bytes_limit": 80 << 30}), Device({"bytes_limit": 40 << 30}), Device({"bytes_limit": 60 << 30})]
    assert host_budget("gpu", devices) == (3 * (40 << 30), 40 << 30)


@pytest.mark.parametrize("stats", [None, {}, {"bytes_limit": 0}])
def test_on_gpu_a_device_that_does_not_say_its_limit_falls_back_to_physical_memory(stats):
    devices = [Device({"bytes_limit": 40 << 30}), Device(stats)]
    assert host_budget("gpu", devices) == (2 * physical_bytes(), physical_bytes())


def test_on_gpu_without_devices_the_cpu_budget_applies():
    expected = int(physical_bytes() * BUDGET_SHARE)
    assert host_budget("gpu", []) == (expected, expected)


def test_small_allocations_always_fit_and_large_ones_only_when_the_machine_has_them_free(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 0)  # a machine out of memory right now
    assert fits_now(0) and fits_now(LARGE - 1)
    assert not fits_now(LARGE)
    monkeypatch.setattr(memory, "available_bytes", lambda: 10 * LARGE)
    assert fits_now(LARGE) and fits_now(10 * LARGE)
    assert not fits_now(10 * LARGE + 1)


def test_an_impossible_allocation_never_fits():
    assert not fits_now(1 << 62)  # a dimension product no machine has
    assert fits_now(1024)
