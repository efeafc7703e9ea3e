"""PaLM's loss-spike recovery (section 5.1): roll back about M steps and skip about B batches.

PaLM saw roughly 20 loss spikes in its largest run. They were not caused by
bad data alone: re-running the same batches from an earlier checkpoint did
not spike. So it restarted from a checkpoint about 100 steps before the spike
and skipped 200-500 batches. Here a spike is a loss above ``factor`` times
the median of the last ``window`` accepted losses (or a non-finite loss).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SpikePolicy:
    """When a loss counts as a spike, and how to recover from one."""

    factor: float = 1.5
    window: int = 20
    rollback_steps: int = 100  # M: restart from the checkpoint at or before (spike step - M)
    skip_batches: int = 200  # B: resume reading data B batches after that checkpoint's position
    max_rollbacks: int = 5  # give up (raise) rather than loop on a run that keeps spiking

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"spike factor must be > 1, got {self.factor}")
        if self.window < 1 or self.rollback_steps < 0 or self.skip_batches < 0 or self.max_rollbacks < 0:
            raise ValueError(f"invalid spike policy {self}")


class SpikeDetector:
    """Running median of recent accepted losses; its history travels in checkpoints."""

    def __init__(self, policy: SpikePolicy, history: Iterable[float] = ()) -> None:
        self.policy = policy
        self.history: deque[float] = deque(history, maxlen=policy.window)

    def median(self) -> float | None:
        return statistics.median(self.history) if len(self.history) == self.policy.window else None

    def is_spike(self, loss: float) -> bool:
        """True for a spike (not recorded); otherwise records ``loss`` and returns False."""
        if not math.isfinite(loss):
            return True
        median = self.median()
        if median is not None and loss > self.policy.factor * median:
            return True
        self.history.append(loss)
        return False

    def state(self) -> list[float]:
        return list(self.history)
