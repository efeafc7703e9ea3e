"""The resource manager as Ray holds it: a detached, named actor with only the calls its launcher makes.

Everything a tenant asks goes through the resource manager's client endpoint (``service``), never through
Ray. This class defines the launcher's three calls, each proven with an HMAC keyed by the admin credential's
digest, which only the admin's tools hold: ``ready`` (the runtime's address and topology), ``stop`` (end every
job and close the endpoints before ``pathways down`` removes the actors) and ``stats`` for the admin's tools.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
from typing import TYPE_CHECKING, Any

import ray

from pathways import auth
from pathways.errors import TenantAccessError

if TYPE_CHECKING:
    from resource_manager.manager import ResourceManager

log = logging.getLogger(__name__)


def launch_mac(admin_digest: str, purpose: str) -> bytes:
    """What the launcher proves for ``purpose``: an HMAC keyed by the admin credential's digest."""
    return auth.sign(bytes.fromhex(admin_digest), purpose)


def suspend_on_sigterm(rm: ResourceManager, timeout: float) -> None:
    """SIGTERM (a preemption notice) suspends the cluster into a new directory under the runtime's
    ``--suspend-dir`` instead of ending this process, which stays up, suspended: if the machine survives after
    all, ``pathways resume`` goes on here."""
    def suspend() -> None:
        directory = rm.snapshot_dir()
        try:
            log.warning("SIGTERM: suspending the cluster into %s", directory)
            rm.suspension.suspend(directory, timeout)
        except Exception as exc:  # the admin reads why in the log and in pathways status
            log.error("SIGTERM: suspending into %s failed: %s", directory, exc)

    def handler(signum: int, frame: Any) -> None:
        threading.Thread(target=suspend, name="suspend-on-sigterm", daemon=True).start()

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        log.error("cannot take SIGTERM in this process; a preemption notice will not suspend the cluster")


class ManagerActor:
    """Holds the resource manager, its job runner and its client endpoint; ``config`` is a ``Config``'s fields."""

    def __init__(self, config: dict, client_ports: list[int] | None = None) -> None:
        # Here, not at the top: the launcher imports this module for the class and ``launch_mac`` alone, and the
        # manager's modules (JAX among them, 0.8 s) load only in the actor's own process.
        from resource_manager.jobs import JobRunner
        from resource_manager.manager import Config, ResourceManager
        from resource_manager.service import ManagerService

        self._config = Config(**config)
        runtime_key, runtime_id = auth.new_key(), secrets.token_hex(8)
        self._rm = ResourceManager(self._config, runtime_key, runtime_id)
        ports = range(client_ports[0], client_ports[1] + 1) if client_ports else None
        self._service = ManagerService(self._rm, ray.util.get_node_ip_address(), ports)
        self._service.jobs = JobRunner(self._rm.registry, self._rm.tickets, runtime_id, self._service.address,
                                       self._config.jobs_dir, self._config.unsafe_jobs_as_runtime_user)
        if self._config.suspend_dir:
            suspend_on_sigterm(self._rm, self._config.suspend_timeout)

    def _check(self, mac: Any, purpose: str) -> None:
        digest = self._config.admin_digest
        if digest is None or not auth.verify(bytes.fromhex(digest), mac, purpose):
            raise TenantAccessError("refused: this method is for the runtime's launcher (`pathways up`/`down`)")

    def ready(self, mac: bytes) -> dict:
        """The runtime's client address, identity and topology."""
        self._check(mac, "ready")
        return {**self._rm.ready(), "address": self._service.address,
                "ray_address": ray.get_runtime_context().gcs_address}

    def stop(self, mac: bytes) -> int:
        """End every job and close the client endpoint (the actors are removed next); returns the jobs stopped."""
        self._check(mac, "stop")
        running = [j for j in self._service.jobs.jobs.values() if j.ended is None]
        self._service.jobs.stop_all()
        self._service.endpoint.close()
        return len(running)
