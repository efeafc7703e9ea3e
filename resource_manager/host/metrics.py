"""A host's metrics, sampled once a second: kept for ``pw.status`` and exported through Ray's metrics.

Ray's metrics agent serves them to Prometheus (``pathways_*``, tagged by
island and host), so a cluster's existing monitoring sees the runtime with
no endpoint of our own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

GAUGES = {
    "queue_depth": "fragments admitted on the host and not finished",
    "busy_fraction": "share of the last few seconds the host spent executing ops",
    "buffer_bytes": "bytes resident in the host's buffer table",
    "buffers": "buffers resident in the host's buffer table",
}
COUNTERS = {
    "busy_s": ("busy_seconds_total", "seconds spent executing ops"),
    "bytes_in": ("bytes_in_total", "bytes received from other islands' hosts"),
    "bytes_out": ("bytes_out_total", "bytes sent to other islands' hosts"),
    "cache_hits": ("compile_cache_hits_total", "executions served by an already compiled executable"),
    "compiles": ("compile_cache_misses_total", "compilations of serialized StableHLO"),
}


class HostMetrics:
    """Samples a host's counters every ``period`` seconds on a thread of its own and exports them to Ray's
    metrics; ``busy_fraction`` is the share of the last ``window`` sampling periods spent executing ops.
    """

    def __init__(self, island: int, host: int, sample: Callable[[], dict], period: float = 1.0,
                 window: int = 5) -> None:
        from ray.util import metrics

        tags = {"island": str(island), "host": str(host)}
        self._gauges = {k: metrics.Gauge(f"pathways_{k}", description=d, tag_keys=tuple(tags)) for k, d in
                        GAUGES.items()}
        self._counters = {k: metrics.Counter(f"pathways_{name}", description=d, tag_keys=tuple(tags))
                          for k, (name, d) in COUNTERS.items()}
        for m in [*self._gauges.values(), *self._counters.values()]:
            m.set_default_tags(tags)
        self._sample = sample
        self._history: deque[tuple[float, float]] = deque(maxlen=window + 1)
        self._last: dict[str, float] = {}
        self.busy_fraction = 0.0
        threading.Thread(target=self._run, args=(period,), name="metrics", daemon=True).start()

    def _run(self, period: float) -> None:
        while True:
            time.sleep(period)
            self.update(self._sample())

    def update(self, stats: dict) -> None:
        """Take one sample: update ``busy_fraction``, set the gauges, and add the counters' growth since the last one.
        """
        now = time.monotonic()
        self._history.append((now, stats["busy_s"]))
        (t0, b0), (t1, b1) = self._history[0], self._history[-1]
        self.busy_fraction = min(1.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else 0.0
        stats = {**stats, "busy_fraction": self.busy_fraction}
        for key, gauge in self._gauges.items():
            gauge.set(float(stats[key]))
        for key, counter in self._counters.items():
            delta = float(stats[key]) - self._last.get(key, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._last[key] = float(stats[key])
