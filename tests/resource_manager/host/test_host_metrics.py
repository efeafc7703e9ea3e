"""A host's metrics (``resource_manager.host.metrics``): the ``pathways_*`` names and tags it exports, the
windowed ``busy_fraction``, counters that add only growth, and the sampling thread. What Ray's metrics agent
receives is recorded by small stand-ins for ``ray.util.metrics``' Gauge and Counter (the agent is another
process); one test builds the real ones, which must work without a Ray cluster."""

from __future__ import annotations

import threading
import time

import pytest
from ray.util import metrics as ray_metrics

from resource_manager.host import metrics
from resource_manager.host.metrics import COUNTERS, GAUGES, HostMetrics

NEVER = 3600.0  # a sampling period no test waits for: the tests take the samples themselves


class Metric:
    """Records what the host exports, with the checks Ray's own metric classes make."""

    made: dict[str, Metric] = {}

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.description, self.tag_keys = name, description, tag_keys
        self.default_tags: dict[str, str] = {}
        self.values: list[float] = []
        Metric.made[name] = self

    def set_default_tags(self, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys), (tags, self.tag_keys)
        self.default_tags = dict(tags)


class Gauge(Metric):
    def set(self, value: float) -> None:
        assert isinstance(value, float)
        self.values.append(value)


class Counter(Metric):
    def inc(self, value: float = 1.0) -> None:
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")  # as Ray's Counter says
        self.values.append(value)

    @property
    def total(self) -> float:
        return sum(self.values)


class Clock:
    """The module's ``time``: a monotonic clock the test moves; ``sleep`` is the real one (the sampling thread's)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleep = time.sleep

    def monotonic(self) -> float:
        return self.now


def stats(busy_s: float = 0.0, **more: float) -> dict:
    base = {"queue_depth": 0, "buffer_bytes": 0, "buffers": 0, "busy_s": busy_s, "bytes_in": 0, "bytes_out": 0,
            "cache_hits": 0, "compiles": 0}
    return {**base, **more}


@pytest.fixture
def exported(monkeypatch) -> dict[str, Metric]:
    Metric.made = {}
    monkeypatch.setattr(ray_metrics, "Gauge", Gauge)
    monkeypatch.setattr(ray_metrics, "Counter", Counter)
    return Metric.made


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(metrics, "time", c)
    return c


def test_every_metric_is_exported_as_pathways_star_tagged_by_island_and_host(exported, clock):
    HostMetrics(3, 1, stats, period=NEVER)
    names = {f"pathways_{k}" for k in GAUGES} | {f"pathways_{name}" for name, _ in COUNTERS.values()}
    assert set(exported) == names
    assert "pathways_busy_seconds_total" in names and "pathways_compile_cache_misses_total" in names
    for m in exported.values():
        assert m.tag_keys == ("island", "host") and m.default_tags == {"island": "3", "host": "1"}
        assert m.description
    assert all(isinstance(exported[f"pathways_{k}"], Gauge) for k in GAUGES)
    assert all(isinstance(exported[f"pathways_{name}"], Counter) for name, _ in COUNTERS.values())


def test_gauges_take_each_samples_values(exported, clock):
    m = HostMetrics(0, 0, stats, period=NEVER)
    m.update(stats(queue_depth=3, buffer_bytes=4096, buffers=2))
    m.update(stats(queue_depth=1, buffer_bytes=0, buffers=0))
    assert exported["pathways_queue_depth"].values == [3.0, 1.0]
    assert exported["pathways_buffer_bytes"].values == [4096.0, 0.0]
    assert exported["pathways_buffers"].values == [2.0, 0.0]


def test_busy_fraction_is_the_share_of_the_last_window_spent_executing(exported, clock):
    m = HostMetrics(0, 0, stats, period=NEVER, window=2)
    m.update(stats(busy_s=10.0))
    assert m.busy_fraction == 0.0  # one sample: no time has passed to divide by
    clock.now += 1
    m.update(stats(busy_s=10.5))
    assert m.busy_fraction == pytest.approx(0.5)
    clock.now += 1
    m.update(stats(busy_s=10.5))  # idle for a second: half of the last two
    assert m.busy_fraction == pytest.approx(0.25)
    clock.now += 1
    m.update(stats(busy_s=11.5))  # the first sample left the window: (11.5 - 10.5) over 2 seconds
    assert m.busy_fraction == pytest.approx(0.5)
    clock.now += 1
    m.update(stats(busy_s=15.0))  # busy seconds of several threads can outgrow the clock: capped at 1
    assert m.busy_fraction == 1.0
    assert exported["pathways_busy_fraction"].values == pytest.approx([0.0, 0.5, 0.25, 0.5, 1.0])


def test_two_samples_at_the_same_instant_divide_by_nothing(exported, clock):
    m = HostMetrics(0, 0, stats, period=NEVER)
    m.update(stats(busy_s=1.0))
    m.update(stats(busy_s=2.0))
    assert m.busy_fraction == 0.0


def test_counters_add_only_their_growth_since_the_last_sample(exported, clock):
    m = HostMetrics(0, 0, stats, period=NEVER)
    m.update(stats(busy_s=2.0, bytes_in=100, compiles=1))
    m.update(stats(busy_s=2.0, bytes_in=250, compiles=1))  # no growth: nothing added (Ray refuses inc(0))
    m.update(stats(busy_s=3.5, bytes_in=250, compiles=4, cache_hits=7))
    assert exported["pathways_busy_seconds_total"].values == [2.0, 1.5]
    assert exported["pathways_bytes_in_total"].values == [100.0, 150.0]
    assert exported["pathways_compile_cache_misses_total"].values == [1.0, 3.0]
    assert exported["pathways_compile_cache_hits_total"].values == [7.0]
    assert exported["pathways_bytes_out_total"].values == []


def test_a_counter_that_goes_back_counts_its_growth_from_there(exported, clock):
    """A sampled count that drops (its source was reset) subtracts nothing from the exported total, and the
    growth after it counts from the lower value."""
    m = HostMetrics(0, 0, stats, period=NEVER)
    m.update(stats(bytes_out=500))
    m.update(stats(bytes_out=20))
    m.update(stats(bytes_out=50))
    assert exported["pathways_bytes_out_total"].values == [500.0, 30.0]


def test_a_sample_missing_a_metric_is_an_error_not_a_silent_zero(exported, clock):
    m = HostMetrics(0, 0, stats, period=NEVER)
    partial = stats()
    del partial["buffers"]
    with pytest.raises(KeyError, match="buffers"):
        m.update(partial)


def test_the_thread_samples_every_period(exported):
    """``sample`` is called on the metrics thread every ``period`` seconds and each sample is taken."""
    seen: list[dict] = []
    enough = threading.Event()
    parked = threading.Event()  # never set: after the third sample the thread waits here, doing nothing

    def sample() -> dict:
        if len(seen) == 3:
            enough.set()
            parked.wait()
        seen.append(stats(queue_depth=len(seen) + 1))
        return seen[-1]

    HostMetrics(0, 0, sample, period=0.01)
    assert enough.wait(timeout=30), f"{len(seen)} samples in 30 s at a period of 10 ms"
    assert exported["pathways_queue_depth"].values == [1.0, 2.0, 3.0]


def test_the_real_ray_metrics_work_without_a_cluster():
    """A host builds its metrics before anything is exported; Ray's own classes accept every sample, and no Ray
    starts for them (the unit tier's guard fails the test if one did)."""
    m = HostMetrics(0, 1, stats, period=NEVER)
    m.update(stats(busy_s=1.0, bytes_in=10, queue_depth=2))
    m.update(stats(busy_s=1.0, bytes_in=10, queue_depth=0))
    assert 0.0 <= m.busy_fraction <= 1.0
