"""Tenants' jobs (``pathways submit``): processes the runtime starts that cannot reach Ray.

A job is its tenant's command, run in a copy of the working directory the tenant sent (a tar archive,
unpacked with the archive data filter: no absolute paths, no links out, no devices), on the resource
manager's node. Its process gets a minimal environment (no Ray address or token, no credential; the
runtime's address and its tenant's name) and a single-use ticket through an inherited pipe, which its
``pw.init()`` reads once and exchanges for a session: the ticket never appears in an environment, a command
line or Ray's job API, and it opens a session only for its own job. Where the admin names an OS user for
jobs (``pathways up --job-user``), the process runs as that user, who cannot read the runtime's files (Ray's
token among them), so it cannot reach Ray at all. Its output goes to a log the tenant reads back with
``pathways logs``; ``pathways stop`` ends its process group.
"""

from __future__ import annotations

import io
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pathways.budgets import over
from pathways.errors import PathwaysError, ResourceError, TenantAccessError
from pathways.names import ADDRESS_ENV, JOB_ENV, TENANT_ENV, TICKET_FD_ENV

MAX_ARCHIVE = 256 << 20  # a job's working directory, packed
STOP_GRACE_S = 10.0
PYTHON_NAMES = {"python", "python3", f"python3.{sys.version_info.minor}"}
log = logging.getLogger(__name__)


@dataclass
class Job:
    """A job the runner started: whose, what, where its log is, and how it ended."""

    id: str
    tenant: str
    entrypoint: list[str]
    log: Path
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    ended: float | None = None
    status: str = "RUNNING"
    stopping: bool = False

    def row(self) -> dict:
        """The job as ``pathways jobs`` lists it."""
        return {"id": self.id, "tenant": self.tenant, "status": self.status, "start": self.started,
                "end": self.ended, "entrypoint": " ".join(self.entrypoint), "pid": self.proc.pid}


def check_job_user(user: str | None) -> pwd.struct_passwd | None:
    """The OS user jobs run as, checked now: it exists, and this process may start processes as it."""
    if not user:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ResourceError(f"--job-user {user}: no such user on this machine") from None
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise ResourceError(f"--job-user {user}: starting jobs as another user needs the runtime to run as root")
    if entry.pw_uid == os.geteuid():
        raise ResourceError(f"--job-user {user} is the user the runtime runs as; jobs would read the runtime's files "
                            "(Ray's token among them). Name a dedicated user")
    try:
        probe = subprocess.run([sys.executable, "-c", "import pathways"], user=entry.pw_uid, group=entry.pw_gid,
                               extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                               text=True, timeout=60)
        failed = probe.returncode != 0 and (probe.stderr.strip().splitlines() or ["no output"])[-1]
    except OSError as exc:
        failed = exc.strerror or str(exc)
    if failed:
        raise ResourceError(f"--job-user {user} cannot run the runtime's Python ({sys.executable}: {failed}); a "
                            f"folder on its way is probably closed to {user} (a home folder of mode 0700). Install "
                            f"the runtime where {user} can run it, or let {user} through those folders")
    return entry


class JobRunner:
    """Starts, lists, logs and stops tenants' jobs. ``rm`` authenticates and issues tickets; ``address`` is the
    runtime's client address the jobs attach to."""

    def __init__(self, rm: Any, address: str, jobs_dir: str | None, job_user: str | None) -> None:
        self.rm = rm
        self.address = address
        self.user = check_job_user(job_user)
        self.root = Path(jobs_dir) if jobs_dir else Path(tempfile.mkdtemp(prefix="pathways-jobs-"))
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self.root, 0o711)  # the job user may enter its job's folder, never list the others
        self._lock = threading.Lock()
        self.jobs: dict[str, Job] = {}

    # -- who may do what ----------------------------------------------------------------------------------
    def _tenant(self, tenant: str, credential: str) -> tuple[str | None, bool]:
        """(tenant, is_admin) the credential proves."""
        who = self.rm.whoami(tenant, credential)
        return who["tenant"], who["admin"]

    def _job(self, tenant: str, credential: str, job_id: str) -> Job:
        name, admin = self._tenant(tenant, credential)
        job = self.jobs.get(job_id)
        if job is None or not (admin or job.tenant == name):
            raise TenantAccessError(f"no job {job_id!r} of yours; `pathways jobs` lists them")
        return job

    # -- the requests -------------------------------------------------------------------------------------
    def submit(self, tenant: str, credential: str, entrypoint: list[str], name: str | None, archive: bytes) -> dict:
        """Start ``entrypoint`` as a job of ``tenant`` in the unpacked ``archive``; returns the job's row."""
        owner, _ = self._tenant(tenant, credential)
        if owner is None:
            raise TenantAccessError("a job is submitted with its tenant's credential, not the admin's")
        record = self.rm.registry.get(owner)
        limit = record.limits.jobs
        with self._lock:
            running = sum(1 for j in self.jobs.values() if j.tenant == owner and j.ended is None)
            if running >= limit:
                raise over("jobs", running, 1, limit, "jobs")
            job_id = name or f"{owner}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            if job_id in self.jobs or not job_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise ResourceError(f"job name {job_id!r} is taken or not made of letters, digits, '-', '_', '.'")
            home = self.root / job_id
            home.mkdir(mode=0o700)
        work = home / "work"
        try:
            self._unpack(archive, work)
            job = self._start(owner, job_id, entrypoint, home, work)
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
        with self._lock:
            self.jobs[job_id] = job
        threading.Thread(target=self._wait, args=(job,), name=f"job-{job_id}", daemon=True).start()
        log.info("started job %s of tenant %s: %s", job_id, owner, entrypoint)
        return job.row()

    def _unpack(self, archive: bytes, work: Path) -> None:
        if len(archive) > MAX_ARCHIVE:
            raise ResourceError(f"the working directory packs to {len(archive)} bytes, over {MAX_ARCHIVE}")
        work.mkdir(mode=0o700)
        try:
            with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
                total = sum(m.size for m in tar.getmembers())
                if total > 4 * MAX_ARCHIVE:
                    raise ResourceError(f"the working directory unpacks to {total} bytes, over {4 * MAX_ARCHIVE}")
                tar.extractall(work, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise PathwaysError(f"the working directory could not be unpacked: {exc}") from None

    def _start(self, tenant: str, job_id: str, entrypoint: list[str], home: Path, work: Path) -> Job:
        argv = [sys.executable, *entrypoint[1:]] if entrypoint[0] in PYTHON_NAMES else list(entrypoint)
        log_path = home / "log"
        read_end, write_end = os.pipe()
        ticket = self.rm.issue_ticket(tenant, job_id)
        os.write(write_end, ticket.encode())
        os.close(write_end)
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": str(work),
               "LANG": os.environ.get("LANG", "C.UTF-8"), "PYTHONUNBUFFERED": "1", ADDRESS_ENV: self.address,
               TENANT_ENV: tenant, JOB_ENV: job_id, TICKET_FD_ENV: str(read_end)}
        user: dict[str, Any] = {}
        if self.user is not None:
            for path in (home, work, *work.rglob("*")):
                os.chown(path, self.user.pw_uid, self.user.pw_gid, follow_symlinks=False)
            user = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        with open(log_path, "wb") as out:
            if self.user is not None:
                os.chown(log_path, self.user.pw_uid, self.user.pw_gid)
            try:
                proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(read_end,),
                                        umask=0o077, **user)
            except OSError as exc:
                raise PathwaysError(f"job {job_id} could not start {argv[0]!r}: {exc.strerror or exc}") from None
            finally:
                os.close(read_end)
        return Job(job_id, tenant, list(entrypoint), log_path, proc)

    def _wait(self, job: Job) -> None:
        code = job.proc.wait()
        job.ended = time.time()
        job.status = "STOPPED" if job.stopping else ("SUCCEEDED" if code == 0 else f"FAILED (exit {code})")
        log.info("job %s of tenant %s ended: %s", job.id, job.tenant, job.status)

    def list(self, tenant: str, credential: str) -> list[dict]:
        """The jobs the credential may see: its tenant's, or every job for the admin; oldest first."""
        name, admin = self._tenant(tenant, credential)
        with self._lock:
            return [j.row() for j in sorted(self.jobs.values(), key=lambda j: j.started)
                    if admin or j.tenant == name]

    def logs(self, tenant: str, credential: str, job_id: str, offset: int) -> dict:
        """Up to 1 MiB of a job's log from byte ``offset``: the text, the next offset, and whether it ended."""
        job = self._job(tenant, credential, job_id)
        ended = job.ended is not None
        with open(job.log, "rb") as f:
            f.seek(max(0, offset))
            chunk = f.read(1 << 20)
        return {"text": chunk.decode(errors="replace"), "offset": max(0, offset) + len(chunk), "ended": ended,
                "status": job.status}

    def stop(self, tenant: str, credential: str, job_id: str) -> str:
        """End a job's process group (SIGTERM, then SIGKILL after ``STOP_GRACE_S``); returns its final status."""
        job = self._job(tenant, credential, job_id)
        if job.ended is None:
            job.stopping = True
            _signal(job.proc.pid, signal.SIGTERM)
            try:
                job.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal(job.proc.pid, signal.SIGKILL)
                job.proc.wait(STOP_GRACE_S)
            deadline = time.monotonic() + 2.0
            while job.ended is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return job.status

    def stop_all(self) -> None:
        """Stop every running job (the runtime is going down)."""
        for job in list(self.jobs.values()):
            if job.ended is None:
                job.stopping = True
                _signal(job.proc.pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
