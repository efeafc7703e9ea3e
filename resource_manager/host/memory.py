"""How much memory a host's arrays may take, so impossible work is refused instead of aborting the process.

XLA aborts the whole process on some impossible shapes (a dimension product that
overflows) and the kernel kills it on others, taking every tenant's buffers
with it. So a host checks sizes before it allocates: against a fixed budget
(a share of physical memory, or of a GPU's memory) for what a message
announces, and against what the machine has free right now before it runs a
computation whose outputs and temporaries are large.
"""

from __future__ import annotations

import os

BUDGET_SHARE = 0.9  # of physical memory: what one host's arrays may take in all
LARGE = 64 << 20  # below this an allocation is not worth a look at /proc/meminfo


def physical_bytes() -> int:
    """The machine's physical memory in bytes (1 TiB when the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


def available_bytes() -> int:
    """Memory the kernel can hand out now without swapping (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_bytes()


def host_budget(platform: str, devices: list) -> tuple[int, int]:
    """(bytes per host, bytes per device) that arrays may take: physical memory on CPU (devices share it),
    each device's own memory limit on GPU."""
    if platform == "gpu" and devices:
        limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in devices]
        per_device = min(limit for limit in limits) if all(limits) else physical_bytes()
        return per_device * len(devices), per_device
    total = int(physical_bytes() * BUDGET_SHARE)
    return total, total


def fits_now(nbytes: int) -> bool:
    """Whether ``nbytes`` more can be allocated now (always true for small amounts)."""
    return nbytes < LARGE or nbytes <= available_bytes()
