"""Tenants' jobs (``pathways submit``): processes the runtime starts that can reach neither Ray nor each other.

A job is its tenant's command, run in a copy of the working directory the tenant sent (a tar archive, unpacked
with the archive data filter: no absolute paths, no links out, no devices, no setuid bits), on the resource
manager's node, as its tenant's own OS user (``job_users``): no job reads another tenant's job's memory,
environment or files, nor the runtime's files (the admin's and Ray's tokens among them), so none can reach Ray or
act as another tenant. Only with ``pathways up --unsafe-jobs-as-runtime-user`` do jobs run as the runtime's own
user. The process gets a minimal environment (no Ray address or token, no credential; the runtime's address and
its tenant's name) and a single-use ticket through an inherited pipe, which its ``pw.init()`` reads once and
exchanges for a session: the ticket never appears in an environment, a command line or Ray's job API, and it
opens a session only for its own job.

An archive is admitted before a byte of it is read (``admit``: its tenant's credential, job user, running jobs,
and ``job_disk_bytes`` budget for the size its message announces), then streams to disk (``receive``) and is
unpacked within the budget (``start``; layout and counting in ``job_disk``). The job's output goes through the
runtime into a log of the runtime's (at most ``LOG_BYTES``), which its tenant reads back with ``pathways logs``.
When a job ends, its process group ends with it, its folder is removed, and once no other job of its tenant runs,
so is every process left of its user; each tenant's last ``KEPT_ENDED`` ended jobs keep their logs. A job whose
tenant is removed is stopped.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pathways.budgets import over
from pathways.errors import PathwaysError, ResourceError, TenantAccessError
from pathways.names import ADDRESS_ENV, JOB_ENV, TENANT_ENV, TICKET_FD_ENV
from resource_manager import job_users
from resource_manager.job_disk import Archive, Folders, Ledger, chown_tree, default_root
from resource_manager.registry import Registry, TenantRecord
from resource_manager.tickets import Tickets

MAX_ARCHIVE = 256 << 20  # a job's working directory, packed
LOG_BYTES = 8 << 20  # one job's log: what it prints past this is dropped (the log says so)
KEPT_ENDED = 16  # ended jobs whose rows and logs are kept, per tenant
STOP_GRACE_S = 10.0
WATCH_S = 0.5  # how often a running job is checked: ended, or its tenant removed
DRAIN_S = 2.0  # how long a job's output is still read after its process ended
CHUNK = 1 << 20  # an archive is written to disk in pieces of this size as they arrive
PYTHON_NAMES = {"python", "python3", f"python3.{sys.version_info.minor}"}
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
log = logging.getLogger(__name__)


@dataclass
class Upload:
    """A job admitted before a byte of its archive was read: whose (``record``, the tenant's registry entry when
    it was admitted), its id and command, the user it will run as (None: the runtime's), and its archive's file
    and size (counted against the tenant's ``job_disk_bytes`` until ``JobRunner.release``)."""

    record: TenantRecord
    job_id: str
    entrypoint: list[str]
    user: pwd.struct_passwd | None
    archive: Path
    nbytes: int
    held: int = 0  # archive bytes still counted


@dataclass
class Job:
    """A job the runner started: whose, what, where its files are, and how it ended."""

    id: str
    record: TenantRecord
    entrypoint: list[str]
    folder: Path
    log: Path
    user: pwd.struct_passwd | None
    proc: subprocess.Popen
    unpacked: int  # bytes of its folder counted against its tenant's budget
    log_bytes: int = 0
    started: float = field(default_factory=time.time)
    exited: float | None = None  # monotonic: when its process ended
    ended: float | None = None  # when it ended and its folder was removed
    status: str = "RUNNING"
    stopping: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tenant(self) -> str:
        return self.record.name

    def row(self) -> dict:
        """The job as ``pathways jobs`` lists it."""
        return {"id": self.id, "tenant": self.tenant, "status": self.status, "start": self.started,
                "end": self.ended, "entrypoint": " ".join(self.entrypoint), "pid": self.proc.pid}


class JobRunner:
    """Admits, starts, lists, logs and stops tenants' jobs. ``registry`` proves credentials and holds the tenants
    and their job users; ``tickets`` issues each job's single-use ticket; ``runtime_id`` names the runtime's jobs'
    folders; ``address`` is the runtime's client address the jobs attach to; ``jobs_dir`` the jobs' root folder
    (default ``job_disk.default_root()``); ``unsafe_runtime_user`` runs every job as the runtime's own user."""

    def __init__(self, registry: Registry, tickets: Tickets, runtime_id: str, address: str, jobs_dir: str | None,
                 unsafe_runtime_user: bool = False) -> None:
        self.registry = registry
        self.tickets = tickets
        self.address = address
        self.unsafe = unsafe_runtime_user
        self.folders = Folders(Path(jobs_dir) if jobs_dir else default_root(), runtime_id,
                               others_pass=not unsafe_runtime_user)
        self.ledger = Ledger()
        self._lock = threading.RLock()
        self._users_lock = threading.Lock()  # a user's processes are never swept while a job of it starts
        self._runs_python: set[int] = set()  # job users checked to run the runtime's Python
        self._admitted: dict[str, Upload] = {}
        self.jobs: dict[str, Job] = {}

    # -- who may do what ----------------------------------------------------------------------------------
    def _tenant(self, tenant: str, credential: str) -> tuple[str | None, bool]:
        """(tenant, is_admin) the credential proves."""
        who = self.registry.whoami(tenant, credential)
        return who["tenant"], who["admin"]

    def _visible(self, job: Job, name: str | None, admin: bool) -> bool:
        """Whether a caller sees ``job``: the admin sees every job; a tenant its own, and none of a tenant of the
        same name that was removed before it was added again."""
        return admin or (job.tenant == name and self.registry.get(name) is job.record)

    def _job(self, tenant: str, credential: str, job_id: str) -> Job:
        name, admin = self._tenant(tenant, credential)
        job = self.jobs.get(job_id)
        if job is None or not self._visible(job, name, admin):
            raise TenantAccessError(f"no job {job_id!r} of yours; `pathways jobs` lists them")
        return job

    def _user(self, record: TenantRecord) -> pwd.struct_passwd | None:
        """The OS user the tenant's jobs run as (None: the runtime's own, where the admin said so); ResourceError
        saying what to do where there is none."""
        if self.unsafe:
            return None
        entry = self.registry.job_user(record.name)
        with self._users_lock:
            if entry.pw_uid not in self._runs_python:
                job_users.check_runs_python(entry)
                self._runs_python.add(entry.pw_uid)
        return entry

    # -- submitting: admit, receive, start, release ---------------------------------------------------------
    def admit(self, tenant: str, credential: str, entrypoint: list, name: str | None, nbytes: int) -> Upload:
        """Admit a job whose archive of ``nbytes`` has not been read yet: the credential is its tenant's, the
        tenant has a job user and room for one more running job, and the archive fits its ``job_disk_bytes``
        budget (counted from now until ``release``). Raises the refusal otherwise."""
        owner, _ = self._tenant(tenant, credential)
        if owner is None:
            raise TenantAccessError("a job is submitted with its tenant's credential, not the admin's")
        if not all(isinstance(a, str) and a for a in entrypoint):
            raise ResourceError("a job's entrypoint is a list of non-empty strings, e.g. ['python', 'train.py']")
        if nbytes > MAX_ARCHIVE:
            raise ResourceError(f"the working directory packs to {nbytes} bytes, over {MAX_ARCHIVE}")
        record = self.registry.get(owner)
        if record is None:
            raise TenantAccessError("this tenant no longer exists")
        user = self._user(record)
        limits = record.limits
        self._forget_removed()
        with self._lock:
            running = sum(1 for j in self.jobs.values() if j.tenant == owner and j.ended is None) + sum(
                1 for u in self._admitted.values() if u.record.name == owner)
            if running >= limits.jobs:
                raise over("jobs", running, 1, limits.jobs, "jobs")
            job_id = name or f"{owner}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            if not isinstance(job_id, str) or not JOB_ID.match(job_id):
                raise ResourceError(f"job name {job_id!r}: use 1-128 letters, digits, '-', '_' or '.', starting with "
                                    "a letter or digit")
            if job_id in self.jobs or job_id in self._admitted:
                raise ResourceError(f"job name {job_id!r} is taken; pick another (or none: one is made up)")
            self._take(owner, nbytes, limits.job_disk_bytes)
            upload = Upload(record, job_id, list(entrypoint), user, self.folders.archive(job_id), nbytes, nbytes)
            self._admitted[job_id] = upload
        return upload

    def receive(self, upload: Upload, read_into: Callable[[memoryview], None]) -> None:
        """Write the archive's ``upload.nbytes`` to its file as they arrive (``read_into`` fills a buffer from the
        connection), a piece at a time: never more than ``CHUNK`` bytes of it in memory."""
        buf = memoryview(bytearray(min(CHUNK, max(upload.nbytes, 1))))
        left = upload.nbytes
        fd = os.open(upload.archive, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            while left:
                piece = buf[:min(left, len(buf))]
                read_into(piece)
                out.write(piece)
                left -= len(piece)

    def start(self, upload: Upload) -> dict:
        """Unpack the received archive within its tenant's budget and start the job; returns its row."""
        record, job_id = upload.record, upload.job_id
        limit = record.limits.job_disk_bytes
        folder = self.folders.job(job_id)
        work, tmp = folder / "work", folder / "tmp"
        taken = 0
        try:
            with Archive(upload.archive) as archive:
                held = self.ledger.held(record.name)
                room = limit - held + self._kept_log_bytes(record.name)  # old logs make room (``_take``)
                unpacked = archive.size(room)
                if unpacked > room:
                    raise over("job_disk_bytes", held, unpacked, limit, "bytes")
                self._take(record.name, unpacked, limit)
                taken = unpacked
                folder.mkdir(mode=0o700)
                for sub in (work, tmp):
                    sub.mkdir(mode=0o700)
                archive.extract(work)
            self._drop_archive(upload)
            if upload.user is not None:
                chown_tree(folder, upload.user.pw_uid, upload.user.pw_gid)
            job = self._spawn(upload, folder, work, tmp, taken)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            self.ledger.give(record.name, taken)
            raise
        log.info("started job %s of tenant %s as %s: %s", job_id, record.name,
                 upload.user.pw_name if upload.user else "the runtime's user", upload.entrypoint)
        return job.row()

    def release(self, upload: Upload) -> None:
        """The upload is done with (its job started, or it failed): its archive's file is removed and no longer
        counts, and its name is free unless a job took it."""
        self._drop_archive(upload)
        with self._lock:
            self._admitted.pop(upload.job_id, None)

    def _drop_archive(self, upload: Upload) -> None:
        upload.archive.unlink(missing_ok=True)
        with self._lock:
            held, upload.held = upload.held, 0
        self.ledger.give(upload.record.name, held)

    def _kept_log_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's ended jobs' logs, which ``_take`` forgets to make room."""
        with self._lock:
            return sum(j.log_bytes for j in self.jobs.values() if j.tenant == tenant and j.ended is not None)

    def _take(self, tenant: str, nbytes: int, limit: int) -> None:
        """Count ``nbytes`` against the tenant's budget, forgetting its oldest ended jobs' logs to make room."""
        with self._lock:
            while True:
                try:
                    return self.ledger.take(tenant, nbytes, limit)
                except ResourceError:
                    ended = sorted((j for j in self.jobs.values() if j.tenant == tenant and j.ended is not None),
                                   key=lambda j: j.ended)
                    if not ended:
                        raise
                    self._forget(ended[0])

    def _spawn(self, upload: Upload, folder: Path, work: Path, tmp: Path, unpacked: int) -> Job:
        """Start the job's process (as its tenant's user) with its ticket on an inherited pipe and its output on
        another, which ``_pump`` copies into its log; register it, and watch it (``_wait``)."""
        entrypoint = upload.entrypoint
        argv = [sys.executable, *entrypoint[1:]] if entrypoint[0] in PYTHON_NAMES else list(entrypoint)
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": str(work),
               "TMPDIR": str(tmp), "LANG": os.environ.get("LANG", "C.UTF-8"), "PYTHONUNBUFFERED": "1",
               ADDRESS_ENV: self.address, TENANT_ENV: upload.record.name, JOB_ENV: upload.job_id}
        user = upload.user
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user is not None else {}
        log_path = self.folders.log(upload.job_id)
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
        ticket = self.tickets.issue(upload.record.name, upload.job_id)
        ticket_r, ticket_w = os.pipe()
        os.write(ticket_w, ticket.encode())
        os.close(ticket_w)
        out_r, out_w = os.pipe()
        try:
            with self._users_lock:
                try:
                    proc = subprocess.Popen(argv, cwd=work, env={**env, TICKET_FD_ENV: str(ticket_r)},
                                            stdin=subprocess.DEVNULL, stdout=out_w, stderr=subprocess.STDOUT,
                                            start_new_session=True, pass_fds=(ticket_r,), umask=0o077, **as_user)
                except OSError as exc:
                    os.close(out_r)
                    raise PathwaysError(f"job {upload.job_id} could not start {argv[0]!r}: "
                                        f"{exc.strerror or exc}") from None
                job = Job(upload.job_id, upload.record, list(entrypoint), folder, log_path, user, proc, unpacked)
                with self._lock:
                    self.jobs[job.id] = job
                    self._admitted.pop(job.id, None)
        finally:
            os.close(ticket_r)
            os.close(out_w)
        pump = threading.Thread(target=_pump, args=(job, out_r, self.ledger), name=f"job-log-{job.id}", daemon=True)
        pump.start()
        threading.Thread(target=self._wait, args=(job, pump), name=f"job-{job.id}", daemon=True).start()
        return job

    # -- a running job --------------------------------------------------------------------------------------
    def _wait(self, job: Job, pump: threading.Thread) -> None:
        """Watch the job until its process ends (stopping it if its tenant was removed), then end what it left:
        its process group, its user's processes when no other job of its tenant runs, its folder."""
        pid = job.proc.pid
        while not _exited(pid, 0.0):
            if not job.stopping and self.registry.get(job.tenant) is not job.record:
                log.info("stopping job %s: its tenant %s was removed", job.id, job.tenant)
                job.stopping = True
                _signal(pid, signal.SIGKILL)
            time.sleep(WATCH_S)
        _signal(pid, signal.SIGKILL)  # the rest of its process group (its pid is not reused until it is reaped)
        code = job.proc.wait()
        job.exited = time.monotonic()
        if job.user is not None:
            with self._users_lock:
                with self._lock:
                    others = any(j.user is not None and j.user.pw_uid == job.user.pw_uid and j.exited is None
                                 for j in self.jobs.values())
                if not others:
                    job_users.end_processes(job.user.pw_uid)
        pump.join(DRAIN_S + 2 * WATCH_S)
        shutil.rmtree(job.folder, ignore_errors=True)
        self.ledger.give(job.tenant, job.unpacked)
        with self._lock:
            job.ended = time.time()
            job.status = "STOPPED" if job.stopping else ("SUCCEEDED" if code == 0 else f"FAILED (exit {code})")
            ended = sorted((j for j in self.jobs.values() if j.tenant == job.tenant and j.ended is not None),
                           key=lambda j: j.ended)
        for old in ended[:-KEPT_ENDED]:
            self._forget(old)
        job.done.set()
        log.info("job %s of tenant %s ended: %s", job.id, job.tenant, job.status)

    def _forget(self, job: Job) -> None:
        """Drop an ended job's row and log."""
        with self._lock:
            if self.jobs.get(job.id) is not job:
                return
            del self.jobs[job.id]
        job.log.unlink(missing_ok=True)
        self.ledger.give(job.tenant, job.log_bytes)

    def _forget_removed(self) -> None:
        """Drop the ended jobs of tenants that were removed (a tenant added again under the name starts afresh)."""
        with self._lock:
            for job in [j for j in self.jobs.values() if j.ended is not None]:
                if self.registry.get(job.tenant) is not job.record:
                    self._forget(job)

    # -- the requests -------------------------------------------------------------------------------------
    def list(self, tenant: str, credential: str) -> list[dict]:
        """The jobs the credential may see: its tenant's, or every job for the admin; oldest first."""
        name, admin = self._tenant(tenant, credential)
        with self._lock:
            return [j.row() for j in sorted(self.jobs.values(), key=lambda j: j.started)
                    if self._visible(j, name, admin)]

    def logs(self, tenant: str, credential: str, job_id: str, offset: int) -> dict:
        """Up to 1 MiB of a job's log from byte ``offset``: the text, the next offset, and whether it ended (and
        its log is whole)."""
        job = self._job(tenant, credential, job_id)
        ended = job.ended is not None
        try:
            with open(job.log, "rb") as f:
                f.seek(max(0, offset))
                chunk = f.read(1 << 20)
        except FileNotFoundError:  # forgotten meanwhile
            chunk = b""
        return {"text": chunk.decode(errors="replace"), "offset": max(0, offset) + len(chunk), "ended": ended,
                "status": job.status}

    def stop(self, tenant: str, credential: str, job_id: str) -> str:
        """End a job's process group (SIGTERM, then SIGKILL after ``STOP_GRACE_S``); returns its final status."""
        job = self._job(tenant, credential, job_id)
        if job.exited is None:
            job.stopping = True
            _signal(job.proc.pid, signal.SIGTERM)
            if not _exited(job.proc.pid, STOP_GRACE_S):
                _signal(job.proc.pid, signal.SIGKILL)
        job.done.wait(STOP_GRACE_S + DRAIN_S + job_users.END_TIMEOUT_S)
        return job.status

    def stop_all(self, timeout: float = 30.0) -> None:
        """Stop every running job and remove the runtime's jobs' folder (the runtime is going down)."""
        running = [j for j in list(self.jobs.values()) if j.exited is None]
        for job in running:
            job.stopping = True
            _signal(job.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for job in running:
            job.done.wait(max(0.0, deadline - time.monotonic()))
        self.folders.remove()


def _pump(job: Job, fd: int, ledger: Ledger) -> None:
    """Copy the job's output into its log, up to ``LOG_BYTES`` and its tenant's budget; what comes past that is
    read and dropped, and the log says so once. Ends at the output's end, or ``DRAIN_S`` after the process
    ended (a process left behind may hold the pipe)."""
    limit = job.record.limits.job_disk_bytes
    cut = False
    try:
        with open(job.log, "ab", buffering=0) as out:
            while True:
                if not select.select([fd], [], [], WATCH_S)[0]:
                    if job.exited is not None and time.monotonic() - job.exited > DRAIN_S:
                        return
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return
                keep = ledger.take_up_to(job.tenant, min(len(chunk), LOG_BYTES - job.log_bytes), limit)
                out.write(chunk[:keep])
                job.log_bytes += keep
                if keep < len(chunk) and not cut:
                    cut = True
                    why = f"{LOG_BYTES >> 20} MiB" if job.log_bytes >= LOG_BYTES else "your job_disk_bytes budget"
                    out.write(f"\n[pathways: the log stops here: it reached {why}; the job's further output is "
                              "dropped]\n".encode())
    finally:
        os.close(fd)


def _exited(pid: int, timeout: float) -> bool:
    """Whether the child ``pid`` ends within ``timeout`` seconds (it is left for its waiter to reap)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
