"""Finding the runtime to attach to, or starting an embedded one.

A client attaches to the runtime's address, ``pathways://HOST:PORT``: the one given to ``pw.init``, else
``PATHWAYS_ADDRESS``, else the one saved by ``pathways login``, else (for a ``pw.init()`` that asks for no
topology of its own) the runtime ``pathways up`` started on this machine (``/tmp/pathways-runtime/current``, when
something answers there). With none of these, ``pw.init()`` starts an
embedded local cluster: a child process (``python -m resource_manager.launch embedded``) that starts Ray and
the runtime, and lives exactly as long as this client (it stops when its stdin closes, which happens when this
process ends for any reason). Either way the client attaches through the same protocol; this process never
imports Ray.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pathways.errors import PathwaysError, ResourceError, from_wire
from pathways.names import ADDRESS_ENV, CURRENT_FILE, HOME_ENV, LOGIN_FILE, TMPDIR_ENV
from pathways.protocol.address import parse_address
from pathways.topology import Topology

CONNECT_TIMEOUT_S = 3.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """Bounds on every wait, in seconds (``pw.Timeouts``).

    Args:
        fetch: how long a client waits for a result.
        op: how long a host waits for an op's inputs (a transfer, a buffer) before failing the op.
        start: how long starting the cluster and the runtime may take.
        poll: how often a long wait checks that the islands it depends on are alive.
        gap: how long an island waits for a client's message that never arrived before it skips it and runs the
            client's later messages; fixed when the runtime starts.
        grace: how long the runtime keeps a session whose client's connection is gone (it may come back) before
            it reclaims everything the session held; fixed when the runtime starts.
        suspend: how long a call made while the admin has the cluster suspended waits for it to resume before it
            fails with ClusterSuspendedError.
        reattach: how long a client whose suspended runtime went away keeps trying to reach it again at its
            address (where the admin resumes it on a new cluster).
    """

    fetch: float = 120.0
    op: float = 60.0
    start: float = 300.0
    poll: float = 1.0
    gap: float = 30.0
    grace: float = 10.0
    suspend: float = 60.0
    reattach: float = 600.0


def current_file() -> Path:
    """Where ``pathways up`` publishes this machine's runtime: ``$PATHWAYS_TMPDIR/current`` (default
    ``/tmp/pathways-runtime/current``)."""
    return Path(os.environ.get(TMPDIR_ENV) or "/tmp/pathways-runtime") / CURRENT_FILE


def home() -> Path:
    """Where the ``pathways`` command and ``pw.init`` keep state and credentials: ``$PATHWAYS_HOME``, default
    ``~/.pathways``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".pathways")


@dataclass(frozen=True)
class Login:
    """What ``pathways login`` saved: a runtime's address, the tenant to act as there, and its credential."""

    address: str
    tenant: str
    credential: str


def login_path() -> Path:
    """``$PATHWAYS_HOME/login.json``."""
    return home() / LOGIN_FILE


def load_login() -> Login | None:
    """The saved login, or None; PathwaysError if the file is there but unreadable."""
    path = login_path()
    try:
        return Login(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise PathwaysError(f"{path} is unreadable ({exc}); run `pathways login` again") from None


def save_login(login: Login) -> Path:
    """Save ``login`` owner-only (file 0600, folder 0700), atomically."""
    path = login_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(login), f)
    os.replace(tmp, path)
    return path


def reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``address``."""
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, PathwaysError):
        return False


def machine_runtime() -> str | None:
    """The address of the runtime ``pathways up`` started on this machine, if one answers there."""
    try:
        address = current_file().read_text().strip()
    except OSError:
        return None
    if address and reachable(address, 1.0):
        return address
    if address:
        log.info("ignoring %s (%s): nothing answers there", current_file(), address)
    return None


def find_address(address: str | None, machine: bool = True) -> tuple[str | None, str]:
    """The runtime to attach to and where its address came from; (None, "") when there is none to attach to.
    ``machine``: a runtime ``pathways up`` started on this machine counts too."""
    if address:
        return address, "pw.init(address=...)"
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV], ADDRESS_ENV
    saved = load_login()
    if saved is not None:
        return saved.address, str(login_path())
    running = machine_runtime() if machine else None
    if running is not None:
        return running, f"{current_file()} (`pathways up` on this machine)"
    return None, ""


class Embedded:
    """An embedded local cluster: Ray and the runtime in a child process that lives as long as this client.

    The child reads its options (secrets included) from stdin, answers with the runtime's address, then waits
    for stdin to close; when this process ends, however it ends, the pipe closes and the child stops Ray."""

    def __init__(self, topology: Topology, timeouts: Timeouts, admin_credential: str, tenant: str,
                 credential: str, default_quota: int | None) -> None:
        options = {"topology": topology.to_wire(), "op_timeout": timeouts.op, "gap_timeout": timeouts.gap,
                   "start_timeout": timeouts.start, "grace": timeouts.grace, "admin_credential": admin_credential,
                   "tenant": tenant, "credential": credential, "default_quota": default_quota}
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", ADDRESS_ENV)}
        self.proc = subprocess.Popen([sys.executable, "-m", "resource_manager.launch", "embedded"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.proc.stdin.write(json.dumps(options) + "\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc, timeouts.start)
        answer = json.loads(line) if line else {"error": "the embedded cluster exited before it started "
                                                "(its output above says why)", "kind": "ResourceError"}
        if "error" in answer:
            self.stop()
            raise from_wire(answer.get("kind", "ResourceError"), answer["error"])
        self.address: str = answer["address"]
        self.runtime: str = answer["runtime"]
        self.ray_address: str = answer["ray_address"]  # for operators' tools; clients never use it

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the embedded cluster: close its stdin and wait for it to take Ray down."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if timeout <= 0:
            return  # it stops by itself: its stdin is closed
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise ResourceError(f"the embedded cluster did not start within {timeout:.0f}s")
    return proc.stdout.readline().strip()
