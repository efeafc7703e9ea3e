"""What tests of tenants' jobs need from the machine: job users (root, to make them) that can run this Python, and
the users the runtime made removed afterwards.

Tenants' jobs run as OS users of their own, which only a root runtime can make and start processes as; where the
suite runs as root (as here and in CI), ``job_users_machine`` opens the folders on the way to this Python for
passing through (not listing) while the tests run, then closes them again and deletes the users the runtime made
meanwhile (the runtime itself leaves a removed tenant's user in place: see ``resource_manager.job_users``).
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from resource_manager.job_users import PREFIX, end_processes

NEEDS_ROOT = "tenants' jobs run as OS users of their own, which only a runtime running as root can make and use"


def made_users() -> set[str]:
    """The job users the runtime made on this machine (by their name's prefix)."""
    return {p.pw_name for p in pwd.getpwall() if p.pw_name.startswith(PREFIX)}


@contextmanager
def job_users_machine() -> Iterator[None]:
    """While it is open: this Python is reachable by other users; afterwards, the job users made meanwhile (and
    anything still running as them) are gone."""
    before = made_users()
    opened = []
    for folder in Path(sys.executable).resolve().parents:
        mode_now = stat.S_IMODE(folder.stat().st_mode)
        if not mode_now & stat.S_IXOTH:
            folder.chmod(mode_now | stat.S_IXOTH)
            opened.append((folder, mode_now))
    try:
        yield
    finally:
        for folder, mode_before in opened:
            folder.chmod(mode_before)
        for name in made_users() - before:
            end_processes(pwd.getpwnam(name).pw_uid)
            subprocess.run(["userdel", name], capture_output=True, timeout=60)


def registry_users(path: Path) -> dict[str, str]:
    """Each tenant's job user, as the registry file at ``path`` records it."""
    return {t["name"]: t["job_user"] for t in json.loads(path.read_text())["tenants"]}


def probe(out: str) -> dict[str, str]:
    """What ``hostile_job.py`` printed: each try and what happened."""
    line = next(line for line in out.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def denied(results: dict[str, str]) -> list[str]:
    """The tries that were not denied (the empty list when all were)."""
    return [f"{k}: {v}" for k, v in results.items() if not v.startswith("denied")]


def uid_of(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def is_root() -> bool:
    return os.geteuid() == 0
