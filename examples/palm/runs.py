"""A run's folder holds the checkpoints of one run, and a run starts or resumes there only when it is that run.

Every checkpoint records its run: an id drawn when the run started fresh, and the configuration that decides
what it computes (model config, seed, global batch, optimizer). ``--resume`` continues the newest checkpoint
only if it was written with the same configuration, and refuses otherwise, saying which options differ. A
fresh run refuses a folder that already holds checkpoints, unless ``--overwrite`` says to delete them: it
would otherwise mix its checkpoints with the old run's (and its pruning would delete the old run's), and a
later ``--resume`` could continue either. Refusing costs a second command; silently deleting a run, or
silently mixing two, costs the run.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from examples.palm import checkpoint
from examples.palm.checkpoint import RunFolderError

# The train command's option for each configuration field; fields without one are named as they are.
FLAGS = {"config": "--config", "seed": "--seed", "batch": "--batch", "optimizer.peak_lr": "--lr",
         "optimizer.const_steps": "--const-steps"}


@dataclass(frozen=True)
class Start:
    """Where a run starts: the checkpoint it resumes (None: fresh), its id, and what it deleted to get there."""

    resume_from: str | None
    run_id: str
    deleted: tuple[int, ...] = ()


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(theirs: dict, ours: dict) -> list[tuple[str, Any, Any]]:
    """(option, the checkpoint's value, this run's value) for each configuration field that differs; a model
    config of another name differs in its name only."""
    a, b = _flat(theirs), _flat(ours)
    skip_model = a.get("config") != b.get("config")
    return [(FLAGS.get(k, k), a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not (skip_model and k.startswith("model."))]


def _says(option: str, value: Any) -> str:
    return f"{option} {value}" if option.startswith("--") else f"{option}={value!r}"


def claim(directory: str, config: dict, resume: bool, overwrite: bool) -> Start:
    """Decide where a run of ``config`` starts in checkpoint folder ``directory``; RunFolderError when it may not.

    Args:
        directory: the run's checkpoint folder.
        config: the run's configuration (JSON values), as recorded in its checkpoints.
        resume: continue the newest checkpoint there.
        overwrite: a fresh run may delete the checkpoints there first.
    """
    found = checkpoint.steps(directory)
    if not resume:
        if found and not overwrite:
            raise RunFolderError(
                f"{directory} already holds checkpoints (steps {found[0]} to {found[-1]}) of an earlier run: "
                "pass --resume to continue it, --overwrite to delete them and start over, or --out to start "
                "this run in another folder")
        deleted = tuple(checkpoint.remove(directory, lambda _: False))
        return Start(None, uuid.uuid4().hex[:12], deleted)
    if not found:
        raise RunFolderError(f"--resume: there is no checkpoint under {directory} to continue; leave out --resume "
                             "to start a run there (or pass the --out of the run to continue)")
    newest = checkpoint.path_for(directory, found[-1])
    runs = {s: checkpoint.read_meta(checkpoint.path_for(directory, s))["extra"].get("run") for s in found}
    theirs = runs[found[-1]]
    if not theirs:
        raise RunFolderError(f"--resume: {newest} does not record the configuration it was written with, so it "
                             "cannot be checked against this run's: start over (--overwrite) or elsewhere (--out)")
    changed = differences({k: v for k, v in theirs.items() if k != "id"}, config)
    if changed:
        raise RunFolderError(
            f"--resume: {newest} (step {found[-1]}) belongs to a run of another configuration: it was written "
            f"with {', '.join(_says(o, a) for o, a, _ in changed)}; this run asks for "
            f"{', '.join(_says(o, b) for o, _, b in changed)}. Resume with that run's options, or start this run "
            "in another folder (--out) or over that one (--overwrite deletes its checkpoints)")
    ids = {(run or {}).get("id") for run in runs.values()}
    if len(ids) > 1:
        raise RunFolderError(f"--resume: {directory} holds the checkpoints of {len(ids)} different runs, so which "
                             "to continue is unclear: keep one run's checkpoints there, or start over (--overwrite)")
    return Start(newest, theirs["id"])
