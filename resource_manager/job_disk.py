"""Where tenants' jobs live on the runtime's disk, and how much of it each tenant holds (its ``job_disk_bytes``).

    ROOT/                   the runtime's alone (0711): `pathways up --jobs-dir`, else /var/lib/pathways/jobs
                            (a runtime running as root) or ~/.pathways/jobs
      RUNTIME/              one runtime's (0711), made at its first job, removed when it stops; it holds the lock
        alive               file ``alive`` while it runs, so the next runtime removes a crashed one's folder
        incoming/JOB.tar    an archive as its bytes arrive (the folder 0700)
        logs/JOB.log        a job's output, which its tenant reads back (the folder 0700)
        jobs/JOB/           the job's own folder, its tenant's user's alone (0700), removed when the job ends:
          work/             its working directory (the unpacked archive, its HOME)
          tmp/              its TMPDIR

A tenant's budget counts its archives from before their first byte is read (the size their message announces),
its jobs' unpacked folders from before anything is unpacked (what the archive's headers say, in 4 KiB blocks,
counted a header at a time, so a bomb is refused having read no more than the budget), and its jobs' logs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tarfile
import threading
import time
from pathlib import Path

from pathways.budgets import over
from pathways.errors import PathwaysError, ResourceError

BLOCK = 4096  # a file takes whole blocks; a folder or a link takes one
MAX_MEMBERS = 100_000  # files in one job's working directory
CRASHED_S = 60.0  # a runtime folder without its lock file this old was left by a runtime that crashed making it
BUDGET = "job_disk_bytes"


def default_root() -> Path:
    """Where jobs live when the admin names no folder: a system folder for a runtime running as root (its
    tenants' users must be able to reach their jobs' folders, which a root's home does not let them), else the
    runtime user's own."""
    if os.geteuid() == 0:
        return Path("/var/lib/pathways/jobs")
    return Path(os.environ.get("PATHWAYS_HOME") or Path.home() / ".pathways") / "jobs"


def private_dir(path: Path, mode: int, others_pass: bool = False) -> Path:
    """``path`` as a folder this process's user alone may change, with ``mode``; made if missing. ResourceError if it
    is a link or another user's, if a folder above it may be changed by anyone but root and this user (who could
    then swap it for another), or, with ``others_pass``, if one is closed to other users passing through."""
    path.parent.mkdir(parents=True, exist_ok=True)  # the umask's mode: writable by this user alone
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ResourceError(f"{path} is {'a link' if stat.S_ISLNK(info.st_mode) else 'not a folder of this user'}: "
                            "jobs keep their files in a folder of the runtime's user alone; remove it, or name "
                            "another with `pathways up --jobs-dir`")
    os.chmod(path, mode)
    for above in path.parents:
        up = os.stat(above)
        if up.st_uid not in (0, os.geteuid()) or (up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX):
            raise ResourceError(f"{above}, above the jobs' folder {path}, may be changed by other users; name a "
                                "folder of the runtime's user with `pathways up --jobs-dir`")
        if others_pass and not up.st_mode & stat.S_IXOTH:
            raise ResourceError(f"{above}, above the jobs' folder {path}, is closed to other users: tenants' jobs, "
                                "which run as users of their own, could not reach their folders. Let others pass "
                                "through it (chmod o+x), or name another folder with `pathways up --jobs-dir`")
    return path


class Ledger:
    """Bytes each tenant holds on the runtime's disk for its jobs; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, tenant: str, nbytes: int, limit: int) -> None:
        """Count ``nbytes`` more for ``tenant``; the budget's ResourceError if that is over ``limit``."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held + nbytes > limit:
                raise over(BUDGET, held, nbytes, limit, "bytes")
            self._held[tenant] = held + nbytes

    def take_up_to(self, tenant: str, nbytes: int, limit: int) -> int:
        """Count as many of ``nbytes`` as ``limit`` leaves room for; returns how many."""
        with self._lock:
            held = self._held.get(tenant, 0)
            taken = max(0, min(nbytes, limit - held))
            self._held[tenant] = held + taken
            return taken

    def give(self, tenant: str, nbytes: int) -> None:
        """``nbytes`` of ``tenant``'s no longer count (their files are gone)."""
        with self._lock:
            left = self._held.get(tenant, 0) - nbytes
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def held(self, tenant: str) -> int:
        """Bytes ``tenant`` holds now."""
        with self._lock:
            return self._held.get(tenant, 0)


class Folders:
    """The folders of one runtime's jobs under ``root`` (see the module's layout), made at the first job;
    ``others_pass``: the jobs run as other users, so every folder above ``root`` must let them pass."""

    def __init__(self, root: Path, runtime: str, others_pass: bool) -> None:
        self.root = root
        self._others_pass = others_pass  # jobs run as other users, who must reach their folders
        self.path = root / runtime
        self._lock = threading.Lock()
        self._alive: int | None = None  # the lock file's descriptor, held while the folder is in use

    def ready(self) -> Path:
        """The runtime's folder, made (and crashed runtimes' folders removed) the first time."""
        with self._lock:
            if self._alive is None:
                private_dir(self.root, 0o711, self._others_pass)  # a job user passes through, lists nothing
                sweep(self.root)
                private_dir(self.path, 0o711)
                for sub, mode in (("incoming", 0o700), ("logs", 0o700), ("jobs", 0o711)):
                    private_dir(self.path / sub, mode)
                fd = os.open(self.path / "alive", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._alive = fd
            return self.path

    def archive(self, job: str) -> Path:
        return self.ready() / "incoming" / f"{job}.tar"

    def log(self, job: str) -> Path:
        return self.ready() / "logs" / f"{job}.log"

    def job(self, job: str) -> Path:
        return self.ready() / "jobs" / job

    def remove(self) -> None:
        """Remove the runtime's folder and everything in it (the runtime is stopping; its jobs ended)."""
        with self._lock:
            if self._alive is not None:
                shutil.rmtree(self.path, ignore_errors=True)
                os.close(self._alive)
                self._alive = None


def sweep(root: Path) -> list[Path]:
    """Remove the folders under ``root`` that runtimes which are gone left (their ``alive`` lock is free, or it
    was never made and the folder is old); returns them."""
    gone = []
    for folder in root.iterdir():
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            fd = os.open(folder / "alive", os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if time.time() - folder.stat().st_mtime > CRASHED_S:
                gone.append(folder)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            gone.append(folder)
        except BlockingIOError:  # a runtime holds it
            pass
        finally:
            os.close(fd)
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


class Archive:
    """A job's received archive, read a header at a time: ``size`` counts what it would take on disk, ``extract``
    unpacks it with the archive data filter (no absolute paths, no links out, no devices, no setuid bits)."""

    def __init__(self, path: Path) -> None:
        try:
            self._tar = tarfile.open(path, mode="r:*")
        except (tarfile.TarError, OSError) as exc:
            raise PathwaysError(f"the working directory could not be unpacked: {exc}") from None
        self._members: list[tarfile.TarInfo] = []

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tar.close()

    def size(self, room: int) -> int:
        """Bytes the members take on disk, counted from their headers; stops reading once that is over ``room``
        (and returns what it counted so far, over ``room``)."""
        total = 0
        try:
            while total <= room and (member := self._tar.next()) is not None:
                self._members.append(member)
                if len(self._members) > MAX_MEMBERS:
                    raise ResourceError(f"the working directory holds more than {MAX_MEMBERS} files; ship data in "
                                        "storage the job reads, not in the job")
                total += BLOCK * max(1, -(-member.size // BLOCK)) if member.isfile() else BLOCK
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise PathwaysError(f"the working directory could not be unpacked: {exc}") from None
        return total

    def extract(self, dest: Path) -> None:
        """Unpack every member ``size`` counted into ``dest``."""
        try:
            self._tar.extractall(dest, members=self._members, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise PathwaysError(f"the working directory could not be unpacked: {exc}") from None


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` and everything under it to ``uid``:``gid``, links themselves and never what they point at."""
    for folder, dirs, files in os.walk(path, topdown=False):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)
    os.chown(path, uid, gid, follow_symlinks=False)
