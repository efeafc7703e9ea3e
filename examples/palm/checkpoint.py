"""Checkpoints: parameters, optimizer state, step and data position in one ``.npz``, written atomically.

A checkpoint is written to a temporary file in the same directory, flushed to
disk, and renamed over its final name with ``os.replace``, so a reader sees
either the previous file or the complete new one, never a partial write. The
arrays keep their exact bytes, which is what lets ``--resume`` continue
bit-exactly. Pytree structure is not stored: the loader takes it from
templates (fresh params and optimizer state of the same config).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

_NAME = re.compile(r"^ckpt_(\d{8})\.npz$")
_META = "__meta__"


@dataclass
class Checkpoint:
    """Training state after ``step`` updates; the next batch read is ``data_pos``."""

    step: int
    data_pos: int
    params: Any
    opt_state: Any
    extra: dict = field(default_factory=dict)  # JSON-able: the spike detector's history, the options used


class RunFolderError(Exception):
    """A run folder this run must not use as asked (another run's checkpoints); the message says what to do."""


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt_{step:08d}.npz")


def save(directory: str, ckpt: Checkpoint) -> str:
    """Write ``ckpt`` atomically (tmp file + fsync + os.replace); returns its path."""
    os.makedirs(directory, exist_ok=True)
    leaves = [np.asarray(x) for x in jax.tree.leaves((ckpt.params, ckpt.opt_state))]
    meta = {"step": ckpt.step, "data_pos": ckpt.data_pos, "n_leaves": len(leaves), "extra": ckpt.extra}
    arrays = {f"a{i:05d}": leaf for i, leaf in enumerate(leaves)}
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    final = path_for(directory, ckpt.step)
    tmp = f"{final}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return final


def load(path: str, params_like: Any, opt_like: Any) -> Checkpoint:
    """Read a checkpoint into the structure of ``(params_like, opt_like)``; refuses a mismatched one."""
    with np.load(path) as z:
        meta = json.loads(bytes(z[_META]).decode())
        leaves = [z[f"a{i:05d}"] for i in range(meta["n_leaves"])]
    treedef = jax.tree.structure((params_like, opt_like))
    templates = jax.tree.leaves((params_like, opt_like))
    if len(leaves) != len(templates):
        raise ValueError(f"{path} holds {len(leaves)} arrays but this model and optimizer have {len(templates)}; "
                         "was it written for another config?")
    for k, (got, want) in enumerate(zip(leaves, templates)):
        if got.shape != tuple(np.shape(want)) or got.dtype != np.dtype(want.dtype):
            raise ValueError(f"{path}: array {k} is {got.dtype}{list(got.shape)}, expected "
                             f"{np.dtype(want.dtype)}{list(np.shape(want))}; was it written for another config?")
    params, opt_state = jax.tree.unflatten(treedef, leaves)
    return Checkpoint(meta["step"], meta["data_pos"], params, opt_state, meta["extra"])


def read_meta(path: str) -> dict:
    """A checkpoint's step, data position and ``extra``, without reading its arrays."""
    with np.load(path) as z:
        return json.loads(bytes(z[_META]).decode())


def steps(directory: str) -> list[int]:
    """Steps of the checkpoints in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m)


def latest(directory: str) -> str | None:
    found = steps(directory)
    return path_for(directory, found[-1]) if found else None


def at_or_before(directory: str, step: int) -> str | None:
    """The newest checkpoint at or before ``step``, else the oldest one there is."""
    found = steps(directory)
    if not found:
        return None
    earlier = [s for s in found if s <= step]
    return path_for(directory, earlier[-1] if earlier else found[0])


def remove(directory: str, keep: Any) -> list[int]:
    """Delete every checkpoint whose step fails ``keep(step)``; returns the steps removed."""
    gone = [s for s in steps(directory) if not keep(s)]
    for s in gone:
        os.remove(path_for(directory, s))
    return gone
