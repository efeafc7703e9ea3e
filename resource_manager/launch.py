"""Starting and stopping the runtime on a Ray cluster: the only code that is a Ray driver.

The runtime is the resource manager (a detached, named actor that starts the islands) and its client endpoint.
Clients never import Ray: they attach to the runtime's address. This module runs as a process of its own:

    python -m resource_manager.launch embedded   # pw.init() with nothing running: an embedded local Ray
                                                 # cluster and the runtime, for as long as stdin stays open
    python -m resource_manager.launch private    # pw.init() where RAY_ADDRESS names a running cluster: a
                                                 # runtime of that client's own on it, as long as stdin is open
    python -m resource_manager.launch up          # `pathways up`: the runtime on a running Ray cluster
    python -m resource_manager.launch down        # `pathways down`: stop its jobs, remove its actors

Each reads one JSON line of options on stdin (secrets never go on a command line) and answers with one JSON line
on stdout: the runtime's address, identity and topology, or ``{"error": ...}``.

``up`` names its resource manager ``resource_manager`` (detached: it outlives the command). A ``private`` runtime's
is ``resource_manager-`` and random hex, so several clients and a runtime of ``pathways up`` share one Ray cluster
without meeting, and it is not detached: it and the islands it started (their actors and placement groups are its
own) go when this process ends, by ``stop_runtime`` when stdin closes or by Ray when this process dies.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any

from pathways import auth
from pathways.errors import PathwaysError, ResourceError
from pathways.names import NAMESPACE, RAY_SYSTEM_CONFIG, RESOURCE_MANAGER
from pathways.topology import Topology

ATTACH_TIMEOUT_S = 60.0  # attaching to a running Ray cluster: seconds here, but Ray retries a wrong one for minutes
log = logging.getLogger(__name__)


def start_runtime(options: dict) -> dict:
    """Create the detached resource manager ``resource_manager`` on the Ray cluster this process is attached to
    (unless one runs already) and wait until it is ready; ResourceError if the running one has another topology."""
    return launch_runtime(options, RESOURCE_MANAGER, detached=True)[1]


def launch_runtime(options: dict, name: str, detached: bool) -> tuple[Any, dict]:
    """Create the resource manager ``name`` (a detached one only unless it runs already) and wait until it is
    ready; returns its actor handle and its ``ready`` answer, which names the actor (``actor``). One not
    ``detached`` lives while this process holds the handle: Ray removes an actor that nothing refers to."""
    import ray

    from resource_manager.actor import ManagerActor, launch_mac

    topology = Topology.from_wire(options["topology"])
    digest = auth.digest(options["admin_credential"])
    config = {"topology": topology.to_wire(), "op_timeout": options["op_timeout"],
              "gap_timeout": options["gap_timeout"], "start_timeout": options["start_timeout"],
              "grace": options["grace"], "admin_digest": digest, "registry_path": options.get("registry"),
              "implicit": ({"tenant": options["tenant"], "digest": auth.digest(options["credential"])}
                           if options.get("tenant") else None),
              "default_quota": options.get("default_quota"), "jobs_dir": options.get("jobs_dir"),
              "unsafe_jobs_as_runtime_user": bool(options.get("unsafe_jobs_as_runtime_user")),
              "suspend_dir": options.get("suspend_dir")}
    actor = ray.remote(ManagerActor).options(
        name=name, namespace=NAMESPACE, lifetime="detached" if detached else None, get_if_exists=detached, num_cpus=0,
        max_concurrency=4, resources={"node:__internal_head__": 0.001},  # the head outlives worker nodes
    ).remote(config, options.get("client_ports"))
    try:
        info = ray.get(actor.ready.remote(launch_mac(digest, "ready")), timeout=options["start_timeout"])
    except ray.exceptions.GetTimeoutError:
        raise PathwaysError(f"the pathways runtime did not start within {options['start_timeout']:.0f}s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, PathwaysError) else None
        raise cause or ResourceError(f"the pathways runtime could not start: {exc}") from None
    except ray.exceptions.RayActorError as exc:
        raise ResourceError(f"the pathways runtime could not start: {exc}") from None
    running = Topology.from_wire(info["topology"])
    if running != topology:
        raise ResourceError(f"the cluster already runs {running}; you asked for {topology}. Attach without a "
                            "topology, or start a new cluster")
    return actor, {**info, "actor": name}


def start_with_credentials(topology: dict, timeouts: dict, tenant: str = "default") -> dict:
    """Start the runtime on the Ray cluster this process is attached to, with fresh admin and tenant credentials:
    for operators' scripts that build their own Ray cluster (benchmarks and tests across nodes). Returns the
    runtime's ``ready`` answer with ``admin_credential``, ``tenant`` and ``credential`` added."""
    options = {"topology": topology, "op_timeout": timeouts.get("op", 60.0), "gap_timeout": timeouts.get("gap", 30.0),
               "start_timeout": timeouts.get("start", 300.0), "grace": timeouts.get("grace", 10.0),
               "admin_credential": auth.new_secret(), "tenant": tenant, "credential": auth.new_secret()}
    return {**start_runtime(options), **{k: options[k] for k in ("admin_credential", "tenant", "credential")}}


def stop_runtime(admin_credential: str, name: str = RESOURCE_MANAGER) -> list[str]:
    """Stop the jobs of the runtime whose resource manager is ``name``, then remove its actors (the resource manager
    first: it owns the islands, which go with it)."""
    import ray

    from resource_manager.actor import launch_mac

    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return []
    try:
        ray.get(actor.stop.remote(launch_mac(auth.digest(admin_credential), "stop")), timeout=30)
    except ray.exceptions.RayTaskError as exc:
        raise PathwaysError(f"the runtime refused to stop: {exc.cause or exc}") from None
    except Exception as exc:  # a runtime that is already dying is removed all the same
        log.warning("stopping the runtime's jobs failed: %s", exc)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return [name]
        time.sleep(0.2)
    raise PathwaysError("the resource manager survived being killed")


def _embedded(options: dict) -> None:
    import ray

    # Ray turns token authentication on for a cluster it starts and warns that it did: nobody asked, and the
    # runtime is the cluster's only driver.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
             _system_config=RAY_SYSTEM_CONFIG, num_cpus=options.get("num_cpus"))
    try:
        _answer(start_runtime(options))
        sys.stdin.read()  # until the client that started us ends (or dies): its end of the pipe closes
    finally:
        ray.shutdown()


def _private(options: dict) -> None:
    """A runtime of one client's own on the running Ray cluster ``options["ray_address"]``, until stdin closes."""
    import ray

    for sig in (signal.SIGTERM, signal.SIGHUP):  # a kill or a closed terminal still removes the runtime
        signal.signal(sig, _interrupted)
    _attach(options["ray_address"], min(ATTACH_TIMEOUT_S, options["start_timeout"]))
    name = f"{RESOURCE_MANAGER}-{secrets.token_hex(6)}"
    try:
        # ``actor`` is held to the end (stop_runtime below included): Ray removes an actor nothing refers to
        actor, info = launch_runtime(options, name, detached=False)
        _answer(info)
        sys.stdin.read()  # until the client that started us ends (or dies): its end of the pipe closes
    except KeyboardInterrupt:
        pass
    finally:
        try:
            stop_runtime(options["admin_credential"], name)
        except Exception as exc:  # not detached: Ray removes it with this process all the same
            log.warning("stopping the runtime %s: %s", name, exc)
        ray.shutdown()


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def enable_token_auth() -> None:
    """Use the local Ray token when there is one (Ray 2.60 clusters require token authentication, but Ray turns
    it on by itself only in a process that starts a cluster; one that attaches must opt in). Quietly: Ray warns
    each time it opts in, which is what was asked for. A Ray without token authentication: no-op."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def _attach(address: str, timeout: float = ATTACH_TIMEOUT_S) -> None:
    """Attach this process to the Ray cluster at ``address``; where it has not within ``timeout`` (not a Ray
    cluster, or one that refuses this process's token), answer why and exit instead of waiting on Ray's retries."""
    import ray

    attached = threading.Event()

    def give_up() -> None:
        if not attached.wait(timeout):
            _answer({"error": f"could not attach to the Ray cluster at {address} within {timeout:.0f}s (is it a "
                              "Ray cluster's GCS address, HOST:PORT, and is this machine's Ray token the "
                              "cluster's?); Ray's log lines above say more", "kind": "ResourceError"})
            os._exit(1)

    threading.Thread(target=give_up, name="attach-deadline", daemon=True).start()
    enable_token_auth()
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:  # what Ray raises for an address it cannot use
        raise ResourceError(f"could not attach to the Ray cluster at {address}: {exc}") from None
    finally:
        attached.set()


def main() -> int:
    """Run one launcher command (``embedded``, ``private``, ``up`` or ``down``) with its JSON options from stdin."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    options: dict[str, Any] = json.loads(sys.stdin.readline() or "{}")
    try:
        if mode == "embedded":
            _embedded(options)
        elif mode == "private":
            _private(options)
        elif mode == "up":
            _attach(options["ray_address"])
            _answer(start_runtime(options))
        elif mode == "down":
            _attach(options["ray_address"])
            _answer({"removed": stop_runtime(options["admin_credential"])})
        else:
            raise PathwaysError(f"unknown launcher command {mode!r}; use embedded, private, up or down")
    except PathwaysError as exc:
        _answer({"error": str(exc), "kind": type(exc).__name__})
        return 1
    return 0


def _answer(value: dict) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    sys.exit(main())
