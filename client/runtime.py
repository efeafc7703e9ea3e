"""Finding a Ray cluster and the pathways runtime on it, or starting them.

``pw.init()`` with no address starts an embedded local Ray instance, unless a
live cluster's address is recorded on this machine. A recorded address whose
cluster died without ``ray stop`` would make ``ray.init`` retry the dead GCS
for minutes, so every address is checked first: a stale recorded one is
ignored (with a log line) and an explicit one that does not answer fails in
seconds, saying so.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from client.jobs import enable_token_auth
from pathways import wire
from pathways.errors import PathwaysError, ResourceError, from_wire
from pathways.names import NAMESPACE, RAY_SYSTEM_CONFIG, RESOURCE_MANAGER
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
        gap: how long an island waits for a client's message that never arrived (its sender died while
            sending) before it skips it and runs the client's later messages; fixed when the runtime starts.
    """

    fetch: float = 120.0
    op: float = 60.0
    start: float = 300.0
    poll: float = 1.0
    gap: float = 30.0


def reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def connect(address: str | None) -> bool:
    """Attach this process to the Ray cluster at ``address`` (or start an embedded one when None); returns
    whether this process started it."""
    if ray.is_initialized():
        return False
    if address:
        if address != "auto" and not reachable(address):
            raise PathwaysError(f"no Ray cluster answers at {address} (nothing accepts connections there within "
                                f"{CONNECT_TIMEOUT_S:.0f}s); start one (`pathways up`) or fix the address")
        enable_token_auth()  # before attaching: the GCS refuses a client without the token
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return False
    from ray._private.utils import read_ray_address

    recorded = read_ray_address()
    if recorded and reachable(recorded):
        enable_token_auth()  # before attaching: the GCS refuses a client without the token
        ray.init(address=recorded, namespace=NAMESPACE, logging_level=logging.WARNING)
        return False
    if recorded:
        log.warning("ignoring the Ray address recorded on this machine (%s): no cluster answers there; starting "
                    "an embedded local cluster", recorded)
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
             _system_config=RAY_SYSTEM_CONFIG)
    return True


def find_runtime() -> Any | None:
    """The resource manager running on this Ray cluster, if any."""
    try:
        return ray.get_actor(RESOURCE_MANAGER, namespace=NAMESPACE)
    except ValueError:
        return None


def start_runtime(topology: Topology, timeouts: Timeouts, admin_digest: str | None,
                  registry_path: str | None = None, implicit: dict | None = None,
                  default_quota: int | None = None) -> Any:
    """The resource manager (a detached actor that starts and owns the islands), created unless one runs
    already; ResourceError if the running one has another topology."""
    from resource_manager.manager import ResourceManager

    rm = ray.remote(ResourceManager).options(
        name=RESOURCE_MANAGER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_concurrency=4, resources={"node:__internal_head__": 0.001},  # the head outlives worker nodes
    ).remote(topology.to_wire(), timeouts.op, timeouts.gap, timeouts.start, admin_digest, registry_path, implicit,
             default_quota)
    running = Topology.from_wire(ready(rm, timeouts.start)["topology"])
    if running != topology:
        raise ResourceError(f"the cluster already runs {running}; you asked for {topology}. "
                            "Call pw.init() without a topology to attach, or start a new cluster")
    return rm


def ready(rm: Any, timeout: float) -> dict:
    """The running resource manager's reply to ``ready`` (its topology), waiting at most ``timeout`` seconds."""
    try:
        raw = ray.get(rm.ready.remote(), timeout=timeout)
    except GetTimeoutError:
        raise PathwaysError(f"the pathways runtime did not start within {timeout:.0f}s") from None
    except RayActorError as exc:
        raise ResourceError(f"the pathways runtime could not start: {exc}") from None
    msg = wire.decode(raw, "reply")
    if not msg["ok"]:
        raise from_wire(*msg["value"])
    return msg["value"]
