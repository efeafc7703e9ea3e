"""What the ``pathways`` command does to Ray: the head ``pathways up`` starts, the state file that
remembers it, the secrets it keeps, and tenants' jobs through Ray's job submission API.

Everything lives under ``$PATHWAYS_HOME`` (default ``~/.pathways``):

- ``cluster.json``: the address and, only when ``up`` started the head itself, that head's process
  id and temp dir, so ``down`` stops exactly that head and never another engineer's Ray;
- ``admin.token``: the cluster admin's credential (``pathways up`` creates it), owner-only;
- ``credentials/NAME``: a tenant's credential (``pathways tenants add`` writes it), owner-only;
- ``registry.json``: the tenant registry the resource manager keeps (digests only), by default.

A job never receives a long-lived credential: Ray's job API shows every job's entrypoint, metadata
and environment to anyone who can reach it. ``submit`` hands the job a single-use ticket instead.
The module itself imports neither Ray nor JAX; the functions that talk to the runtime import them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The environment and files pw.init reads too; client.session and client.admin import these names.
TENANT_ENV = "PATHWAYS_TENANT"
CREDENTIAL_ENV = "PATHWAYS_CREDENTIAL"
TICKET_ENV = "PATHWAYS_TICKET"
HOME_ENV = "PATHWAYS_HOME"
ADMIN_FILE = "admin.token"
REGISTRY_FILE = "registry.json"
META_TENANT = "pathways.tenant"
# Never passed on to the Ray head (and so to every job): one process's identity is not every job's.
PRIVATE_ENV = (TENANT_ENV, CREDENTIAL_ENV, TICKET_ENV, "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
PYTHON_NAMES = {"python", "python3", f"python3.{sys.version_info.minor}"}
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Never shipped with a job's working directory: version control, caches, environments, build output.
EXCLUDES = [".git", "**/__pycache__", "*.egg-info", ".venv", "venv", ".pytest_cache", ".ruff_cache",
            ".mypy_cache", "node_modules", "build", "dist"]


class CliError(Exception):
    """A user-facing error: printed as one line, no traceback."""


@dataclass(frozen=True)
class ClusterState:
    """What ``pathways up`` did: the cluster's address and, if it started the head, how to stop it."""

    address: str
    dashboard: str | None
    head_pid: int | None  # None: `up` joined a cluster it did not start, so `down` leaves the head alone
    temp_dir: str | None
    topology: dict
    started: float

    @property
    def owns_head(self) -> bool:
        """Whether ``pathways up`` started the head (so ``pathways down`` stops it)."""
        return self.head_pid is not None


# -- state file ------------------------------------------------------------------------------------

def home() -> Path:
    """Where the ``pathways`` command and ``pw.init`` keep state and credentials: ``$PATHWAYS_HOME``, default
    ``~/.pathways``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".pathways")


def state_path() -> Path:
    """The state file: ``$PATHWAYS_HOME/cluster.json``."""
    return home() / "cluster.json"


def load_state() -> ClusterState | None:
    """What ``pathways up`` recorded, or None; CliError if the file is unreadable."""
    path = state_path()
    if not path.exists():
        return None
    try:
        return ClusterState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise CliError(f"the state file {path} is unreadable ({exc}); delete it and retry") from None


def save_state(state: ClusterState) -> None:
    """Record ``state`` in the state file (written atomically)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def clear_state() -> None:
    """Forget the recorded cluster."""
    state_path().unlink(missing_ok=True)


def resolve_address(arg: str | None) -> str:
    """``--address``, else ``RAY_ADDRESS``, else the cluster ``pathways up`` recorded."""
    state = load_state()
    address = arg or os.environ.get("RAY_ADDRESS") or (state.address if state else None)
    if not address:
        raise CliError("no cluster: pass --address, set RAY_ADDRESS, or run `pathways up` first")
    if "://" in address:
        raise CliError(f"{address!r} looks like a URL; pass the Ray (GCS) address host:port that `pathways up` printed")
    # Ray's clients (ray.init, JobSubmissionClient) let RAY_ADDRESS override their argument: make them agree.
    os.environ["RAY_ADDRESS"] = address
    if state and state.address == address and state.dashboard:
        os.environ.setdefault("RAY_API_SERVER_ADDRESS", state.dashboard)  # skips a GCS lookup per command
    return address


# -- token authentication --------------------------------------------------------------------------

def token_available() -> bool:
    """Whether a Ray authentication token is at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path or Path.home() / ".ray" / "auth_token").exists()


def enable_token_auth() -> None:
    """Use the local Ray token when there is one, for this process and its children.

    Ray 2.60 clusters require token authentication, but Ray turns it on by itself only in a process
    that starts a cluster (or for address="auto"); a process that attaches to an explicit address
    must opt in, or the GCS and the job API refuse it. Ray's own helper also refreshes Ray's cached
    config, so this works after Ray is imported too. A Ray without token authentication: no-op."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    # Ray warns "Token authentication is enabled" each time it opts in; it is what we asked for.
    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


# -- secrets ---------------------------------------------------------------------------------------

def write_secret(path: Path, secret: str) -> Path:
    """Write ``secret`` to ``path``, readable by its owner only (file 0600, folder 0700), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return path


def read_secret(path: Path | str) -> str | None:
    """The secret in ``path``; None if there is no such file; CliError if it is there but unreadable."""
    path = Path(path).expanduser()
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


def admin_path() -> Path:
    """Where the admin credential lives: ``$PATHWAYS_HOME/admin.token``."""
    return home() / ADMIN_FILE


def credential_path(tenant: str) -> Path:
    """Where a tenant's credential lives: ``$PATHWAYS_HOME/credentials/TENANT``; CliError for an invalid name."""
    return home() / "credentials" / check_tenant(tenant)  # a checked name never leaves that folder


def admin_credential(file: str | None = None) -> str | None:
    """The admin credential: from ``file`` (which must exist), else ``$PATHWAYS_HOME/admin.token``, else None."""
    if file:
        secret = read_secret(file)
        if secret is None:
            raise CliError(f"--admin-credential-file {file}: no such file (or it is empty)")
        return secret
    return read_secret(admin_path())


def need_admin_credential(file: str | None, what: str) -> str:
    """The admin credential (as ``admin_credential``), or CliError saying that ``what`` needs it."""
    secret = admin_credential(file)
    if secret is None:
        raise CliError(f"{what} needs the cluster's admin credential: {admin_path()} does not exist (`pathways up` "
                       "writes it for the admin who ran it); pass --admin-credential-file FILE")
    return secret


def ensure_admin_credential() -> tuple[str, bool]:
    """The admin credential of this ``$PATHWAYS_HOME``, created (owner-only) if there is none yet; and whether
    it was created now."""
    from pathways.auth import new_secret

    secret = read_secret(admin_path())
    if secret is not None:
        os.chmod(admin_path(), 0o600)  # whoever loosened it: readable by its owner only
        return secret, False
    secret = new_secret()
    write_secret(admin_path(), secret)
    return secret, True


def tenant_credential(tenant: str, file: str | None = None) -> tuple[str, str] | None:
    """A tenant's credential and where it came from: ``file`` (which must exist), else PATHWAYS_CREDENTIAL,
    else ``$PATHWAYS_HOME/credentials/TENANT``; None if none of them has one."""
    if file:
        secret = read_secret(file)
        if secret is None:
            raise CliError(f"--credential-file {file}: no such file (or it is empty)")
        return secret, file
    if os.environ.get(CREDENTIAL_ENV):
        return os.environ[CREDENTIAL_ENV].strip(), CREDENTIAL_ENV
    path = credential_path(tenant)
    secret = read_secret(path)
    return (secret, str(path)) if secret else None


# -- the head --------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(port: int, what: str) -> None:
    """CliError unless ``port`` can be bound on this machine (``what`` names it in the message)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            raise CliError(f"{what} port {port} is in use (another Ray cluster?); pick another with --port / "
                           "--dashboard-port") from None


class _SlowStart(Exception):
    """Ray gave up on its own raylet: it allows it 30 s to register, which a busy machine can exceed."""


def start_head(port: int, dashboard_port: int, num_cpus: int | None, timeout: float) -> tuple[str, int, str]:
    """Start ``ray start --head --block`` in its own process group with its own temp dir.

    Returns (GCS address, head pid, temp dir). Every auxiliary port is a fresh free one, so this
    head never collides with another cluster on the same machine. A head whose raylet Ray gave up on
    (too slow to register on a busy machine) is tried again while ``timeout`` allows.
    """
    check_port_free(port, "Ray")
    check_port_free(dashboard_port, "dashboard")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled" and not token_available():
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                       check=True, capture_output=True, timeout=60)
        enable_token_auth()
    deadline = time.monotonic() + timeout
    for attempt in range(1, 4):
        try:
            return _start_head(port, dashboard_port, num_cpus, deadline)
        except _SlowStart as exc:
            if attempt == 3 or deadline - time.monotonic() < 45:
                raise CliError(f"the Ray head did not start: {exc}") from None
            print(f"the Ray head did not start ({exc}); trying again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _start_head(port: int, dashboard_port: int, num_cpus: int | None, deadline: float) -> tuple[str, int, str]:
    temp_dir = tempfile.mkdtemp(prefix="pathways-ray-")  # short: Ray's socket paths live under it
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           f"--temp-dir={temp_dir}", f"--port={port}", "--include-dashboard=true",
           f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    # Without this, SIGTERM first drains the node for up to 30 s. Every job inherits the head's environment:
    # never this process's tenant, credential or ticket.
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    from pathways.names import RAY_SYSTEM_ENV

    env.update(RAY_SYSTEM_ENV)
    log_path = Path(temp_dir) / "head.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the head writes it after we return
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    address_file = Path(temp_dir) / "ray_current_cluster"  # Ray writes it once the head is up
    while not address_file.exists() or not address_file.read_text().strip():
        if proc.poll() is not None:
            text = log_path.read_text(errors="replace")
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it started before it gave up
            except ProcessLookupError:
                pass
            if "timed out during startup" in text:
                shutil.rmtree(temp_dir, ignore_errors=True)
                raise _SlowStart("Ray gave its raylet 30 s to register, and the machine is busy")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            raise CliError(f"`ray start --head` exited with {proc.returncode}: {lines[-1] if lines else 'no output'} "
                           f"(its log: {log_path})")
        if time.monotonic() > deadline:
            stop_head(proc.pid, temp_dir)
            raise CliError("the Ray head did not start in time (--timeout)")
        time.sleep(0.2)
    return address_file.read_text().strip(), proc.pid, temp_dir


def _is_our_head(pid: int, temp_dir: str) -> bool:
    """True while ``pid`` is the ``ray start`` we launched (not a recycled pid)."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child (only when up and down share a process)
    except ChildProcessError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to "the pid exists"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return temp_dir in cmdline


def head_alive(state: ClusterState) -> bool:
    """Whether the head ``pathways up`` started (per ``state``) still runs."""
    return state.owns_head and _is_our_head(state.head_pid, state.temp_dir)


def stop_head(pid: int, temp_dir: str, timeout: float = 30.0) -> float:
    """SIGTERM the head's process group (``ray start --block`` then stops every Ray process it started),
    SIGKILL it after ``timeout``; remove its temp dir. Returns the seconds it took."""
    t0 = time.monotonic()
    if _is_our_head(pid, temp_dir):
        os.killpg(pid, signal.SIGTERM)
        deadline = t0 + timeout
        while _is_our_head(pid, temp_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _is_our_head(pid, temp_dir):
            os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return time.monotonic() - t0


# -- jobs ------------------------------------------------------------------------------------------

def job_client(timeout: float = 60.0) -> Any:
    """A JobSubmissionClient for the address resolve_address() chose (it reads RAY_ADDRESS)."""
    from ray.job_submission import JobSubmissionClient

    # These set INFO on import ("Uploading package ..."); the command prints its own summary.
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return JobSubmissionClient(os.environ["RAY_ADDRESS"])
        except ConnectionError as exc:  # the dashboard starts a few seconds after the head
            if time.monotonic() > deadline:
                raise CliError(f"cannot reach the Ray job API of {os.environ['RAY_ADDRESS']}: {exc}") from None
            time.sleep(1.0)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name (1-63 letters, digits, '.', '_' or '-'); CliError otherwise."""
    if not TENANT_PATTERN.match(tenant):
        raise CliError(f"tenant {tenant!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter "
                       "or digit")
    return tenant


def new_submission_id(tenant: str) -> str:
    """A job's submission id: it names the tenant, the time, and 6 random hex digits."""
    return f"{check_tenant(tenant)}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def with_our_python(entrypoint: list[str]) -> list[str]:
    """``entrypoint`` with a leading ``python``/``python3`` replaced by this process's interpreter, so the job
    runs in the submitter's environment even when its venv is not activated (the job's shell would find the
    ``python`` on the head's PATH)."""
    if entrypoint and entrypoint[0] in PYTHON_NAMES:
        return [sys.executable, *entrypoint[1:]]
    return list(entrypoint)


def submit(client: Any, tenant: str, ticket: str, entrypoint: list[str], working_dir: str,
           submission_id: str) -> str:
    """Submit ``entrypoint`` as Ray job ``submission_id`` of ``tenant``; returns the submission id.

    The job runs in a copy of ``working_dir`` (so ``python script.py`` resolves), with this process's
    Python (``with_our_python``, and its folder first on PATH). It receives only ``ticket``
    (PATHWAYS_TICKET), which its ``pw.init()`` exchanges for a session once; PATHWAYS_TENANT is there
    for display. Everything here is public on Ray's job API: never put a credential in it.
    """
    check_tenant(tenant)
    if not entrypoint:
        raise CliError("nothing to run: no command given")
    if not Path(working_dir).is_dir():
        raise CliError(f"working directory {working_dir!r} does not exist")
    env_vars = {TENANT_ENV: tenant, TICKET_ENV: ticket, "PYTHONUNBUFFERED": "1",
                "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}${{PATH}}",  # Ray expands ${PATH}
                # What the job's session reports as its job (a refused ticket is logged with it); Ray itself
                # does not set this variable in a job's driver.
                "RAY_JOB_SUBMISSION_ID": submission_id}
    runtime_env = {"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env_vars}
    return client.submit_job(entrypoint=shlex.join(with_our_python(entrypoint)), submission_id=submission_id,
                             runtime_env=runtime_env, metadata={META_TENANT: tenant})


def job_rows(client: Any) -> list[dict]:
    """Every submitted job on the cluster, oldest first, with the tenant ``pathways submit`` recorded."""
    rows = []
    for job in client.list_jobs():
        if not job.submission_id:  # a plain driver (ray.init), not a submitted job
            continue
        meta = job.metadata or {}
        rows.append({"id": job.submission_id, "tenant": meta.get(META_TENANT, "-"), "status": str(job.status.value),
                     "start": job.start_time and job.start_time / 1000, "end": job.end_time and job.end_time / 1000,
                     "entrypoint": job.entrypoint, "message": job.message or ""})
    return sorted(rows, key=lambda r: r["start"] or 0)


def wait_job(client: Any, job_id: str, timeout: float) -> str:
    """Poll until the job ends; returns its final status name."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return str(status.value)
        if time.monotonic() > deadline:
            raise CliError(f"job {job_id} still {status.value} after {timeout:.0f}s")
        time.sleep(0.5)


def follow_logs(client: Any, job_id: str, write: Callable[[str], Any]) -> None:
    """Stream the job's logs until it ends (Ray closes the stream then)."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)

    asyncio.run(tail())


def job_tenant(client: Any, job_id: str) -> str | None:
    """The tenant ``pathways submit`` recorded for the job (None for a job it did not submit); CliError if
    there is no such job."""
    try:
        info = client.get_job_info(job_id)
    except RuntimeError:
        raise CliError(f"no job {job_id!r} on {os.environ['RAY_ADDRESS']}; `pathways jobs` lists them") from None
    return (info.metadata or {}).get(META_TENANT)


# -- the runtime -----------------------------------------------------------------------------------

def runtime(address: str) -> Any:
    """Attach this process to the Ray cluster at ``address``; the resource manager's handle."""
    from client.runtime import connect, find_runtime
    from pathways.errors import PathwaysError

    try:
        connect(address)
    except PathwaysError as exc:
        raise CliError(str(exc)) from None
    rm = find_runtime()
    if rm is None:
        raise CliError(f"no pathways runtime runs at {address}: start it with `pathways up`")
    return rm


def ask(rm: Any, method: str, kind: str, body: dict, timeout: float = 60.0) -> Any:
    """Call one of the resource manager's public methods with a ``kind`` message; its reply's value, or the
    error it answered (a PathwaysError)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from pathways import wire
    from pathways.errors import from_wire

    try:
        raw = ray.get(getattr(rm, method).remote(wire.encode(kind, body)), timeout=timeout)
    except GetTimeoutError:
        raise CliError(f"the resource manager did not answer within {timeout:.0f}s") from None
    except RayActorError as exc:
        raise CliError(f"the resource manager is gone ({type(exc).__name__}); restart it with `pathways up`") \
            from None
    msg = wire.decode(raw, "reply")
    if not msg["ok"]:
        raise from_wire(*msg["value"])
    return msg["value"]


def issue_ticket(rm: Any, tenant: str, credential: str, job: str) -> str:
    """A single-use ticket for job ``job`` of ``tenant`` (short-lived; the job's ``pw.init()`` redeems it)."""
    from pathways.errors import PathwaysError

    try:
        return ask(rm, "issue_ticket", "ticket", {"tenant": tenant, "credential": credential, "job": job})
    except PathwaysError as exc:
        raise CliError(f"no ticket for tenant {tenant!r}: {exc}") from None


def whoami(rm: Any, tenant: str, credential: str) -> dict | None:
    """``{"admin": bool, "tenant": name or None}`` for a valid credential (the admin's, or ``tenant``'s);
    None for one the resource manager does not accept."""
    from pathways.errors import TenantAccessError

    try:
        return ask(rm, "whoami", "ticket", {"tenant": tenant, "credential": credential, "job": ""})
    except TenantAccessError:
        return None
