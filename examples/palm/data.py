"""Byte-level training text that every machine has: the Python standard library's source.

Tokens are the bytes 0-255. The corpus is the stdlib's ``.py`` files in sorted
path order, truncated to ``CORPUS_BYTES``; its last ``HOLDOUT_FRACTION`` is held
out for evaluation. A batch is a pure function of (step, seed), so any host can
rebuild any step's batch without coordination. The corpus (and so every batch)
depends on the Python version's stdlib, not on what else is installed.
"""

from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np

CORPUS_BYTES = 8 * 2**20
HOLDOUT_FRACTION = 0.05
SPLITS = ("train", "eval")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _source_files(root: str) -> list[str]:
    """Stdlib ``.py`` files in sorted relative-path order, skipping installed packages and build config."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = CORPUS_BYTES) -> np.ndarray:
    """The byte stream, read once per process; a read-only uint8 array."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for rel in _source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            chunk = f.read(max_bytes - total)
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if data.size < 1024:
        raise RuntimeError(f"found only {data.size} bytes of Python source under {root}")
    return data


def split_range(split: str = "train", max_bytes: int = CORPUS_BYTES) -> tuple[int, int]:
    """[start, stop) byte range of a split: train is the head of the stream, eval the tail."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    n = corpus(max_bytes).size
    boundary = n - int(n * HOLDOUT_FRACTION)
    return (0, boundary) if split == "train" else (boundary, n)


def batch(step: int, seed: int, batch_size: int, seq_len: int, split: str = "train",
          max_bytes: int = CORPUS_BYTES) -> dict[str, np.ndarray]:
    """``{"inputs", "targets"}`` int32[batch_size, seq_len]: random windows of the split, targets shifted by one.

    Offsets come from ``np.random.default_rng([seed, step, split index])``, so the
    batch depends only on its arguments. Every window, targets included, lies
    inside its split.
    """
    start, stop = split_range(split, max_bytes)
    last_offset = stop - seq_len - 1
    if last_offset < start:
        raise ValueError(f"seq_len {seq_len} does not fit in the {split} split of {stop - start} bytes")
    rng = np.random.default_rng([seed, step, SPLITS.index(split)])
    offsets = rng.integers(start, last_offset + 1, size=batch_size)
    windows = corpus(max_bytes)[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def decode(tokens: np.ndarray) -> str:
    """Bytes back to text, for printing samples."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
