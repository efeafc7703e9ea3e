"""Finding the runtime to attach to, or starting a runtime of this client's own.

A client attaches to the runtime's address, ``pathways://HOST:PORT``: the one given to ``pw.init``, else
``PATHWAYS_ADDRESS``, else the one saved by ``pathways login``, else (for a ``pw.init()`` that asks for no
topology of its own) the runtime ``pathways up`` started on this machine (``/tmp/pathways-runtime/current``, when
something answers there). With none of these, ``pw.init()`` starts a runtime of its own in a child process
(``python -m resource_manager.launch``, the only Ray driver): on the running Ray cluster ``RAY_ADDRESS`` names
(inside a Ray job, the job's cluster), its islands spread over the cluster's nodes; else on an embedded local
Ray cluster the child starts. The child lives exactly as long as this client: it stops the runtime (and a Ray
it started) when its stdin closes, which happens when this process ends for any reason. Either way the client
attaches through the same protocol; this process never imports Ray.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pathways.errors import PathwaysError, ResourceError, from_wire
from pathways.names import ADDRESS_ENV, CURRENT_FILE, HOME_ENV, LOGIN_FILE, TMPDIR_ENV
from pathways.protocol import handshake
from pathways.protocol.address import SCHEME, parse_address
from pathways.topology import Topology

CONNECT_TIMEOUT_S = 3.0
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own: inside a Ray job it names the job's cluster (its GCS, HOST:PORT)
DEFAULT_TENANT = "default"  # who pw.init() acts as unless told: a runtime's own client, or `pathways up`'s admin
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


def ray_address_file() -> Path:
    """Where Ray records the cluster ``ray start`` last started on this machine (what ``RAY_ADDRESS=auto`` means):
    ``$RAY_TMPDIR/ray/ray_current_cluster``, default ``/tmp/ray/ray_current_cluster``."""
    return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"


def ray_cluster() -> str | None:
    """The running Ray cluster ``RAY_ADDRESS`` names, as its GCS address ``HOST:PORT``: where a runtime of this
    client's own goes. None when ``RAY_ADDRESS`` is unset (or ``local``, Ray's word for a new local cluster).

    Raises, within ``CONNECT_TIMEOUT_S``, where it names no cluster that answers (``ray.init`` would retry a dead
    address for minutes) or one pathways cannot start a runtime through (Ray Client's ``ray://``, a dashboard's
    ``http://``): a client told to use a Ray cluster never quietly runs somewhere else.
    """
    value = os.environ.get(RAY_ADDRESS_ENV, "").strip()
    if not value or value == "local":
        return None
    named = f"{RAY_ADDRESS_ENV}={value}"
    if value == "auto":
        path = ray_address_file()
        try:
            value = path.read_text().strip()
        except OSError:
            value = ""
        if not value:
            raise ResourceError(f"{named}, but {path} names no Ray cluster started on this machine: start one "
                                f"(`ray start --head`), set {RAY_ADDRESS_ENV} to its HOST:PORT, or unset it to run "
                                "on an embedded local cluster")
        named += f" ({path} says {value})"
    if "://" in value:
        raise PathwaysError(f"{named} is not a Ray cluster's GCS address: a runtime of this client's own starts "
                            "through HOST:PORT (e.g. 10.0.0.1:6379, what Ray sets inside a job), not through Ray "
                            "Client (ray://) or the dashboard (http://). Set it to the head's HOST:PORT, or run the "
                            "script as a Ray job (`ray job submit -- python script.py`)")
    try:
        parse_address(value)
    except PathwaysError:
        raise PathwaysError(f"{named} is not a Ray address; it looks like HOST:PORT, e.g. 10.0.0.1:6379") from None
    if not answers_grpc(value):
        raise ResourceError(f"{named} names no running Ray cluster: no Ray GCS answers at {value} (waited "
                            f"{CONNECT_TIMEOUT_S:.0f}s). Start the cluster, fix {RAY_ADDRESS_ENV}, or unset it to run "
                            "on an embedded local cluster")
    return value


# An HTTP/2 client's opening: the preface, then an empty SETTINGS frame. A gRPC server (Ray's GCS) answers with a
# SETTINGS frame of its own: 3 bytes of length, type 4.
HTTP2_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def answers_grpc(address: str, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a gRPC server (as Ray's GCS is) answers at ``address`` within ``timeout``: more than a TCP
    connection, which a dead cluster's port (or a proxy in the way) may still accept. With Ray's TLS on
    (``RAY_USE_TLS``) the plain HTTP/2 opening cannot be answered, and a TCP connection is all that is asked."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("0", "false", ""):
        return reachable(address, timeout)
    deadline = time.monotonic() + timeout
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.sendall(HTTP2_OPENING)
            header = b""
            while len(header) < 9:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    except (OSError, PathwaysError):
        return False
    return len(header) == 9 and header[3] == SETTINGS_FRAME


NOT_A_RUNTIME = ("pw.init(address=...) takes a pathways runtime's address (pathways://HOST:PORT, what `pathways up` "
                 f"prints), not a Ray cluster's. To run on a Ray cluster, set {RAY_ADDRESS_ENV} to its HOST:PORT (Ray "
                 "does inside `ray job submit`) and call pw.init(topology=...) without an address: it starts a "
                 "runtime of this client's own there. Or start a shared runtime on it with `pathways up --ray-address "
                 "HOST:PORT` and attach to the address that prints")


def not_a_runtime(address: str) -> str | None:
    """Why ``address`` is not a pathways runtime's (a Ray address, or an endpoint that does not open with the
    pathways handshake, as a runtime's endpoints do), or None: it is one, or nothing answers there (which the
    connection itself reports)."""
    text = address.strip()
    if ("://" in text and not text.startswith(SCHEME)) or text in ("auto", "local"):
        return f"{address!r} is not a pathways address: {NOT_A_RUNTIME}"
    try:
        host, port = parse_address(text)
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except (OSError, PathwaysError):
        return None
    with sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        opening = b""
        try:
            while len(opening) < len(handshake.TAG):
                chunk = sock.recv(len(handshake.TAG) - len(opening))
                if not chunk:
                    break
                opening += chunk
        except OSError:
            pass
    if opening[:4] == handshake.TAG[:4]:
        return None
    return f"what answers at {address} does not speak the pathways protocol: {NOT_A_RUNTIME}"


class Embedded:
    """A runtime of this client's own, in a child process that lives as long as this client: on the running Ray
    cluster ``ray_address`` (the child attaches to it as a Ray driver; the runtime's actors, under a name of their
    own, are removed when the child ends), else on a local Ray cluster the child starts and stops.

    The child reads its options (secrets included) from stdin, answers with the runtime's address, then waits
    for stdin to close; when this process ends, however it ends, the pipe closes and the child stops the
    runtime."""

    def __init__(self, topology: Topology, timeouts: Timeouts, admin_credential: str, tenant: str,
                 credential: str, default_quota: int | None, ray_address: str | None = None) -> None:
        options = {"topology": topology.to_wire(), "op_timeout": timeouts.op, "gap_timeout": timeouts.gap,
                   "start_timeout": timeouts.start, "grace": timeouts.grace, "admin_credential": admin_credential,
                   "tenant": tenant, "credential": credential, "default_quota": default_quota,
                   "ray_address": ray_address}
        env = {k: v for k, v in os.environ.items() if k not in (RAY_ADDRESS_ENV, ADDRESS_ENV)}
        if ray_address:
            env[RAY_ADDRESS_ENV] = ray_address  # Ray reads it before its argument: the one resolved here
        where = f"the runtime on the Ray cluster at {ray_address}" if ray_address else "the embedded cluster"
        mode = "private" if ray_address else "embedded"
        self.proc = subprocess.Popen([sys.executable, "-m", "resource_manager.launch", mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.proc.stdin.write(json.dumps(options) + "\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc, timeouts.start, where)
        answer = json.loads(line) if line else {"error": f"{where} exited before it started (its output above "
                                                "says why)", "kind": "ResourceError"}
        if "error" in answer:
            self.stop()
            raise from_wire(answer.get("kind", "ResourceError"), answer["error"])
        self.address: str = answer["address"]
        self.runtime: str = answer["runtime"]
        self.ray_address: str = answer["ray_address"]  # for operators' tools; clients never use it
        self.actor: str = answer["actor"]  # the resource manager's Ray actor name (namespace pathways)
        if ray_address:
            log.info("started a runtime of this client's own on the Ray cluster at %s (actor %s)", ray_address,
                     self.actor)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the runtime: close the child's stdin and wait for it to remove the runtime (and stop its Ray)."""
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


def _read_line(proc: subprocess.Popen, timeout: float, where: str) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise ResourceError(f"{where} did not start within {timeout:.0f}s")
    return proc.stdout.readline().strip()
