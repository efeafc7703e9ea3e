"""The training run's record: a JSONL event log, and a loss-curve PNG drawn from it.

One JSON object per line, each with ``event`` and ``time`` (seconds since the
run started): ``start``, ``step``, ``eval``, ``checkpoint``, ``spike``,
``rollback``, ``end``. A resumed run appends to the same file, so the plot
shows the whole history.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class JsonlLog:
    """Appends events to ``path``, flushed per line so a crash loses nothing written before it."""

    def __init__(self, path: str, append: bool = False) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a" if append else "w")
        self._start = time.perf_counter()

    def write(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "time": round(time.perf_counter() - self._start, 4), **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(log_path: str, png_path: str) -> bool:
    """Train and eval loss against step; False (and no file) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    events = read(log_path)
    segments: list[list[tuple[int, float]]] = [[]]  # a rollback starts a new segment of the curve
    for e in events:
        if e["event"] == "rollback":
            segments.append([])
        elif e["event"] == "step":
            segments[-1].append((e["step"], e["loss"]))
    evals = [(e["step"], e["loss"]) for e in events if e["event"] == "eval"]
    spikes = [(e["step"], e["loss"]) for e in events if e["event"] == "spike"]
    fig, ax = plt.subplots(figsize=(7, 4))
    segments = [seg for seg in segments if seg]
    for k, segment in enumerate(segments):  # abandoned timelines drawn faint
        ax.plot(*zip(*segment), lw=1, color="C0", alpha=1.0 if k == len(segments) - 1 else 0.4,
                label="train" if k == len(segments) - 1 else None)
    if evals:
        ax.plot(*zip(*evals), "o-", color="C1", label="eval (held out)")
    if spikes:
        ax.plot(*zip(*spikes), "rx", ms=9, label="spike (rolled back)")
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True
