"""Tenants' jobs from the command line: submit a command with its working directory, list, follow, stop.

A job runs on the runtime's machine as a process that holds a single-use ticket and the runtime's address,
nothing else (``resource_manager.jobs``). ``submit`` packs the working directory into a tar archive (leaving
out version control, caches, virtual environments and build output) and sends it with the command over the
runtime's protocol, proven with the tenant's credential.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.link import Link, expect_role
from command import secrets
from command.address import resolve_address
from command.output import CliError
from command.secrets import identity
from command.tables import clock, short, table
from pathways.errors import PathwaysError
from pathways.requests import JobLogs, ListJobs, StopJob, SubmitJob

# Never shipped with a job's working directory: version control, caches, environments, build output.
EXCLUDES = {".git", "__pycache__", ".venv", "venv", ".pytest_cache", ".ruff_cache", ".mypy_cache", "node_modules",
            "build", "dist", ".tox"}
MAX_ARCHIVE = 256 << 20
POLL_S = 0.5


def pack(working_dir: str) -> bytes:
    """``working_dir`` as a gzipped tar archive (paths relative to it), without ``EXCLUDES`` or eggs' metadata;
    CliError if it is over ``MAX_ARCHIVE`` bytes."""
    root = Path(working_dir)
    if not root.is_dir():
        raise CliError(f"working directory {working_dir!r} does not exist")
    buf = io.BytesIO()

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in EXCLUDES or p.endswith(".egg-info") for p in parts):
            return None
        return info if info.isfile() or info.isdir() else None  # no links, devices or fifos

    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)
            if buf.tell() > MAX_ARCHIVE:
                break
    data = buf.getvalue()
    if len(data) > MAX_ARCHIVE:
        raise CliError(f"{working_dir} packs to more than {MAX_ARCHIVE >> 20} MiB; submit a smaller --working-dir "
                       "(data belongs in storage the job reads, not in the job)")
    return data


class Jobs:
    """A connection to a runtime's job runner, acting as ``tenant`` with ``credential`` (or the admin's)."""

    def __init__(self, address: str, tenant: str, credential: str, timeout: float = 60.0) -> None:
        try:
            self._link = Link(address, 0, None, expect_role(None, "rm"), "the resource manager")
        except PathwaysError as exc:
            raise CliError(str(exc)) from None
        self.tenant, self._credential, self._timeout = tenant, credential, timeout

    def _call(self, make: Callable[[int], Any], data: bytes = b"") -> Any:
        try:
            return self._link.call(make, self._timeout, data=[data] if data else ())
        except PathwaysError as exc:
            raise CliError(str(exc)) from None

    def submit(self, entrypoint: list[str], archive: bytes, name: str | None = None) -> dict:
        """Start ``entrypoint`` in the unpacked ``archive``; the job's row (its id, status, ...)."""
        return self._call(lambda rid: SubmitJob(rid, self.tenant, self._credential, entrypoint, name), archive)

    def list(self) -> list[dict]:
        """The jobs this credential may see, oldest first."""
        return self._call(lambda rid: ListJobs(rid, self.tenant, self._credential))

    def logs(self, job: str, offset: int = 0) -> dict:
        """Up to 1 MiB of a job's log from ``offset``: ``text``, next ``offset``, ``ended``, ``status``."""
        return self._call(lambda rid: JobLogs(rid, self.tenant, self._credential, job, offset))

    def follow(self, job: str, write: Callable[[str], Any], timeout: float | None = None) -> str:
        """Write the job's log as it grows until the job ends (or ``timeout`` seconds pass); its final status."""
        offset = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            chunk = self.logs(job, offset)
            if chunk["text"]:
                write(chunk["text"])
            offset = chunk["offset"]
            if chunk["ended"] and not chunk["text"]:
                return chunk["status"]
            if deadline is not None and time.monotonic() > deadline:
                raise CliError(f"job {job} still {chunk['status']} after {timeout:.0f}s")
            if not chunk["text"]:
                time.sleep(POLL_S)

    def stop(self, job: str) -> str:
        """Stop the job; its final status."""
        return self._call(lambda rid: StopJob(rid, self.tenant, self._credential, job))

    def close(self) -> None:
        """Close the connection."""
        self._link.close()


def entrypoint_of(args: list[str]) -> list[str]:
    """The command after ``--``; CliError if there is none."""
    command = args[1:] if args[:1] == ["--"] else list(args)
    if not command:
        raise CliError("nothing to run: put the command after `--`, e.g. pathways submit -- python train.py")
    return command


def working_dir_of(path: str) -> str:
    """The absolute working directory; CliError if it does not exist."""
    working_dir = os.path.abspath(path)
    if not Path(working_dir).is_dir():
        raise CliError(f"working directory {path!r} does not exist")
    return working_dir


def _jobs(args: argparse.Namespace, what: str) -> Jobs:
    tenant, credential, _ = identity(args, what)
    return Jobs(resolve_address(args.address), tenant, credential)


def cmd_submit(args: argparse.Namespace) -> int:
    """``pathways submit``: run a command as a job of a tenant, in a copy of the working directory."""
    entrypoint = entrypoint_of(args.entrypoint)
    working_dir = working_dir_of(args.working_dir)
    found = secrets.tenant_identity(args.tenant, args.credential_file)
    if found is None:
        raise CliError("`pathways submit` needs your tenant's credential: `pathways login ADDRESS --tenant NAME "
                       "--credential ...` (what `pathways tenants add` printed), or --tenant NAME with its "
                       "credential file")
    tenant, credential = found
    address = resolve_address(args.address)
    runner = Jobs(address, tenant, credential)
    row = runner.submit(entrypoint, pack(working_dir), args.name)
    job = row["id"]
    print(f"submitted {job} (tenant {tenant}) to {address}", flush=True)
    if not args.wait:
        print(f"  follow it: pathways logs {job} --follow")
        return 0
    status = runner.follow(job, lambda s: print(s, end="", flush=True))
    print(f"job {job} {status}")
    return 0 if status == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    """``pathways jobs``: the jobs you may see (your tenant's, or every job with the admin credential)."""
    rows = _jobs(args, "jobs").list()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["ID", "TENANT", "STATUS", "START", "END", "ENTRYPOINT"],
                [[r["id"], r["tenant"], r["status"], clock(r["start"]), clock(r["end"]), short(r["entrypoint"], 48)]
                 for r in rows]) if rows else "no jobs")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """``pathways logs``: print (or follow) the log of a job you may act on."""
    runner = _jobs(args, "logs")
    if args.follow:
        runner.follow(args.job, lambda s: print(s, end="", flush=True))
        return 0
    offset = 0
    while True:
        chunk = runner.logs(args.job, offset)
        print(chunk["text"], end="")
        offset = chunk["offset"]
        if not chunk["text"]:
            return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """``pathways stop``: stop a job you may act on, and wait until it ends."""
    print(f"job {args.job} {_jobs(args, 'stop').stop(args.job)}")
    return 0
