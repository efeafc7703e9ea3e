"""The Ray head ``pathways up`` starts, and the state file that remembers it.

``$PATHWAYS_HOME/cluster.json`` records the runtime's address and, when ``up`` started the Ray head itself,
that head's process id and folder (Ray's temp dir inside it, in a folder only this user may enter), so ``down``
stops exactly that head and never another engineer's Ray.
The record is written the moment the head's process exists (phase ``starting``), so an ``up`` that was
interrupted (Ctrl-C, a closed pipe, a kill) leaves what ``down`` needs to find and stop what it started.
The runtime's address also goes to ``/tmp/pathways-runtime/current`` (world-readable, like Ray's own
``ray_current_cluster``), where a bare ``pw.init()`` on this machine finds it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from client.runtime import current_file, home
from command.output import CliError
from pathways.names import ADDRESS_ENV, CREDENTIAL_ENV, RAY_SYSTEM_ENV, TENANT_ENV

# Never passed on to the Ray head (and so to the runtime): one process's identity is not the runtime's.
PRIVATE_ENV = (TENANT_ENV, CREDENTIAL_ENV, ADDRESS_ENV, "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
RAY_DIR = "ray"  # Ray's temp dir, inside the head's private folder


@dataclass(frozen=True)
class ClusterState:
    """What ``pathways up`` did: the runtime's address, the Ray cluster under it and, if ``up`` started the
    head, how to stop it; ``phase`` is ``starting`` until the runtime answered."""

    address: str | None
    ray_address: str | None
    head_pid: int | None  # None: `up` joined a Ray cluster it did not start, so `down` leaves the head alone
    temp_dir: str | None
    topology: dict
    started: float
    phase: str = "up"

    @property
    def owns_head(self) -> bool:
        """Whether ``pathways up`` started the head (so ``pathways down`` stops it)."""
        return self.head_pid is not None


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
    """Record ``state`` (written atomically, readable by its owner only)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=2)
    os.replace(tmp, path)


def clear_state() -> None:
    """Forget the recorded cluster."""
    state_path().unlink(missing_ok=True)


def publish(address: str) -> None:
    """Tell this machine's clients where the runtime is (``/tmp/pathways-runtime/current``, world-readable, in a
    folder only this user may change: whoever could change it could send this machine's clients, credentials and
    all, to a runtime of theirs). CliError if the folder is another user's."""
    path = current_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    info = os.lstat(path.parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        what = "is a link" if stat.S_ISLNK(info.st_mode) else f"belongs to uid {info.st_uid}"
        raise CliError(f"{path.parent} {what}: whoever owns it could send this machine's clients to a runtime of "
                       "theirs. Remove it, or set PATHWAYS_TMPDIR to a folder of yours")
    os.chmod(path.parent, 0o755)
    tmp = path.with_name(f".current.{os.getpid()}")
    tmp.write_text(address + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def unpublish(address: str | None) -> None:
    """Remove ``/tmp/pathways-runtime/current`` if it names ``address`` (a runtime that is going away)."""
    path = current_file()
    try:
        if address and path.read_text().strip() == address:
            path.unlink()
    except OSError:
        pass


# -- the head --------------------------------------------------------------------------------------

def free_ports(count: int, avoid: set[int]) -> list[int]:
    """``count`` distinct TCP ports free on this machine now, none in ``avoid``. They are held together while
    chosen: one at a time, the kernel may hand out the same port twice, and Ray refuses to start when two of its
    components are given one port."""
    held: dict[int, socket.socket] = {}
    try:
        while len(held) < count:
            s = socket.socket()
            s.bind(("", 0))
            port = s.getsockname()[1]
            if port in avoid or port in held:
                s.close()
                continue
            held[port] = s
        return list(held)
    finally:
        for s in held.values():
            s.close()


def port_free(port: int) -> bool:
    """Whether ``port`` can be listened on now. A port whose last connections linger in TIME-WAIT counts as free:
    the next server sets SO_REUSEADDR, as Ray's does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError:
            return False
    return True


def check_port_free(port: int, what: str) -> None:
    """CliError unless ``port`` is free (``what`` names it in the message)."""
    if not port_free(port):
        raise CliError(f"{what} port {port} is in use (another Ray cluster, or a runtime `pathways down` did not "
                       "stop?); pick another with --port / --client-port, or run `pathways down` first")


def ray_token_path() -> Path:
    """Where Ray keeps its authentication token on this machine."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_ray_token() -> None:
    """A Ray token readable by this user only (Ray writes it world-readable; a job running as another user must
    not find it)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return
    path = ray_token_path()
    if not os.environ.get("RAY_AUTH_TOKEN") and not path.exists():
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"], check=True,
                       capture_output=True, timeout=60)
    if path.exists():
        os.chmod(path, 0o600)


# How long the head's daemons get to end by themselves before they are killed. On SIGTERM, `ray start --block` ends
# them one at a time, allowing each 1 s (3-4 s in all), and keeps nothing worth the wait: the runtime on it was
# stopped first, and its temp dir is removed.
HEAD_GRACE_S = 0.5


class _SlowStart(Exception):
    """Ray gave up on its own raylet: it allows it 30 s to register, which a busy machine can exceed."""


def start_head(port: int, num_cpus: int | None, timeout: float, record: callable,
               avoid: frozenset[int] = frozenset()) -> tuple[str, int, str]:
    """Start ``ray start --head --block`` in its own process group with its own temp dir; ``record(pid, dir)``
    is called as soon as the process exists; Ray's other ports keep clear of ``avoid`` (the runtime's own).
    Returns (GCS address, head pid, temp dir)."""
    check_port_free(port, "Ray")
    ensure_ray_token()
    deadline = time.monotonic() + timeout
    for attempt in range(1, 4):
        try:
            return _start_head(port, num_cpus, deadline, record, avoid)
        except _SlowStart as exc:
            if attempt == 3 or deadline - time.monotonic() < 45:
                raise CliError(f"the Ray head did not start: {exc}") from None
            print(f"the Ray head did not start ({exc}); trying again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _start_head(port: int, num_cpus: int | None, deadline: float, record: callable,
                avoid: frozenset[int]) -> tuple[str, int, str]:
    # Ray makes its temp dir and session folders world-writable (0777, no sticky bit), where a tenant's job could
    # move Ray's sockets: they go in a folder of this user alone (mkdtemp's 0700), which nobody else can enter.
    # The name stays short: Ray's socket paths live under it.
    temp_dir = tempfile.mkdtemp(prefix="pathways-ray-")
    ray_dir = Path(temp_dir) / RAY_DIR
    client, agent, agent_grpc, metrics, runtime_env = free_ports(5, {port, *avoid})
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           f"--temp-dir={ray_dir}", f"--port={port}", "--include-dashboard=false",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={runtime_env}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    # Without this, SIGTERM first drains the node for up to 30 s.
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    env.update(RAY_SYSTEM_ENV)
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    record(proc.pid, temp_dir)
    address_file = ray_dir / "ray_current_cluster"  # Ray writes it once the head is up
    while not address_file.exists() or not address_file.read_text().strip():
        if proc.poll() is not None:
            text = log_path.read_text(errors="replace")
            stop_head(proc.pid, temp_dir)
            if "timed out during startup" in text:
                raise _SlowStart("Ray gave its raylet 30 s to register, and the machine is busy")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            raise CliError(f"`ray start --head` exited with {proc.returncode}: {lines[-1] if lines else 'no output'}")
        if time.monotonic() > deadline:
            stop_head(proc.pid, temp_dir)
            raise CliError("the Ray head did not start in time (--timeout)")
        time.sleep(0.2)
    return address_file.read_text().strip(), proc.pid, temp_dir


def is_our_head(pid: int, temp_dir: str) -> bool:
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
    return state.owns_head and is_our_head(state.head_pid, state.temp_dir)


def processes_of(temp_dir: str) -> list[int]:
    """Every process of the head whose temp dir is ``temp_dir``: each Ray process it starts names that folder
    on its command line (logs, sockets, session), and no other cluster's does."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if temp_dir.encode() in cmdline.read_bytes():
                out.append(int(cmdline.parent.name))
        except OSError:  # gone meanwhile
            continue
    return [p for p in out if p != os.getpid()]


def stop_head(pid: int, temp_dir: str) -> float:
    """SIGTERM the head's process group, SIGKILL it after ``HEAD_GRACE_S``; then end whatever of that head outlived it
    (a head interrupted while it was starting leaves its daemons behind), and remove its temp dir. Returns the
    seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + HEAD_GRACE_S
    if is_our_head(pid, temp_dir):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        while is_our_head(pid, temp_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        if is_our_head(pid, temp_dir):
            os.killpg(pid, signal.SIGKILL)
    quiet_since, end = None, time.monotonic() + 10.0  # a daemon may still be starting: sweep until none shows up
    while time.monotonic() < end:
        left = processes_of(temp_dir)
        if not left:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 0.5:
                break
        else:
            quiet_since = None
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.1)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return time.monotonic() - t0
