"""What every benchmark shares: repeated timing with medians, one printed table, a JSON record, an optional plot.

Nothing here imports JAX, so a script can still configure JAX's devices after
importing this module.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def default_out(name: str) -> Path:
    """``benchmarks/results/<name>.json``, whatever the current directory."""
    return RESULTS / f"{name}.json"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 4 on, 0-based here); None if the
    process is gone or there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_s(pids: Iterable[int], stats: dict[int, list[str]] | None = None) -> float | None:
    """CPU seconds (user + system) the processes ``pids`` used so far, from ``stats`` (``proc_stat`` by pid)
    or read now; None where there is no /proc. A process that has exited counts 0."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for pid in pids:
        fields = stats.get(pid) if stats is not None else proc_stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def units_for(seconds_per_unit: float, target_s: float, low: int, high: int) -> int:
    """How many units of work make one timed repetition last about ``target_s``."""
    if seconds_per_unit <= 0:
        return high
    return max(low, min(high, math.ceil(target_s / seconds_per_unit)))


def rate_text(per_s: float) -> str:
    """A throughput in a short human form (12.3k, 4.56M)."""
    if per_s is None or math.isnan(per_s):
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{suffix}"
    return f"{per_s:.3g}"


def ratio_text(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.2f}x" if value < 100 else f"{value:.0f}x"


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


@dataclass
class Table:
    """Rows of strings under named columns, printed aligned (first column left, the rest right)."""

    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [max(len(c), *(len(r[k]) for r in self.rows)) if self.rows else len(c)
                  for k, c in enumerate(self.columns)]

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))

        rule = "-" * len(line(self.columns))
        return "\n".join([line(self.columns), rule, *(line(r) for r in self.rows)])


def attach_ray(session: Any) -> None:
    """Make this benchmark process a Ray driver of the session's embedded cluster, for baselines that call Ray
    directly (a client of the runtime never does: it needs no Ray at all)."""
    import logging

    import ray

    from pathways.names import NAMESPACE
    from resource_manager.launch import enable_token_auth

    if not ray.is_initialized():
        enable_token_auth()
        ray.init(address=session.embedded.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)


def machine() -> dict:
    """Where the numbers were taken, for the JSON record."""
    import jax
    import numpy as np
    import ray

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "ray": ray.__version__, "numpy": np.__version__,
            "load_average": os.getloadavg(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` (plus the machine it ran on) as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"argv": sys.argv, "machine": machine(), **payload}
    path.write_text(json.dumps(body, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               logx: bool = True, logy: bool = True) -> Path | None:
    """A PNG of named (x, y) lines when matplotlib is installed; None (and no error) when it is not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        points = [(x, y) for x, y in zip(xs, ys) if y is not None and not math.isnan(y) and y > 0]
        if points:
            ax.plot(*zip(*points), marker="o", label=name, linestyle="--" if name.startswith(("jax", "ray")) else "-")
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
