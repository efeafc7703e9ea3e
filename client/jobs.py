"""What the ``pathways`` command does to Ray: the head ``pathways up`` starts, the state file that
remembers it, and tenants' jobs through Ray's job submission API.

The state file (``$PATHWAYS_HOME/cluster.json``, default ``~/.pathways``) records the address and,
only when ``up`` started the head itself, that head's process id and temp dir, so ``down`` stops
exactly that head and never another engineer's Ray. Nothing here imports JAX: ``jobs``, ``logs``,
``stop`` and ``submit`` stay quick.
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

TENANT_ENV = "PATHWAYS_TENANT"
WEIGHT_ENV = "PATHWAYS_WEIGHT"
META_TENANT = "pathways.tenant"
META_WEIGHT = "pathways.weight"
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
        return self.head_pid is not None


# -- state file ------------------------------------------------------------------------------------

def state_path() -> Path:
    home = os.environ.get("PATHWAYS_HOME")
    return (Path(home) if home else Path.home() / ".pathways") / "cluster.json"


def load_state() -> ClusterState | None:
    path = state_path()
    if not path.exists():
        return None
    try:
        return ClusterState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise CliError(f"the state file {path} is unreadable ({exc}); delete it and retry") from None


def save_state(state: ClusterState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def clear_state() -> None:
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
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path or Path.home() / ".ray" / "auth_token").exists()


def enable_token_auth() -> None:
    """Use the local Ray token when there is one. Ray enables it by itself only for address="auto";
    an explicit address (ours always is) needs RAY_AUTH_MODE=token. Must run before Ray is imported."""
    if "RAY_AUTH_MODE" not in os.environ and token_available():
        os.environ["RAY_AUTH_MODE"] = "token"


# -- the head --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(port: int, what: str) -> None:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            raise CliError(f"{what} port {port} is in use (another Ray cluster?); pick another with --port / "
                           "--dashboard-port") from None


def start_head(port: int, dashboard_port: int, num_cpus: int | None, timeout: float) -> tuple[str, int, str]:
    """Start ``ray start --head --block`` in its own process group with its own temp dir.

    Returns (GCS address, head pid, temp dir). Every auxiliary port is a fresh free one, so this
    head never collides with another cluster on the same machine.
    """
    check_port_free(port, "Ray")
    check_port_free(dashboard_port, "dashboard")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled" and not token_available():
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                       check=True, capture_output=True, timeout=60)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    temp_dir = tempfile.mkdtemp(prefix="pathways-ray-")  # short: Ray's socket paths live under it
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           f"--temp-dir={temp_dir}", f"--port={port}", "--include-dashboard=true",
           f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    # Without this, SIGTERM first drains the node for up to 30 s.
    env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    log = open(Path(temp_dir) / "head.log", "wb")  # noqa: SIM115 - the head writes it after we return
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    address_file = Path(temp_dir) / "ray_current_cluster"  # Ray writes it once the head is up
    deadline = time.monotonic() + timeout
    while not address_file.exists() or not address_file.read_text().strip():
        if proc.poll() is not None:
            tail = (Path(temp_dir) / "head.log").read_text(errors="replace")[-2000:]
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise CliError(f"`ray start --head` exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            stop_head(proc.pid, temp_dir)
            raise CliError(f"the Ray head did not start within {timeout:.0f}s; see {temp_dir}/head.log")
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


def check_tenant(tenant: str, weight: float) -> None:
    if not TENANT_PATTERN.match(tenant):
        raise CliError(f"tenant {tenant!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter "
                       "or digit")
    if not weight > 0:
        raise CliError(f"weight must be positive, got {weight}")


def submit(client: Any, tenant: str, weight: float, entrypoint: list[str], working_dir: str) -> str:
    """Submit ``entrypoint`` as a Ray job of ``tenant``; returns the submission id (it names the tenant).

    The job runs in a copy of ``working_dir`` (so ``python script.py`` resolves) and learns its
    tenant from PATHWAYS_TENANT / PATHWAYS_WEIGHT, which ``pw.init()`` reads.
    """
    check_tenant(tenant, weight)
    if not entrypoint:
        raise CliError("nothing to run: no command given")
    if not Path(working_dir).is_dir():
        raise CliError(f"working directory {working_dir!r} does not exist")
    submission_id = f"{tenant}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    runtime_env = {"working_dir": working_dir, "excludes": EXCLUDES,
                   "env_vars": {TENANT_ENV: tenant, WEIGHT_ENV: repr(float(weight)), "PYTHONUNBUFFERED": "1"}}
    return client.submit_job(entrypoint=shlex.join(entrypoint), submission_id=submission_id,
                             runtime_env=runtime_env, metadata={META_TENANT: tenant, META_WEIGHT: repr(weight)})


def job_rows(client: Any) -> list[dict]:
    """Every submitted job on the cluster, oldest first, with the tenant ``pathways submit`` recorded."""
    rows = []
    for job in client.list_jobs():
        if not job.submission_id:  # a plain driver (ray.init), not a submitted job
            continue
        meta = job.metadata or {}
        rows.append({"id": job.submission_id, "tenant": meta.get(META_TENANT, "-"),
                     "weight": meta.get(META_WEIGHT, "-"), "status": str(job.status.value),
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


def known_job(client: Any, job_id: str) -> None:
    try:
        client.get_job_info(job_id)
    except RuntimeError:
        raise CliError(f"no job {job_id!r} on {os.environ['RAY_ADDRESS']}; `pathways jobs` lists them") from None
