"""OS users for tenants' jobs: each tenant's jobs run as a user of that tenant's own.

A process cannot read another uid's memory (``/proc/PID/mem``), environment (``/proc/PID/environ``) or the files
it keeps private (jobs run with umask 077), so with one user per tenant no tenant's job reads another tenant's
job's session key, ticket, arrays or working directory, and none reads the runtime's files (the admin's and Ray's
tokens among them). A runtime that runs as root makes a tenant's user when the tenant is added: ``useradd
--system`` (no home, no login shell, a group of its own), named ``pwj-``, up to 12 characters of the tenant's
name and 6 random hex digits, so a tenant removed and added again never gets its former user (nor what it left in
``/tmp``) back. The admin may name one instead. Either way a job user is never root and never the runtime's own
user; the registry sees that no two tenants share one.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pathways.errors import ResourceError

PREFIX = "pwj-"
SLUG_CHARS = 12
END_TIMEOUT_S = 5.0  # ending every process of a user: a process may fork while it is being killed
SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


def is_root() -> bool:
    """Whether this process may start processes as other users (and make them)."""
    return os.geteuid() == 0


def make(tenant: str) -> str:
    """Make a new OS user for ``tenant``'s jobs (this process must be root); returns its name. ResourceError, saying
    what to do instead, when it cannot be made."""
    slug = re.sub(r"[^a-z0-9]+", "-", tenant.lower())[:SLUG_CHARS].strip("-") or "tenant"
    name = next(n for n in (f"{PREFIX}{slug}-{secrets.token_hex(3)}" for _ in range(100)) if not _exists(n))
    useradd = shutil.which("useradd", path=f"{os.environ.get('PATH', '')}:{SBIN}")
    nologin = next((p for p in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(p)), "/bin/false")
    how = f"name an existing user dedicated to its jobs: pathways tenants set {tenant} --job-user USER"
    if useradd is None:
        raise ResourceError(f"cannot make an OS user for tenant {tenant}'s jobs: this machine has no useradd; {how}")
    try:
        done = subprocess.run([useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                               nologin, "--user-group", "--comment", f"pathways jobs of tenant {tenant}", name],
                              capture_output=True, text=True, timeout=60)
        failed = done.returncode != 0 and (done.stderr.strip() or f"exit {done.returncode}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        failed = str(exc)
    if failed:
        raise ResourceError(f"cannot make an OS user for tenant {tenant}'s jobs ({failed}); {how}")
    return name


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def check(name: str) -> pwd.struct_passwd:
    """The user ``name`` if it may run a tenant's jobs: it exists, and is neither root nor this process's user
    (whose files, Ray's token among them, a job must not read). ResourceError otherwise."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ResourceError(f"job user {name!r}: no such user on the runtime's machine") from None
    if entry.pw_uid == 0:
        raise ResourceError(f"job user {name!r} is root: a job would own the machine. Name a user dedicated to the "
                            "tenant's jobs")
    if entry.pw_uid == os.geteuid():
        raise ResourceError(f"job user {name!r} is the user the runtime runs as: its jobs would read the runtime's "
                            "files (Ray's token among them). Name a user dedicated to the tenant's jobs")
    return entry


def check_runs_python(entry: pwd.struct_passwd) -> None:
    """ResourceError unless ``entry`` can run the runtime's Python and import the package (a folder on the way,
    such as a home folder of mode 0700, may be closed to it)."""
    try:
        probe = subprocess.run([sys.executable, "-c", "import pathways"], user=entry.pw_uid, group=entry.pw_gid,
                               extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                               text=True, timeout=60)
        failed = probe.returncode != 0 and (probe.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        failed = getattr(exc, "strerror", None) or str(exc)
    if failed:
        name = entry.pw_name
        raise ResourceError(f"job user {name} cannot run the runtime's Python ({sys.executable}: {failed}); a folder "
                            f"on its way is probably closed to {name} (a home folder of mode 0700). Install the "
                            f"runtime where {name} can run it, or let {name} through those folders")


def processes_of(uid: int) -> list[int]:
    """Every live process with ``uid`` among its real, effective, saved or file-system user ids (zombies left out:
    they hold nothing and cannot be killed)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # gone meanwhile
            continue
        if uid in (int(u) for u in fields.get("Uid", "").split()) and not fields.get("State", "").strip().startswith(
                "Z"):
            out.append(int(status.parent.name))
    return out


def end_processes(uid: int, timeout: float = END_TIMEOUT_S) -> int:
    """SIGKILL every process of ``uid`` (a job user's: never root's or this process's) until none is left, for at
    most ``timeout`` seconds; returns how many were killed."""
    if uid in (0, os.geteuid()):
        raise ValueError(f"uid {uid} is not a job user's")
    killed, deadline = 0, time.monotonic() + timeout
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    return killed
